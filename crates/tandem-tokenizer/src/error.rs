//! The error type of tandem-tokenizer. Every message is one line and names what was wrong.

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The GGUF metadata lacks a key or has it with the wrong type.
    #[error(transparent)]
    Gguf(#[from] tandem_gguf::Error),
    /// `tokenizer.ggml.model` names a tokenizer tandem does not implement.
    #[error("{path}: unsupported tokenizer model '{model}' (tokenizer.ggml.model); supported: gpt2 (byte-level BPE), llama (SentencePiece)")]
    UnknownModel { path: String, model: String },
    /// `tokenizer.ggml.pre` names a pre-tokenizer tandem does not implement.
    #[error("{path}: unknown pre-tokenizer '{pre}' (tokenizer.ggml.pre); supported: {supported}")]
    UnknownPre { path: String, pre: String, supported: String },
    /// The vocabulary is unusable (empty, arrays of different lengths, ...).
    #[error("{path}: bad vocabulary: {msg}")]
    BadVocab { path: String, msg: String },
    /// A pre-tokenizer regex failed to compile or ran out of its backtracking budget.
    #[error("pre-tokenizer regex: {0}")]
    Regex(String),
    /// A SentencePiece vocabulary has neither a byte token nor `<unk>` for a byte of the input.
    #[error("the vocabulary has no token for byte 0x{0:02X} (no <0x{0:02X}> byte token and no <unk>)")]
    NoByteToken(u8),
    /// A token id is not in the vocabulary.
    #[error("token id {id} is out of range (vocabulary of {n_vocab})")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    /// The chat template failed to parse or to render (including `raise_exception`).
    #[error("chat template: {0}")]
    Template(String),
    /// The model has no chat template and none was given.
    #[error("{0}: the model has no chat template (tokenizer.chat_template); give one with --chat-template FILE")]
    NoTemplate(String),
}

impl From<minijinja::Error> for Error {
    fn from(e: minijinja::Error) -> Error {
        // minijinja's Display adds the template name and line; keep the first line (our one-line rule)
        let mut msg = match e.kind() {
            minijinja::ErrorKind::InvalidOperation if e.detail().is_some() => {
                e.detail().unwrap_or_default().to_string()
            }
            minijinja::ErrorKind::OutOfFuel => {
                "rendering ran past its budget for this conversation (a loop or a value that grows without end)"
                    .to_string()
            }
            _ => e.to_string(),
        };
        if let Some(line) = e.line() {
            msg = format!("{msg} (line {line})");
        }
        Error::Template(msg.lines().next().unwrap_or_default().to_string())
    }
}
