//! Any text a model writes, streamed in chunks of any size, splits into thinking, text and tool
//! calls without a panic, and as the whole answer splits: the same thinking, the same calls, the
//! same text but for the whitespace next to a call (the whole answer trims it). The first byte
//! picks the reasoning format, whether the prompt left `<think>` open, whether tools were
//! offered, and the chunk size. Run: `cargo +nightly fuzz run model_output` from the repo root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_server::reasoning::{ReasoningFormat, Splitter};
use tandem_server::tools::{whole_answer, AnswerStream};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let format = if flags & 1 == 0 { ReasoningFormat::None } else { ReasoningFormat::Deepseek };
    let (opens, tools, step) = (flags & 2 != 0, flags & 4 != 0, 1 + (flags >> 3) as usize);
    let (w_reasoning, w_text, w_calls) = whole_answer(Splitter::new(format, opens), tools, text);

    let chars: Vec<char> = text.chars().collect();
    let chunks: Vec<String> = chars.chunks(step).map(|c| c.iter().collect()).collect();
    let (last, init) = chunks.split_last().map_or(("", &[][..]), |(l, i)| (l.as_str(), i));
    let mut s = AnswerStream::new(Splitter::new(format, opens), tools);
    let (mut reasoning, mut streamed) = (String::new(), String::new());
    for c in init {
        let (r, t) = s.push(c);
        reasoning += &r;
        streamed += &t;
    }
    let (r, t, calls) = s.finish(last);
    reasoning += &r;
    streamed += &t;
    assert_eq!(calls, w_calls, "calls of {text:?} in chunks of {step}");
    assert_eq!(reasoning, w_reasoning, "thinking of {text:?} in chunks of {step}");
    let squash = |s: &str| s.split_whitespace().collect::<String>();
    assert_eq!(squash(&streamed), squash(&w_text), "text of {text:?} in chunks of {step}");
});
