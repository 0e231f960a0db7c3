//! Translation between the protobuf messages and the engine's types, and from engine errors to
//! gRPC status codes. Nothing here trusts the client: every field is checked or clamped.

use crate::{pb, SamplingDefaults};
use std::time::{Duration, Instant};
use tandem_engine::{
    Constraint, Error as EngineError, Event, Failure, Finish, FinishReason, LengthLimit, PositionLogprobs, Prompt,
    Request, SamplingParams, TokenLogprob,
};
use tonic::metadata::MetadataMap;
use tonic::Status;

/// Most stop strings per request, and bytes per stop string.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;
/// Longest request id, in bytes.
const MAX_ID_BYTES: usize = 256;

/// The gRPC status for an engine error.
pub fn status(e: &EngineError) -> Status {
    let msg = e.to_string();
    match e {
        EngineError::InvalidParam(_) | EngineError::InvalidRequest(_) | EngineError::Tokenizer(_) => {
            Status::invalid_argument(msg)
        }
        EngineError::QueueFull(_) => Status::resource_exhausted(msg),
        EngineError::AlreadyRunning(_) => Status::already_exists(msg),
        EngineError::Unavailable(_) => Status::unavailable(msg),
        EngineError::NoChatTemplate => Status::failed_precondition(msg),
        EngineError::Model(_) => Status::internal(msg),
    }
}

/// The status a failed stream ends with.
pub fn failure_status(f: &Failure, generated: u32) -> Status {
    match f {
        Failure::DeadlineExceeded => {
            Status::deadline_exceeded(format!("deadline exceeded after {generated} generated tokens"))
        }
        Failure::Unavailable(m) => Status::unavailable(m.clone()),
        Failure::Internal(m) => Status::internal(m.clone()),
    }
}

/// The call's deadline from its `grpc-timeout` header (gRPC over HTTP/2: 1-8 digits and a unit,
/// H M S m u n). A malformed header is refused rather than ignored.
pub fn deadline(md: &MetadataMap, now: Instant) -> Result<Option<Instant>, Status> {
    let Some(v) = md.get("grpc-timeout") else { return Ok(None) };
    let bad = || Status::invalid_argument(format!("malformed grpc-timeout header {v:?}"));
    let s = v.to_str().map_err(|_| bad())?;
    if s.len() < 2 || s.len() > 9 {
        return Err(bad());
    }
    let (digits, unit) = s.split_at(s.len() - 1);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let d = match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(bad()),
    };
    Ok(Some(now.checked_add(d).unwrap_or(now + Duration::from_secs(365 * 24 * 3600))))
}

fn sampling(p: Option<pb::SamplingParams>, defaults: &SamplingDefaults) -> SamplingParams {
    let d = SamplingParams { seed: defaults.seed.unwrap_or(0), ..defaults.params.clone() };
    let Some(p) = p else { return d };
    SamplingParams {
        temperature: p.temperature.unwrap_or(d.temperature),
        top_k: p.top_k.map_or(d.top_k, |k| k as usize),
        top_p: p.top_p.unwrap_or(d.top_p),
        min_p: p.min_p.unwrap_or(d.min_p),
        repeat_penalty: p.repeat_penalty.unwrap_or(d.repeat_penalty),
        presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
        penalty_last_n: p.penalty_last_n.map_or(d.penalty_last_n, |n| n as usize),
        seed: p.seed.unwrap_or(d.seed),
        typical_p: p.typical_p.unwrap_or(d.typical_p),
        top_n_sigma: p.top_n_sigma.unwrap_or(d.top_n_sigma),
        xtc_probability: p.xtc_probability.unwrap_or(d.xtc_probability),
        xtc_threshold: p.xtc_threshold.unwrap_or(d.xtc_threshold),
        mirostat: p.mirostat.map_or(d.mirostat, |m| m.min(255) as u8),
        mirostat_tau: p.mirostat_tau.unwrap_or(d.mirostat_tau),
        mirostat_eta: p.mirostat_eta.unwrap_or(d.mirostat_eta),
        dry_multiplier: p.dry_multiplier.unwrap_or(d.dry_multiplier),
        dry_base: p.dry_base.filter(|&b| b >= 1.0).unwrap_or(d.dry_base),
        dry_allowed_length: p.dry_allowed_length.unwrap_or(d.dry_allowed_length),
        dry_penalty_last_n: p.dry_penalty_last_n.unwrap_or(d.dry_penalty_last_n),
        dry_sequence_breakers: match p.dry_sequence_breakers.is_empty() {
            true => d.dry_sequence_breakers,
            false => p.dry_sequence_breakers,
        },
        logit_bias: match p.logit_bias.is_empty() {
            true => d.logit_bias,
            false => {
                let mut b: Vec<(u32, f32)> = p.logit_bias.into_iter().collect();
                b.sort_unstable_by_key(|e| e.0);
                b
            }
        },
    }
}

