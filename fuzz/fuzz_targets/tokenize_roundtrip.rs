//! Any text tokenizes and detokenizes back to itself with the byte-level BPE vocabularies of
//! Kimi K2 and DeepSeek V3 (tests/fixtures/tokenizer), special-token texts as plain text or
//! parsed as their tokens, without a panic. The first byte picks the vocabulary and the mode.
//! Run: `cargo +nightly fuzz run tokenize_roundtrip` from the repo root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_tokenizer::Tokenizer;

fn vocabs() -> &'static [Tokenizer; 2] {
    static V: OnceLock<[Tokenizer; 2]> = OnceLock::new();
    V.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
        ["vocab-kimi-k2.gguf", "vocab-deepseek-v3.gguf"].map(|f| {
            let g = GgufModel::open(dir.join(f), LoadOptions { mmap: false, ..LoadOptions::default() }).expect("the fixture vocabulary");
            Tokenizer::from_gguf(&g).expect("a tokenizer")
        })
    })
}

// The vocabularies are loaded before the first input, and read rather than mapped: a mapped file
// leaves its name registered for the process's life (tandem-gguf's SIGBUS guard), which the leak
// check would count against an input.
fuzz_target!(init: { vocabs(); }, |data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let tok = &vocabs()[(flags & 1) as usize];
    let special = flags & 2 != 0;
    let ids = tok.encode(text, false, special).expect("any text tokenizes");
    let back = tok.decode(&ids, special).expect("its own tokens decode");
    assert_eq!(back, text, "{ids:?}");
});
