//! The error type of tandem-plan. Every message is one line and names the offending flag, rule,
//! device, key or file, so a bad command line never ends in a panic or a guess.

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `-ot` / `--override-tensor` argument that is not `PATTERN=DEVICE[,PATTERN=DEVICE...]`.
    #[error("--override-tensor '{arg}': {msg}")]
    BadRule { arg: String, msg: String },
    /// A rule's pattern is not a valid regular expression; `position` is a 0-based byte offset.
    #[error("--override-tensor '{arg}': invalid regex '{pattern}' at position {position}: {msg}")]
    BadRegex { arg: String, pattern: String, position: usize, msg: String },
    /// A rule or flag names a device that is not declared.
    #[error("{context}: unknown device '{device}'; available: {available}")]
    UnknownDevice { context: String, device: String, available: String },
    /// A `--gpu NAME=SIZE` (or other device/size) argument that does not parse.
    #[error("{flag} '{value}': {msg}")]
    BadValue { flag: String, value: String, msg: String },
    /// Flags that contradict each other.
    #[error("{0}")]
    Conflict(String),
    /// The model's headers lack something the planner needs, or hold an impossible value.
    #[error("{path}: {msg}")]
    Model { path: String, msg: String },
    #[error(transparent)]
    Gguf(#[from] tandem_gguf::Error),
    /// The replica generator was given something it cannot write.
    #[error("replica: {0}")]
    Replica(String),
    /// Writing the header-only replica failed.
    /// (The io error is shown, not chained as a source, so `{:#}` prints it once.)
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
}

impl Error {
    pub(crate) fn bad_value(flag: &str, value: &str, msg: impl Into<String>) -> Error {
        Error::BadValue { flag: flag.to_string(), value: value.to_string(), msg: msg.into() }
    }

    pub(crate) fn io(path: &std::path::Path, error: std::io::Error) -> Error {
        Error::Io { path: path.display().to_string(), error }
    }
}
