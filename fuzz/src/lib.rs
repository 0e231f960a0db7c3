//! What the fuzz targets share: the repository's fixtures, loaded once per target.

use std::path::PathBuf;
use std::sync::OnceLock;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_tokenizer::{ChatTemplate, Tokenizer};

/// `tests/fixtures/tokenizer/NAME`.
fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer").join(name)
}

/// The tokenizer of the vocabulary fixture `name`, its file read rather than mapped: a mapped file
/// leaves its name registered for the process's life (tandem-gguf's SIGBUS guard), which the leak
/// check would count against an input.
fn tokenizer(name: &str) -> Tokenizer {
    let g = GgufModel::open(fixture(name), LoadOptions { mmap: false, ..LoadOptions::default() })
        .expect("the fixture vocabulary");
    Tokenizer::from_gguf(&g).expect("a tokenizer")
}

/// The chat template fixture `templates/NAME`.
fn template(name: &str) -> ChatTemplate {
    let src = std::fs::read_to_string(fixture("templates").join(name)).expect("the fixture template");
    ChatTemplate::new(&src, "<s>", "</s>").expect("a template")
}

/// The tokenizers of Kimi K2 and DeepSeek V3, loaded once.
pub fn vocabs() -> &'static [Tokenizer; 2] {
    static V: OnceLock<[Tokenizer; 2]> = OnceLock::new();
    V.get_or_init(|| ["vocab-kimi-k2.gguf", "vocab-deepseek-v3.gguf"].map(tokenizer))
}

/// The chat templates of Kimi K2 and DeepSeek V3, loaded once.
pub fn templates() -> &'static [ChatTemplate; 2] {
    static T: OnceLock<[ChatTemplate; 2]> = OnceLock::new();
    T.get_or_init(|| ["kimi-k2.jinja", "deepseek-v3.jinja"].map(template))
}