fn check_id(id: &str) -> Result<(), Status> {
    if id.len() > MAX_ID_BYTES {
        return Err(Status::invalid_argument(format!("request_id is {} bytes, at most {MAX_ID_BYTES}", id.len())));
    }
    Ok(())
}

fn request(
    id: String,
    prompt: Prompt,
    s: Option<pb::SamplingParams>,
    o: Option<pb::GenerationOptions>,
    deadline: Option<Instant>,
    arrived: Instant,
    d: &SamplingDefaults,
) -> Result<Request, Status> {
    check_id(&id)?;
    let o = o.unwrap_or_default();
    if o.stop.len() > MAX_STOPS {
        return Err(Status::invalid_argument(format!("{} stop strings, at most {MAX_STOPS}", o.stop.len())));
    }
    if let Some(s) = o.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(Status::invalid_argument(format!("a stop string is {} bytes, at most {MAX_STOP_BYTES}", s.len())));
    }
    use pb::generation_options::Constraint as C;
    let constraint = match o.constraint {
        None | Some(C::JsonObject(false)) => None,
        Some(C::JsonObject(true)) => Some(Constraint::JsonObject),
        Some(C::JsonSchema(text)) => match serde_json::from_str(&text) {
            Ok(v) => Some(Constraint::JsonSchema(v)),
            Err(e) => return Err(Status::invalid_argument(format!("json_schema is not JSON: {e}"))),
        },
        Some(C::Grammar(g)) => Some(Constraint::Gbnf(g)),
        Some(C::Regex(r)) => Some(Constraint::Regex(r)),
    };
    Ok(Request {
        id,
        prompt,
        sampling: sampling(s, d),
        max_tokens: o.max_tokens,
        stop: o.stop,
        logprobs: o.logprobs,
        ignore_eos: o.ignore_eos,
        constraint,
        logit_bias_text: Vec::new(),
        special_text: false,
        slot: o.slot.map(|k| k as usize),
        deadline,
        arrived,
    })
}

pub fn generate_request(
    r: pb::GenerateRequest,
    deadline: Option<Instant>,
    arrived: Instant,
    d: &SamplingDefaults,
) -> Result<Request, Status> {
    let prompt = match r.prompt {
        Some(pb::generate_request::Prompt::Text(t)) => Prompt::Text(t),
        Some(pb::generate_request::Prompt::Tokens(t)) => Prompt::Tokens(t.ids),
        None => return Err(Status::invalid_argument("the prompt is empty (set text or tokens)")),
    };
    request(r.request_id, prompt, r.sampling, r.options, deadline, arrived, d)
}

pub fn chat_request(
    mut r: pb::ChatRequest,
    deadline: Option<Instant>,
    arrived: Instant,
    d: &SamplingDefaults,
) -> Result<Request, Status> {
    let forced = match r.tool_choice.as_str() {
        "" | "auto" => None,
        "none" => {
            r.tools.clear();
            None
        }
        "required" if r.tools.is_empty() => {
            return Err(Status::invalid_argument("tool_choice \"required\" needs tools"))
        }
        "required" => Some(None),
        name if r.tools.iter().any(|t| t.name == name) => Some(Some(name.to_string())),
        name => {
            return Err(Status::invalid_argument(format!("tool_choice names {name:?}, which is not among the tools")))
        }
    };
    let rich = !r.tools.is_empty()
        || !r.chat_template_kwargs_json.trim().is_empty()
        || r.messages.iter().any(|m| !m.tool_calls.is_empty() || m.role == "tool");
    if !rich {
        let messages = r.messages.into_iter().map(|m| (m.role, m.content)).collect();
        return request(r.request_id, Prompt::Chat(messages), r.sampling, r.options, deadline, arrived, d);
    }
    let json = |what: &str, text: &str| -> Result<serde_json::Value, Status> {
        if text.is_empty() {
            return Ok(serde_json::json!({}));
        }
        serde_json::from_str(text).map_err(|e| Status::invalid_argument(format!("{what}: not JSON: {e}")))
    };
    let mut tools = Vec::with_capacity(r.tools.len());
    for t in &r.tools {
        if t.name.is_empty() {
            return Err(Status::invalid_argument("a tool has no name"));
        }
        let params = json(&format!("tool {} parameters_json", t.name), &t.parameters_json)?;
        tools.push(serde_json::json!({"type": "function", "function":
            {"name": t.name, "description": t.description, "parameters": params}}));
    }
    let mut messages = Vec::with_capacity(r.messages.len());
    for m in r.messages {
        let mut v = serde_json::json!({"role": m.role, "content": m.content});
        if !m.tool_calls.is_empty() {
            let mut calls = Vec::new();
            for c in &m.tool_calls {
                let args = json(&format!("tool call {} arguments_json", c.name), &c.arguments_json)?;
                calls.push(serde_json::json!({"id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": args}}));
            }
            v["tool_calls"] = calls.into();
        }
        if !m.tool_call_id.is_empty() {
            v["tool_call_id"] = m.tool_call_id.into();
        }
        messages.push(v);
    }
    let offered = !tools.is_empty();
    let parallel = r.parallel_tool_calls;
    let call = forced.map(|name| tandem_engine::Constraint::ToolCall { tools: tools.clone(), name, parallel });
    let kwargs = match r.chat_template_kwargs_json.trim() {
        "" => serde_json::Map::new(),
        text => match json("chat_template_kwargs_json", text)? {
            serde_json::Value::Object(m) => m,
            other => {
                return Err(Status::invalid_argument(format!("chat_template_kwargs_json: {other} is not an object")))
            }
        },
    };
    let prompt = Prompt::Messages { messages, tools, kwargs };
    let mut req = request(r.request_id, prompt, r.sampling, r.options, deadline, arrived, d)?;
    if let Some(c) = call {
        if req.constraint.is_some() {
            return Err(Status::invalid_argument(
                "tool_choice \"required\" or a tool's name cannot be combined with an output constraint",
            ));
        }
        req.constraint = Some(c);
    }
    // call markers are control tokens in some vocabularies (Kimi K2's)
    req.special_text = offered;
    Ok(req)
}

