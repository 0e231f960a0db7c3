//! One request at work in a slot: its prompt, sampler, detokenizer and stop strings, and what it
//! has measured. The scheduler feeds it logits; it sends the events.

use crate::request::{logprobs_of, CancelFlag, Event, Failure, Finish, FinishReason, LengthLimit, Request, Sink};
use crate::request::{Timings, Usage};
use crate::stats::Stats;
use crate::{Sampler, StopMatcher};
use std::time::Instant;
use tandem_tokenizer::{StreamDecoder, Tokenizer};

/// A validated request on its way to a slot.
pub(crate) struct Job {
    pub id: String,
    pub req: Request,
    /// The prompt as tokens (system prompt included).
    pub tokens: Vec<u32>,
    pub sampler: Sampler,
    pub cancel: CancelFlag,
    pub sink: Box<dyn Sink>,
    /// The structured-output constraint, compiled.
    pub matcher: Option<llguidance::Matcher>,
    /// `request{id}`: what the engine logs of this request is logged inside it.
    pub span: tracing::Span,
}

/// How a request left its slot (or the queue).
pub(crate) enum End {
    Finished(FinishReason),
    /// The client went away: nothing more is sent.
    Disconnected,
    Failed(Failure),
}

/// A request in a slot.
pub(crate) struct Active {
    pub job: Job,
    /// Prompt tokens whose KV was reused.
    pub cached: usize,
    /// Prompt tokens in the cache so far (prefill is done when it reaches the prompt length).
    pub prefilled: usize,
    /// The last sampled token, not yet in the cache (decoded in the next step).
    pub pending: Option<u32>,
    pub generated: u32,
    /// The most tokens to generate and which limit that is.
    pub limit: (u32, LengthLimit),
    decoder: StreamDecoder,
    stops: StopMatcher,
    pub admitted: Instant,
    prefill_done: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// What happened after a token was sampled.
pub(crate) enum Next {
    /// Decode `pending` in the next step.
    Continue,
    End(End),
}

impl Active {
    /// `server_cap` is `-n` (0 = none); `max_tokens` 0 means the server's cap.
    pub fn new(job: Job, cached: usize, server_cap: u32, now: Instant) -> Active {
        let limit = match (job.req.max_tokens, server_cap) {
            (0, 0) => (u32::MAX, LengthLimit::Context),
            (0, cap) => (cap, LengthLimit::Server),
            (m, cap) if cap > 0 && m > cap => (cap, LengthLimit::Server),
            (m, _) => (m, LengthLimit::Request),
        };
        let stops = StopMatcher::new(&job.req.stop);
        Active {
            job,
            cached,
            prefilled: cached,
            pending: None,
            generated: 0,
            limit,
            decoder: StreamDecoder::new(),
            stops,
            admitted: now,
            prefill_done: None,
            first_token: None,
            last_token: None,
        }
    }

    pub fn prompt_len(&self) -> usize {
        self.job.tokens.len()
    }

    pub fn in_prefill(&self) -> bool {
        self.prefilled < self.prompt_len()
    }

