//! Any text tokenizes and detokenizes back to itself with the byte-level BPE vocabularies of
//! Kimi K2 and DeepSeek V3 (tests/fixtures/tokenizer), special-token texts as plain text or
//! parsed as their tokens, without a panic. The first byte picks the vocabulary and the mode.
//! Run: `cargo +nightly fuzz run tokenize_roundtrip` from the repo root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_fuzz::vocabs;

// Loaded before the first input.
fuzz_target!(init: { vocabs(); }, |data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let tok = &vocabs()[(flags & 1) as usize];
    let special = flags & 2 != 0;
    let ids = tok.encode(text, false, special).expect("any text tokenizes");
    let back = tok.decode(&ids, special).expect("its own tokens decode");
    assert_eq!(back, text, "{ids:?}");
});
