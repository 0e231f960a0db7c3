//! GGUF tokenizers and chat templates, matching llama.cpp token for token.
//!
//! * [`Tokenizer`]: byte-level BPE (`tokenizer.ggml.model = gpt2`) with the pre-tokenizer named
//!   by `tokenizer.ggml.pre` (default, llama-bpe, deepseek-v3, kimi-k2, qwen2, smollm, gpt-4o, ...)
//!   and SentencePiece (`llama`) with byte fallback; special tokens, BOS/EOS as the model asks,
//!   control-token texts parsed only when asked. Ported from llama.cpp's src/llama-vocab.cpp and
//!   src/unicode.cpp, including their quirks, and checked against llama.cpp's output.
//! * [`StreamDecoder`]: token pieces -> text that never contains half a UTF-8 character.
//! * [`ChatTemplate`]: `tokenizer.chat_template` rendered with minijinja the way transformers
//!   renders it with jinja2.
//!
//! ```no_run
//! use tandem_tokenizer::{ChatTemplate, Tokenizer, message};
//! let gguf = tandem_gguf::GgufModel::open("model.gguf", Default::default())?;
//! let tok = Tokenizer::from_gguf(&gguf)?;
//! let tmpl = ChatTemplate::new(tok.chat_template().unwrap_or_default(), tok.bos_text(), tok.eos_text())?;
//! let prompt = tmpl.render(&[message("user", "Hello!")], None, true)?;
//! let ids = tok.encode(&prompt, true, true)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod merge;
mod pretokenize;
mod splitters;
mod template;
mod tokenizer;
mod unicode;
mod unicode_data;
pub mod vocab;

pub use error::{Error, Result};
pub use pretokenize::{supported_pre_tokenizers, PreTokenizer};
pub use template::{choose_template, message, resolve_template_arg, ChatTemplate, TemplateSource, BUILTIN_TEMPLATES};
pub use tokenizer::{StreamDecoder, Tokenizer};
pub use vocab::{SpecialIds, VocabKind};
