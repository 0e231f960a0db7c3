//! Tool calls as the real chat templates write them (tandem-tokenizer's built-ins, copied from
//! the models' own templates) parse back into the same calls: an assistant turn with a call is
//! rendered, the model's part of the transcript is cut out, and `tools::parse` must find the call.

use serde_json::json;
use tandem_server::tools::{parse, ToolCall};
use tandem_tokenizer::{ChatTemplate, BUILTIN_TEMPLATES};

fn template(name: &str) -> ChatTemplate {
    let src = BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == name).unwrap().1;
    ChatTemplate::new(src, "<s>", "</s>").unwrap()
}

/// The transcript of an assistant turn that calls get_weather(city=Paris), without what the
/// template writes before the turn (the same conversation rendered up to the generation prompt).
fn assistant_turn(name: &str) -> String {
    let t = template(name);
    let tools =
        [json!({"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}}}})];
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let call = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]});
    let before = t.render(std::slice::from_ref(&user), Some(&tools), true).unwrap();
    let all = t.render(&[user, call], Some(&tools), false).unwrap();
    // the generation prompt may open more than the transcript holds (DeepSeek-R1's `<think>`)
    let prefix = [before.as_str(), before.trim_end().trim_end_matches("<think>")]
        .into_iter()
        .find(|p| all.starts_with(p))
        .unwrap_or_else(|| panic!("{name}: the conversation does not extend the prompt:\n{before}\n---\n{all}"));
    // the model's own part ends at its end-of-turn token, which ends generation (not text)
    let turn = &all[prefix.len()..];
    let end = ["<|eot_id|>", "<|im_end|>", "<｜end▁of▁sentence｜>"].iter().filter_map(|e| turn.find(e)).min();
    turn[..end.unwrap_or(turn.len())].to_string()
}

#[test]
fn calls_rendered_by_the_real_templates_parse_back() {
    let want = vec![ToolCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }];
    for name in ["kimi-k2", "hermes", "qwen", "deepseek3", "deepseek-r1", "llama3"] {
        let turn = assistant_turn(name);
        let (content, calls) = parse(&turn);
        assert_eq!(calls, want, "{name}: {turn:?}");
        assert!(!content.contains("get_weather"), "{name}: {content:?}");
        println!("{name}: {turn:?}");
    }
}

fn vocab(name: &str) -> tandem_tokenizer::Tokenizer {
    let path = format!("{}/tests/fixtures/tokenizer/vocab-{name}.gguf", env!("CARGO_MANIFEST_DIR"));
    let gguf = tandem_gguf::GgufModel::open(&path, tandem_gguf::LoadOptions::default()).unwrap();
    tandem_tokenizer::Tokenizer::from_gguf(&gguf).unwrap()
}

/// How many tokens of `text` (control-token texts parsed) the forced-call grammar takes, and
/// whether it may end there.
fn forced(template: &str, vocab: &tandem_tokenizer::Tokenizer, only: Option<&str>, text: &str) -> (usize, usize, bool) {
    forced_after(template, vocab, only, text, false)
}

