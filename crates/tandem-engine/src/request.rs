//! What a client asks for and what the engine sends back. Each request carries its own reply
//! [`Sink`]; the engine never knows which transport (gRPC, HTTP, a test) is on the other side.

use crate::SamplingParams;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most top-n log-probabilities a request may ask for per position.
pub const MAX_LOGPROBS: u32 = 20;

/// The prompt of a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Text, tokenized with BOS as the model asks and special-token texts parsed.
    Text(String),
    /// Token ids used as they are.
    Tokens(Vec<u32>),
    /// Chat messages `(role, content)`, rendered with the model's chat template.
    Chat(Vec<(String, String)>),
    /// OpenAI-shaped chat messages (assistant `tool_calls`, `role: tool` results, ...) and the
    /// tools offered (OpenAI's `tools`), rendered with the chat template; `kwargs` are more
    /// variables for the template (llama.cpp's `chat_template_kwargs`), over the engine's.
    Messages {
        messages: Vec<serde_json::Value>,
        tools: Vec<serde_json::Value>,
        kwargs: serde_json::Map<String, serde_json::Value>,
    },
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Client-chosen id (for [`abort`](crate::EngineHandle::abort)); empty = the engine makes one.
    pub id: String,
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Most tokens to generate; 0 = the server's cap.
    pub max_tokens: u32,
    /// Stop strings (never emitted).
    pub stop: Vec<String>,
    /// Top-n log-probabilities per generated position (0 = none).
    pub logprobs: u32,
    /// Generate past end-of-generation tokens.
    pub ignore_eos: bool,
    /// What the output must match (structured output).
    pub constraint: Option<crate::grammar::Constraint>,
    /// Logit biases of text: each token of the text (tokenized without BOS, special-token texts
    /// not parsed, as llama-server's `logit_bias` with string keys) gets the bias, on top of
    /// `sampling.logit_bias`.
    pub logit_bias_text: Vec<(String, f32)>,
    /// The text of control tokens the model generates is sent too (tool-call markers such as
    /// Kimi K2's `<|tool_call_begin|>` are control tokens); end-of-generation tokens never are.
    pub special_text: bool,
    /// The slot to run in (llama-server's `id_slot`, e.g. one whose cache a slot file restored):
    /// the request waits for it. None: the engine picks a free slot.
    pub slot: Option<usize>,
    /// When the request must be over; it then fails with [`Failure::DeadlineExceeded`].
    pub deadline: Option<Instant>,
    /// When the request arrived (queue time and time to first token count from here).
    pub arrived: Instant,
}

impl Request {
    /// A request with llama.cpp's default sampling and no limits beyond the server's.
    pub fn new(prompt: Prompt) -> Request {
        Request {
            id: String::new(),
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 0,
            stop: Vec::new(),
            logprobs: 0,
            ignore_eos: false,
            constraint: None,
            logit_bias_text: Vec::new(),
            special_text: false,
            slot: None,
            deadline: None,
            arrived: Instant::now(),
        }
    }
}

/// A token's log-probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub text: String,
    pub logprob: f32,
}

/// Log-probabilities at one generated position.
#[derive(Clone, Debug, PartialEq)]
pub struct PositionLogprobs {
    pub sampled: TokenLogprob,
    /// Most likely first.
    pub top: Vec<TokenLogprob>,
}

/// Why a generation ended normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length(LengthLimit),
    Eos,
    Cancelled,
}

/// Which limit ended a generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LengthLimit {
    /// The request's `max_tokens`.
    Request,
    /// The server's cap (`-n`).
    Server,
    /// The slot's context is full.
    Context,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    /// Prompt tokens whose KV cache was reused instead of computed.
    pub cached_tokens: u32,
    pub completion_tokens: u32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    pub queue: Duration,
    pub time_to_first_token: Duration,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
}

/// The end of a generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
}

/// Why a request ended without a [`Finish`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The request's deadline passed.
    DeadlineExceeded,
    /// The engine is shutting down.
    Unavailable(String),
    /// The model failed to run the batch (the message says why).
    Internal(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::DeadlineExceeded => write!(f, "deadline exceeded"),
            Failure::Unavailable(m) | Failure::Internal(m) => write!(f, "{m}"),
        }
    }
}

/// What the engine sends for a request, in order: `Token`s, then one `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// One sampled token and the text it completes (may be empty: held back).
    Token {
        id: u32,
        text: String,
        logprobs: Option<PositionLogprobs>,
    },
    /// The end; `text` is what was still held back (an incomplete character or stop-string prefix).
    Finished {
        text: String,
        finish: Finish,
    },
    Failed(Failure),
}

/// Where a request's events go.
pub trait Sink: Send {
    /// Delivers an event; `false` when the receiver is gone (the client disconnected).
    fn send(&mut self, event: Event) -> bool;
    /// Whether the receiver is gone; the engine then frees the request's slot.
    fn is_closed(&self) -> bool;
}

impl Sink for std::sync::mpsc::Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        std::sync::mpsc::Sender::send(self, event).is_ok()
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// A request set off by [`Abort`](crate::EngineHandle::abort) or by shutdown.
#[derive(Clone, Debug, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Natural-log probabilities of the `n` most likely tokens of a row of logits, and of `sampled`.
pub(crate) fn logprobs_of(logits: &[f32], sampled: u32, n: usize, text: impl Fn(u32) -> String) -> PositionLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    let lp = |id: u32| TokenLogprob {
        id,
        text: text(id),
        logprob: logits.get(id as usize).map_or(f32::NEG_INFINITY, |&l| l - log_sum),
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let n = n.min(ids.len());
    if n > 0 && n < ids.len() {
        ids.select_nth_unstable_by(n - 1, by_logit);
    }
    ids.truncate(n);
    ids.sort_unstable_by(by_logit);
    PositionLogprobs { sampled: lp(sampled), top: ids.into_iter().map(lp).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let p = logprobs_of(&[0.0, 2.0, 1.0, 2.0], 2, 3, |id| format!("t{id}"));
        assert_eq!(p.top.iter().map(|t| t.id).collect::<Vec<_>>(), [1, 3, 2]);
        let total: f64 = [0.0f64, 2.0, 1.0, 2.0].iter().map(|l| l.exp()).sum();
        assert!((p.sampled.logprob as f64 - (1.0f64.exp() / total).ln()).abs() < 1e-5);
        assert_eq!(p.sampled.text, "t2");
        assert!(logprobs_of(&[1.0], 0, 5, |_| String::new()).top.len() == 1);
    }
}