fn logprob(t: TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob { token_id: t.id, text: t.text, logprob: t.logprob }
}

fn position(p: PositionLogprobs) -> pb::PositionLogprobs {
    pb::PositionLogprobs { sampled: Some(logprob(p.sampled)), top: p.top.into_iter().map(logprob).collect() }
}

fn finish(f: Finish) -> pb::Finish {
    let (reason, limit) = match f.reason {
        FinishReason::Stop => (pb::FinishReason::Stop, pb::LengthLimit::Unspecified),
        FinishReason::Eos => (pb::FinishReason::Eos, pb::LengthLimit::Unspecified),
        FinishReason::Cancelled => (pb::FinishReason::Cancelled, pb::LengthLimit::Unspecified),
        FinishReason::Length(l) => (
            pb::FinishReason::Length,
            match l {
                LengthLimit::Request => pb::LengthLimit::Request,
                LengthLimit::Server => pb::LengthLimit::Server,
                LengthLimit::Context => pb::LengthLimit::Context,
            },
        ),
    };
    let t = f.timings;
    pb::Finish {
        reason: reason as i32,
        length_limit: limit as i32,
        usage: Some(pb::Usage {
            prompt_tokens: f.usage.prompt_tokens,
            cached_tokens: f.usage.cached_tokens,
            completion_tokens: f.usage.completion_tokens,
        }),
        timings: Some(pb::Timings {
            queue_ms: t.queue.as_secs_f64() * 1e3,
            time_to_first_token_ms: t.time_to_first_token.as_secs_f64() * 1e3,
            prefill_tokens_per_second: t.prefill_tokens_per_second,
            decode_tokens_per_second: t.decode_tokens_per_second,
        }),
        tool_calls: Vec::new(),
    }
}

/// One stream message for an engine event; `generated` counts the tokens sent so far.
pub fn response(id: &str, event: Event, generated: &mut u32) -> Result<pb::GenerateResponse, Status> {
    let mut r = pb::GenerateResponse { request_id: id.to_string(), ..Default::default() };
    match event {
        Event::Token { id, text, logprobs } => {
            *generated += 1;
            r.token_ids.push(id);
            r.text = text;
            r.logprobs.extend(logprobs.map(position));
        }
        Event::Finished { text, finish: f } => {
            r.text = text;
            r.finish = Some(finish(f));
        }
        Event::Failed(f) => return Err(failure_status(&f, *generated)),
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_headers() {
        let now = Instant::now();
        let at = |v: &str| {
            let mut md = MetadataMap::new();
            md.insert("grpc-timeout", v.parse().unwrap());
            deadline(&md, now)
        };
        assert_eq!(at("250m").unwrap(), Some(now + Duration::from_millis(250)));
        assert_eq!(at("3S").unwrap(), Some(now + Duration::from_secs(3)));
        assert_eq!(at("2H").unwrap(), Some(now + Duration::from_secs(7200)));
        for bad in ["", "m", "12x", "-5m", "1234567890S"] {
            assert!(at(bad).is_err(), "{bad}");
        }
        assert_eq!(deadline(&MetadataMap::new(), now).unwrap(), None);
    }

    #[test]
    fn unset_sampling_fields_take_llama_cpp_defaults() {
        let p =
            sampling(Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }), &Default::default());
        assert_eq!(p, SamplingParams { temperature: 0.0, ..SamplingParams::default() });
        assert_eq!(sampling(None, &Default::default()), SamplingParams::default());
    }
}
