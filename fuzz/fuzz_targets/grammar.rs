//! Any grammar a request carries (GBNF, Lark, a regex, a JSON schema) compiles against the Kimi K2
//! vocabulary (tests/fixtures/tokenizer) or fails with the request's error: never a panic. A grammar
//! that compiles gives a first token mask. The first byte picks the kind; the rest is its text.
//! Run: `cargo +nightly fuzz run grammar fuzz/corpus/grammar fuzz/seeds/grammar`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tandem_engine::grammar::{Constraint, Grammars};

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(&tandem_fuzz::vocabs()[0]).expect("the grammar engine"))
}

// Loaded before the first input.
fuzz_target!(init: { grammars(); }, |data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let c = match kind % 4 {
        0 => Constraint::Gbnf(text.to_string()),
        1 => Constraint::Lark(text.to_string()),
        2 => Constraint::Regex(text.to_string()),
        _ => match serde_json::from_str(text) {
            Ok(schema) => Constraint::JsonSchema(schema),
            Err(_) => return,
        },
    };
    if let Ok(mut m) = grammars().matcher(&c) {
        let _ = m.compute_mask();
    }
});
