//! The serving engine: slots, continuous batching, the prompt cache, sampling and stop strings
//! ([`sampling`]), structured output ([`grammar`]), tool-call formats ([`tool_format`]) and the
//! request / event types the servers use ([`request`]). It sees models through tandem-model and
//! text through tandem-tokenizer, nothing lower.

mod dry;
pub mod grammar;
mod handle;
pub mod request;
pub mod sampling;
mod scheduler;
mod slot;
pub mod stats;
pub mod tool_format;

pub use dry::DryBreakers;
pub use grammar::Constraint;
pub use handle::{Engine, EngineConfig, EngineHandle, EngineInfo, Prepared};
pub use request::{
    Event, Failure, Finish, FinishReason, LengthLimit, PositionLogprobs, Prompt, Request, Sink, Timings, TokenLogprob,
    Usage,
};
pub use sampling::{argmax, Sampler, SamplingParams, StopMatcher, StopOutput, DRY_SEQUENCE_BREAKERS};
pub use scheduler::{SlotAction, SlotDone};
pub use stats::{SlotView, Stats};
pub use tandem_model::Counts;
pub use tandem_tokenizer::TemplateSource;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error type of tandem-engine. Every message is one line and names the offending value.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A sampling parameter no sampler can use.
    #[error("invalid sampling parameter: {0}")]
    InvalidParam(String),
    /// A request no engine can run: an empty prompt, a token id outside the vocabulary, a prompt
    /// longer than the context (the serve issue).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Every slot is busy and the queue holds as many requests as it may.
    #[error("the queue is full ({0} requests waiting for a slot); retry later")]
    QueueFull(usize),
    /// A request with this id is still queued or running.
    #[error("a request with id '{0}' is already running")]
    AlreadyRunning(String),
    /// The engine is stopping or has stopped.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Chat on a model whose GGUF has no `tokenizer.chat_template`.
    #[error("the model has no chat template (tokenizer.chat_template); use Generate with a prompt")]
    NoChatTemplate,
    #[error(transparent)]
    Model(#[from] tandem_model::Error),
    #[error(transparent)]
    Tokenizer(#[from] tandem_tokenizer::Error),
}
