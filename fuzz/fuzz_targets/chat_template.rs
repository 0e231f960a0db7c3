//! Any messages and tools a client sends (JSON) render with the Kimi K2 and DeepSeek V3 chat
//! templates (tests/fixtures/tokenizer/templates) or fail with an error: never a panic, a hang or
//! unbounded output (the renderer's fuel). The first byte picks the template and the generation
//! prompt; the rest is `{"messages": [...], "tools": [...]}`. Seeds: fuzz/seeds/chat_template.
//! Run: `cargo +nightly fuzz run chat_template fuzz/corpus/chat_template fuzz/seeds/chat_template`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tandem_fuzz::templates;

// Loaded before the first input.
fuzz_target!(init: { templates(); }, |data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let Ok(v) = serde_json::from_slice::<Value>(rest) else { return };
    let Some(messages) = v.get("messages").and_then(Value::as_array) else { return };
    let tools = v.get("tools").and_then(Value::as_array).map(Vec::as_slice);
    let t = &templates()[(flags & 1) as usize];
    let _ = t.render_with(messages, tools, flags & 2 != 0, &serde_json::Map::new());
});
