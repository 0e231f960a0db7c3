//! The error type of tandem-gguf. Every message is one line and names the file, key or tensor.

use std::path::Path;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The cause is part of the message rather than a `source`, so `{:#}` chains print it once.
    #[error("{path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    /// The bytes are not a valid GGUF file; `offset` is where reading stopped.
    #[error("{path}: invalid GGUF at byte {offset}: {msg}")]
    Malformed { path: String, offset: u64, msg: String },
    #[error("{path}: metadata key '{key}' not found")]
    MissingKey { path: String, key: String },
    #[error("{path}: metadata key '{key}': expected {expected}, found {found}")]
    WrongType { path: String, key: String, expected: String, found: String },
    #[error("{path}: tensor '{name}' not found")]
    MissingTensor { path: String, name: String },
    /// A split (multi-shard) model is inconsistent; the message names the shard.
    #[error("{0}")]
    Split(String),
    #[error("{path}: mlock failed: {cause} (raise the locked-memory limit, e.g. `ulimit -l unlimited`)")]
    Mlock { path: String, cause: std::io::Error },
    /// The writer was asked to write something that is not a valid GGUF file.
    #[error("GGUF writer: {0}")]
    Write(String),
}

impl Error {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Error {
        Error::Io { path: path.display().to_string(), cause: source }
    }
}