    /// Samples from the logits of the last position and sends the token; `cache_len` is how many
    /// positions the slot holds, `n_ctx` how many it may.
    pub fn on_logits(
        &mut self,
        logits: &[f32],
        tok: &Tokenizer,
        stats: &Stats,
        cache_len: usize,
        n_ctx: usize,
    ) -> Next {
        let now = Instant::now();
        if self.prefill_done.is_none() {
            self.prefill_done = Some(now);
        }
        let masked;
        let mut for_sampling = logits;
        if self.job.req.ignore_eos || self.job.matcher.is_some() {
            let mut row = logits.to_vec();
            if let Some(m) = self.job.matcher.as_mut() {
                if let Err(e) = crate::grammar::apply_mask(m, &mut row, tok) {
                    return Next::End(End::Failed(Failure::Internal(format!("structured output: {e}"))));
                }
            }
            if self.job.req.ignore_eos {
                for id in tok.eog_ids() {
                    if let Some(l) = row.get_mut(id as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            masked = row;
            for_sampling = &masked;
        }
        let t = match self.job.sampler.sample(for_sampling) {
            Ok(t) => t,
            Err(e) => return Next::End(End::Failed(Failure::Internal(e.to_string()))),
        };
        self.job.sampler.accept(t);
        match self.last_token {
            None => stats.time_to_first_token.observe((now - self.job.req.arrived).as_secs_f64()),
            Some(prev) => stats.inter_token.observe((now - prev).as_secs_f64()),
        }
        if self.first_token.is_none() {
            self.first_token = Some(now);
        }
        self.last_token = Some(now);
        if tok.is_eog(t) && !self.job.req.ignore_eos {
            return Next::End(End::Finished(FinishReason::Eos));
        }
        let mut grammar_done = false;
        if let Some(m) = self.job.matcher.as_mut() {
            if let Err(e) = m.consume_token(t) {
                return Next::End(End::Failed(Failure::Internal(format!("structured output: {e}"))));
            }
            // nothing can follow: the output is complete
            grammar_done = m.is_stopped();
        }
        self.generated += 1;
        stats.generated_tokens.add(1);
        let logprobs = (self.job.req.logprobs > 0).then(|| {
            let text = |id: u32| String::from_utf8_lossy(tok.token_to_piece(id, true).unwrap_or(&[])).into_owned();
            // the model's distribution, before ignore_eos masked anything
            logprobs_of(logits, t, self.job.req.logprobs as usize, text)
        });
        let piece = tok.token_to_piece(t, self.job.req.special_text).unwrap_or(&[]);
        let out = self.stops.push(&self.decoder.push(piece));
        if !self.job.sink.send(Event::Token { id: t, text: out.text, logprobs }) {
            return Next::End(End::Disconnected);
        }
        if out.stopped || grammar_done {
            return Next::End(End::Finished(FinishReason::Stop));
        }
        if self.generated >= self.limit.0 {
            return Next::End(End::Finished(FinishReason::Length(self.limit.1)));
        }
        if cache_len >= n_ctx {
            return Next::End(End::Finished(FinishReason::Length(LengthLimit::Context)));
        }
        self.pending = Some(t);
        Next::Continue
    }

    /// Sends the last event of the request and records its measurements.
    pub fn end(mut self, end: End, stats: &Stats) {
        let _in = self.job.span.clone().entered();
        let now = Instant::now();
        stats.end_to_end.observe((now - self.job.req.arrived).as_secs_f64());
        match end {
            End::Finished(mut reason) => {
                stats.requests_finished.add(1);
                if reason == FinishReason::Cancelled {
                    stats.requests_cancelled.add(1);
                }
                let mut text = String::new();
                if reason != FinishReason::Stop {
                    let out = self.stops.push(&self.decoder.finish());
                    text = out.text;
                    if out.stopped {
                        reason = FinishReason::Stop;
                    } else {
                        text.push_str(&self.stops.finish());
                    }
                }
                let finish = Finish { reason, usage: self.usage(), timings: self.timings() };
                tracing::info!(
                    finish = ?finish.reason,
                    prompt_tokens = finish.usage.prompt_tokens,
                    cached_tokens = finish.usage.cached_tokens,
                    completion_tokens = finish.usage.completion_tokens,
                    queue_ms = finish.timings.queue.as_millis() as u64,
                    ttft_ms = finish.timings.time_to_first_token.as_millis() as u64,
                    prefill_tps = format_args!("{:.1}", finish.timings.prefill_tokens_per_second),
                    decode_tps = format_args!("{:.1}", finish.timings.decode_tokens_per_second),
                    "request finished"
                );
                self.job.sink.send(Event::Finished { text, finish });
            }
            End::Disconnected => {
                tracing::info!(completion_tokens = self.generated, "the client went away");
                stats.requests_cancelled.add(1)
            }
            End::Failed(f) => {
                tracing::warn!(failure = ?f, "request failed");
                stats.requests_failed.add(1);
                self.job.sink.send(Event::Failed(f));
            }
        }
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len() as u32,
            cached_tokens: self.cached as u32,
            completion_tokens: self.generated,
        }
    }

    fn timings(&self) -> Timings {
        let rate = |n: f64, from: Instant, to: Instant| {
            let s = (to - from).as_secs_f64();
            if s > 0.0 {
                n / s
            } else {
                0.0
            }
        };
        let computed = (self.prompt_len() - self.cached) as f64;
        Timings {
            queue: self.admitted - self.job.req.arrived,
            time_to_first_token: self.first_token.map(|t| t - self.job.req.arrived).unwrap_or_default(),
            prefill_tokens_per_second: self.prefill_done.map_or(0.0, |d| rate(computed, self.admitted, d)),
            decode_tokens_per_second: match (self.first_token, self.last_token) {
                (Some(a), Some(b)) if self.generated > 1 => rate((self.generated - 1) as f64, a, b),
                _ => 0.0,
            },
        }
    }
}

/// Ends a request that never reached a slot.
pub(crate) fn end_queued(mut job: Job, end: End, stats: &Stats) {
    let _in = job.span.clone().entered();
    tracing::info!(prompt_tokens = job.tokens.len(), "request ended before a slot was free");
    stats.end_to_end.observe(job.req.arrived.elapsed().as_secs_f64());
    match end {
        End::Finished(reason) => {
            stats.requests_finished.add(1);
            stats.requests_cancelled.add(u64::from(reason == FinishReason::Cancelled));
            let usage = Usage { prompt_tokens: job.tokens.len() as u32, ..Usage::default() };
            let timings = Timings { queue: job.req.arrived.elapsed(), ..Timings::default() };
            job.sink.send(Event::Finished { text: String::new(), finish: Finish { reason, usage, timings } });
        }
        End::Disconnected => stats.requests_cancelled.add(1),
        End::Failed(f) => {
            stats.requests_failed.add(1);
            job.sink.send(Event::Failed(f));
        }
    }
}