fn forced_after(
    template: &str,
    vocab: &tandem_tokenizer::Tokenizer,
    only: Option<&str>,
    text: &str,
    think_open: bool,
) -> (usize, usize, bool) {
    use tandem_engine::tool_format::{call_grammar, ToolFormat};
    let src = BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == template).unwrap().1;
    let tools = [
        json!({"type": "function", "function": {"name": "get_weather", "parameters":
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
        json!({"type": "function", "function": {"name": "get_time"}}),
    ];
    let lark = call_grammar(ToolFormat::of_template(src), &tools, only, only.is_none(), vocab, think_open).unwrap();
    if vocab.token_id("<|tool_calls_section_begin|>").is_some() {
        // the call markers are control tokens of this vocabulary: the grammar names them by id
        assert!(lark.contains("<[") && !lark.contains("\"<|tool_call_begin|>\""), "{template}: {lark}");
    }
    let mut m =
        tandem_engine::grammar::Grammars::new(vocab).unwrap().lark_matcher(lark.clone(), "tool_choice").unwrap();
    let ids = vocab.encode(text, false, true).unwrap();
    let n = m.validate_tokens(&ids).unwrap();
    let whole = n == ids.len() && m.consume_tokens(&ids).is_ok() && m.is_accepting().unwrap_or(false);
    (n, ids.len(), whole)
}

/// A byte-level vocabulary whose tool-call markers are control tokens, as in the real Kimi K2 and
/// DeepSeek V3 GGUFs (the committed vocabulary fixtures are cut short before them).
fn vocab_with_control_markers() -> tandem_tokenizer::Tokenizer {
    use tandem_engine::tool_format::*;
    // GPT-2's byte-to-character map: printable bytes stand for themselves, the others for 256 + n
    let mut tokens = vec!["<s>".to_string(), "</s>".to_string()];
    let mut n = 0;
    for b in 0..256u32 {
        let c = if (b'!' as u32..=b'~' as u32).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        {
            b
        } else {
            n += 1;
            255 + n
        };
        tokens.push(char::from_u32(c).unwrap().to_string());
    }
    let markers =
        [KIMI_BEGIN, KIMI_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, DS_BEGIN, DS_END, DS_CALL, DS_SEP, DS_CALL_END];
    let mut types = vec![3i32, 3];
    types.extend(std::iter::repeat_n(1, 256));
    for m in markers {
        tokens.push(m.to_string());
        types.push(3);
    }
    let mut w = tandem_gguf::GgufWriter::new();
    w.add("general.architecture", "llama").add("tokenizer.ggml.model", "gpt2").add("tokenizer.ggml.pre", "default");
    w.add("tokenizer.ggml.tokens", tokens).add("tokenizer.ggml.token_type", types);
    w.add("tokenizer.ggml.merges", Vec::<String>::new());
    w.add("tokenizer.ggml.bos_token_id", 0u32).add("tokenizer.ggml.eos_token_id", 1u32);
    let file = tandem_gguf::GgufFile::from_bytes(w.to_bytes().unwrap(), "markers").unwrap();
    tandem_tokenizer::Tokenizer::from_metadata(file.metadata()).unwrap()
}

#[test]
fn the_forced_call_grammar_takes_each_templates_own_call() {
    for (template, v) in [
        ("kimi-k2", "kimi-k2"),
        ("kimi-k2", "markers"),
        ("deepseek3", "deepseek-v3"),
        ("deepseek3", "markers"),
        ("deepseek-r1", "deepseek-v3"),
        ("deepseek-r1", "markers"),
        ("hermes", "qwen2"),
        ("qwen", "qwen2"),
        ("llama3", "llama-bpe"),
    ] {
        let tok = if v == "markers" { vocab_with_control_markers() } else { vocab(v) };
        let turn = assistant_turn(template);
        let turn = turn.trim();
        for only in [None, Some("get_weather")] {
            let (n, all, whole) = forced(template, &tok, only, turn);
            assert!(whole, "{template} ({only:?}): {n} of {all} tokens of {turn:?} taken, or it may not end there");
        }
        // another function than the one named, and text instead of a call, are refused
        let (n, all, whole) = forced(template, &tok, Some("get_time"), turn);
        assert!(!whole && n < all, "{template}: a get_weather call was taken where get_time is forced");
        let (n, all, _) = forced(template, &tok, None, &format!("Sure! {turn}"));
        assert!(n < all, "{template}: text before the call was taken");
        println!("{template} ({v}): the forced grammar takes {turn:?}");
    }
}

/// DeepSeek-R1's generation prompt leaves `<think>` open: the forced call comes after the
/// thinking, which ends at the first `</think>`.
#[test]
fn a_forced_call_follows_an_open_thinking_block() {
    let tok = vocab_with_control_markers();
    let call = assistant_turn("deepseek-r1");
    let call = call.trim();
    let thought = format!("The user wants the weather. I should call get_weather.</think>\n\n{call}");
    assert!(forced_after("deepseek-r1", &tok, None, &thought, true).2, "{thought:?}");
    // without the thinking closed, or with text after it instead of a call, it is refused
    assert!(!forced_after("deepseek-r1", &tok, None, "Just thinking", true).2);
    let (n, all, _) = forced_after("deepseek-r1", &tok, None, "Hmm.</think>\n\nIt is sunny.", true);
    assert!(n < all, "text after the thinking was taken");
    // a call without thinking first, when the prompt opened it, is only more thinking (not accepted)
    assert!(!forced_after("deepseek-r1", &tok, None, call, true).2);
}
