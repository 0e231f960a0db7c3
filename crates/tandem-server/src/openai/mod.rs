//! The JSON bodies of the HTTP API: OpenAI's `/v1/chat/completions` and `/v1/completions`
//! (https://platform.openai.com/docs/api-reference/chat) and llama-server's `/completion`,
//! `/tokenize`, `/detokenize` (llama.cpp tools/server/README.md), and their translation into
//! engine [`Request`]s. Nothing here trusts the client: every field is checked or clamped.

use crate::SamplingDefaults;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Instant;
use tandem_engine::{Constraint, Finish, FinishReason, LengthLimit, PositionLogprobs, Prompt, Request, SamplingParams};

/// Most stop strings per request, and bytes per stop string (as over gRPC).
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;

/// `stop`: one string or a list of them.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A prompt: text, a one-element list of texts, or token ids.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// A chat message's content: text or a list of parts (`{"type": "text", "text": ...}`).
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant's calls (OpenAI's shape, arguments as JSON text).
    pub tool_calls: Option<Vec<Value>>,
    /// A tool result's call.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and output fields of every completion route: OpenAI's and llama-server's
/// extensions, which llama-server accepts on the OpenAI routes too.
#[derive(Deserialize, Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    /// llama-server: 0 or less keeps every token.
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// `{"15043": -100}` or llama-server's `[[15043, -1.5], ["Hello", false]]`.
    pub logit_bias: Option<Value>,
    #[serde(flatten)]
    pub more: MoreSamplers,
    pub stop: Option<Stop>,
    pub seed: Option<i64>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// OpenAI's structured output: `{"type": "text" | "json_object" | "json_schema", "json_schema":
    /// {"name", "schema", "strict"}}`.
    pub response_format: Option<Value>,
    /// llama-server's extensions: a JSON schema, a GBNF grammar.
    pub json_schema: Option<Value>,
    pub grammar: Option<String>,
    /// llama-server's slot for the request (-1 or none: any free one).
    pub id_slot: Option<i64>,
}

/// The fields `/v1/chat/completions` and `/v1/completions` share (others are ignored).
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// The output constraint of OpenAI's `response_format` or llama-server's `json_schema` / `grammar`.
fn constraint(
    response_format: Option<Value>,
    json_schema: Option<Value>,
    grammar: Option<String>,
) -> Result<Option<Constraint>, BadParam> {
    let given = usize::from(response_format.as_ref().is_some_and(|f| f["type"] != "text"))
        + usize::from(json_schema.is_some())
        + usize::from(grammar.is_some());
    if given > 1 {
        return Err(BadParam("give one of response_format, json_schema and grammar".into()));
    }
    if let Some(g) = grammar {
        return Ok(Some(Constraint::Gbnf(g)));
    }
    if let Some(s) = json_schema {
        return Ok(Some(schema_constraint(s)?));
    }
    let Some(f) = response_format else { return Ok(None) };
    match f["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(match f.get("schema") {
            // llama-server also takes a schema here
            Some(s) => schema_constraint(s.clone())?,
            None => Constraint::JsonObject,
        })),
        Some("json_schema") => {
            let schema = f["json_schema"].get("schema").or_else(|| f.get("schema"));
            match schema {
                Some(s) => Ok(Some(schema_constraint(s.clone())?)),
                None => Err(BadParam("response_format json_schema: no json_schema.schema".into())),
            }
        }
        other => Err(BadParam(format!(
            "response_format type {:?}: one of text, json_object, json_schema",
            other.unwrap_or("(none)")
        ))),
    }
}

fn schema_constraint(s: Value) -> Result<Constraint, BadParam> {
    if !s.is_object() && !s.is_boolean() {
        return Err(BadParam(format!("json_schema: a schema is a JSON object, not {s}")));
    }
    Ok(Constraint::JsonSchema(s))
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// OpenAI's tools: `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub tools: Option<Vec<Value>>,
    /// "auto" (the default), "none" (the tools are not offered), "required" (the answer is one
    /// or more calls) or `{"type": "function", "function": {"name": N}}` (one call of N): a
    /// call is forced by a grammar in the chat template's call format.
    pub tool_choice: Option<Value>,
    /// With a forced call, several calls may follow one another (llama-server's default: one).
    #[serde(default)]
    pub parallel_tool_calls: bool,
    /// More variables for the chat template, over the server's `--chat-template-kwargs` (e.g.
    /// `{"thinking": false}`), as llama-server.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    /// Legacy completions: the number of top log-probabilities per token.
    pub logprobs: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

/// llama-server's `/completion`.
#[derive(Deserialize, Debug)]
pub struct LlamaCompletionRequest {
    pub prompt: PromptField,
    pub n_predict: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    /// Always on in tandem: the prompt cache is per slot (accepted for compatibility).
    pub cache_prompt: Option<bool>,
    pub n_probs: Option<u32>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Deserialize, Debug)]
/// llama-server's `/tokenize`: no BOS unless `add_special`, special-token texts parsed unless
/// `parse_special` is false.
pub struct TokenizeRequest {
    pub content: String,
    #[serde(default)]
    pub add_special: bool,
    #[serde(default = "yes")]
    pub parse_special: bool,
    #[serde(default)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize, Debug)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub tokens: Vec<u32>,
}

/// An OpenAI request, translated.
pub struct Parsed {
    pub req: Request,
    /// Tools were offered: the answer is parsed for calls.
    pub tools: bool,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk carries the usage.
    pub include_usage: bool,
    /// The other choices of a request with `n` > 1 or (`/v1/completions`) a prompt list, in
    /// choice order after `req` (never with `stream`).
    pub more: Vec<Request>,
}

/// A parameter the engine cannot take; the message names it.
pub struct BadParam(pub String);

fn stops(stop: Option<Stop>) -> Result<Vec<String>, BadParam> {
    let v = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if v.len() > MAX_STOPS {
        return Err(BadParam(format!("stop: {} strings, at most {MAX_STOPS}", v.len())));
    }
    if let Some(s) = v.iter().find(|s| s.len() > MAX_STOP_BYTES || s.is_empty()) {
        return Err(BadParam(format!("stop: {:?}: each must be 1 to {MAX_STOP_BYTES} bytes", truncate(s, 40))));
    }
    Ok(v)
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The request's seed: a negative one (llama-server's -1) or none asks for a new one each request,
/// as llama-server and OpenAI do (the same prompt twice gives two samples); gRPC keeps its
/// documented default of 0.
/// A request's seed: its own, else the server's, else (or at -1) a new one.
fn seed(s: Option<i64>, d: &SamplingDefaults) -> u64 {
    match (s, d.seed) {
        (Some(s), _) if s >= 0 => s as u64,
        (None, Some(d)) => d,
        _ => fresh_seed(),
    }
}

/// A seed no other request of this process got: the clock mixed with a counter.
fn fresh_seed() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_nanos() as u64);
    t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn prompt(p: PromptField) -> Result<Prompt, BadParam> {
    match p {
        PromptField::Text(t) => Ok(Prompt::Text(t)),
        PromptField::Tokens(ids) => Ok(Prompt::Tokens(ids)),
        PromptField::Texts(mut v) if v.len() == 1 => Ok(Prompt::Text(v.remove(0))),
        PromptField::Texts(v) => {
            Err(BadParam(format!("prompt: a list of {} texts; batches are not supported here, send one", v.len())))
        }
        PromptField::TokenLists(v) => Err(BadParam(format!(
            "prompt: a list of {} token lists; batches are not supported here, send one",
            v.len()
        ))),
    }
}

/// Most choices (prompts times `n`) one `/v1/completions` request may ask for.
pub const MAX_CHOICES: usize = 1024;

/// Most bytes of prompts (each prompt's text, or 4 a token, times `n`) the choices of one request
/// may hold: each choice holds its own copy.
pub const MAX_CHOICE_BYTES: usize = 64 << 20;

/// OpenAI's prompt list: one or more texts or token lists.
fn prompts(p: PromptField) -> Result<Vec<Prompt>, BadParam> {
    let v: Vec<Prompt> = match p {
        PromptField::Text(t) => vec![Prompt::Text(t)],
        PromptField::Tokens(ids) => vec![Prompt::Tokens(ids)],
        PromptField::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        PromptField::TokenLists(v) => v.into_iter().map(Prompt::Tokens).collect(),
    };
    if v.is_empty() {
        return Err(BadParam("prompt: an empty list".into()));
    }
    Ok(v)
}

/// llama-server's samplers beyond OpenAI's, on every completion route.
#[derive(Deserialize, Debug, Default)]
pub struct MoreSamplers {
    pub typical_p: Option<f32>,
    pub top_n_sigma: Option<f32>,
    pub xtc_probability: Option<f32>,
    pub xtc_threshold: Option<f32>,
    pub mirostat: Option<u32>,
    pub mirostat_tau: Option<f32>,
    pub mirostat_eta: Option<f32>,
    pub dry_multiplier: Option<f32>,
    pub dry_base: Option<f32>,
    pub dry_allowed_length: Option<i64>,
    /// -1: the whole context (newer llama-server's reading).
    pub dry_penalty_last_n: Option<i64>,
    pub dry_sequence_breakers: Option<Vec<String>>,
}

impl MoreSamplers {
    /// `p` with the samplers given.
    fn apply(self, p: &mut SamplingParams) -> Result<(), BadParam> {
        p.typical_p = self.typical_p.unwrap_or(p.typical_p);
        p.top_n_sigma = self.top_n_sigma.unwrap_or(p.top_n_sigma);
        p.xtc_probability = self.xtc_probability.unwrap_or(p.xtc_probability);
        p.xtc_threshold = self.xtc_threshold.unwrap_or(p.xtc_threshold);
        p.mirostat = self.mirostat.map_or(p.mirostat, |m| m.min(255) as u8);
        p.mirostat_tau = self.mirostat_tau.unwrap_or(p.mirostat_tau);
        p.mirostat_eta = self.mirostat_eta.unwrap_or(p.mirostat_eta);
        p.dry_multiplier = self.dry_multiplier.unwrap_or(p.dry_multiplier);
        // below 1: the server's, as llama-server
        p.dry_base = self.dry_base.filter(|&b| b >= 1.0).unwrap_or(p.dry_base);
        if let Some(n) = self.dry_allowed_length {
            p.dry_allowed_length =
                u32::try_from(n).map_err(|_| BadParam(format!("dry_allowed_length {n}: must be 0 or more")))?;
        }
        p.dry_penalty_last_n = match self.dry_penalty_last_n {
            None => p.dry_penalty_last_n,
            Some(-1) => u32::MAX,
            Some(n) => u32::try_from(n).map_err(|_| {
                BadParam(format!("dry_penalty_last_n {n}: must be -1 (the whole context), 0 (off) or more"))
            })?,
        };
        if let Some(b) = self.dry_sequence_breakers {
            if b.is_empty() {
                return Err(BadParam("dry_sequence_breakers: must be a non-empty array of strings".into()));
            }
            p.dry_sequence_breakers = b;
        }
        Ok(())
    }
}

/// llama-server's `repeat_last_n`: -1 is the whole context.
fn penalty_last_n(given: Option<i64>, default: usize) -> Result<usize, BadParam> {
    match given {
        None => Ok(default),
        Some(-1) => Ok(usize::MAX),
        Some(n) if n >= 0 => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => Err(BadParam(format!("repeat_last_n {n}: must be -1 (the whole context), 0 (off) or more"))),
    }
}

/// A request's `logit_bias`, which replaces the server's (`--logit-bias`), as llama-server reads
/// it: an object of token id (or text) to bias, OpenAI's form, or an array of `[token id or text,
/// bias]` pairs; a bias is a number or `false` (a ban). Text gets the bias on each of its tokens.
/// Where llama-server skips what it cannot read, this is an error naming it.
fn logit_bias(given: Option<Value>, req: &mut Request) -> Result<(), BadParam> {
    let Some(given) = given else { return Ok(()) };
    let bad = |what: &Value| BadParam(format!("logit_bias: {what} is not a token id or text with a number or false"));
    let pairs: Vec<(Value, Value)> = match given {
        Value::Object(m) => m.into_iter().map(|(k, v)| (Value::String(k), v)).collect(),
        Value::Array(a) => a
            .into_iter()
            .map(|e| match e {
                Value::Array(mut p) if p.len() == 2 => {
                    let v = p.pop().unwrap_or_default();
                    Ok((p.pop().unwrap_or_default(), v))
                }
                e => Err(bad(&e)),
            })
            .collect::<Result<_, _>>()?,
        Value::Null => return Ok(()),
        other => return Err(bad(&other)),
    };
    req.sampling.logit_bias.clear();
    req.logit_bias_text.clear();
    for (key, value) in pairs {
        let bias = match &value {
            Value::Bool(false) => f32::NEG_INFINITY,
            Value::Number(n) => n.as_f64().map_or(f32::NAN, |b| b as f32),
            _ => return Err(bad(&Value::Array(vec![key, value]))),
        };
        let id = match &key {
            Value::Number(n) => n.as_u64().filter(|&t| t <= u64::from(u32::MAX)).ok_or_else(|| bad(&key))?,
            // an object's keys are strings: digits are a token id, anything else text
            Value::String(t) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) => {
                t.parse().ok().filter(|&t| t <= u64::from(u32::MAX)).ok_or_else(|| bad(&key))?
            }
            Value::String(t) => {
                req.logit_bias_text.push((t.clone(), bias));
                continue;
            }
            _ => return Err(bad(&key)),
        };
        req.sampling.logit_bias.push((id as u32, bias));
    }
    Ok(())
}

/// A request for `p` sampled as `s` asks, the server's flags filling what it leaves out.
fn sampled(s: Sampling, p: Prompt, arrived: Instant, defaults: &SamplingDefaults) -> Result<Request, BadParam> {
    let d = defaults.params.clone();
    let mut req = Request::new(p);
    req.arrived = arrived;
    req.sampling = SamplingParams {
        temperature: s.temperature.unwrap_or(d.temperature),
        top_k: s.top_k.map_or(d.top_k, |k| usize::try_from(k.max(0)).unwrap_or(usize::MAX)),
        top_p: s.top_p.unwrap_or(d.top_p),
        min_p: s.min_p.unwrap_or(d.min_p),
        repeat_penalty: s.repeat_penalty.unwrap_or(d.repeat_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: s.frequency_penalty.unwrap_or(d.frequency_penalty),
        penalty_last_n: penalty_last_n(s.repeat_last_n, d.penalty_last_n)?,
        seed: seed(s.seed, defaults),
        ..d
    };
    s.more.apply(&mut req.sampling)?;
    logit_bias(s.logit_bias, &mut req)?;
    req.stop = stops(s.stop)?;
    req.ignore_eos = s.ignore_eos;
    req.constraint = constraint(s.response_format, s.json_schema, s.grammar)?;
    req.slot = match s.id_slot {
        Some(k) if k >= 0 => Some(usize::try_from(k).map_err(|_| BadParam(format!("id_slot {k}: no such slot")))?),
        _ => None,
    };
    Ok(req)
}

fn common(c: Common, p: Prompt, arrived: Instant, defaults: &SamplingDefaults) -> Result<Request, BadParam> {
    let mut req = sampled(c.sampling, p, arrived, defaults)?;
    req.max_tokens = c.max_completion_tokens.or(c.max_tokens).unwrap_or(0);
    Ok(req)
}

pub fn chat_request(r: ChatRequest, arrived: Instant, d: &SamplingDefaults) -> Result<Parsed, BadParam> {
    let n = r.common.n.unwrap_or(1) as usize;
    let offered = match &r.tool_choice {
        Some(Value::String(c)) if c == "none" => Vec::new(),
        Some(Value::String(c)) if c != "auto" && c != "required" => {
            return Err(BadParam(format!("tool_choice {c:?}: one of auto, none, required or a function")))
        }
        _ => r.tools.clone().unwrap_or_default(),
    };
    let mut offered = offered;
    for t in &mut offered {
        if t["function"]["name"].as_str().is_none_or(str::is_empty) {
            return Err(BadParam(format!("tools: {t} has no function.name")));
        }
        // as llama-server hands tools to templates: a description and parameters always there
        // (templates concatenate the description)
        let f = &mut t["function"];
        if !f["description"].is_string() {
            f["description"] = "".into();
        }
        if f["parameters"].is_null() {
            f["parameters"] = json!({"type": "object", "properties": {}});
        }
    }
    let forced = match &r.tool_choice {
        Some(Value::Object(choice)) => {
            // {"type": "function", "function": {"name": N}}: N must be one of the tools
            let name = choice.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            match name {
                Some(n) if offered.iter().any(|t| t["function"]["name"] == n) => Some(Some(n.to_string())),
                Some(n) => return Err(BadParam(format!("tool_choice names {n:?}, which is not among the tools"))),
                None => return Err(BadParam("tool_choice: an object needs function.name".into())),
            }
        }
        Some(Value::String(c)) if c == "required" => {
            if offered.is_empty() {
                return Err(BadParam("tool_choice \"required\" needs tools".into()));
            }
            Some(None)
        }
        _ => None,
    };
    // tool calls and results need the messages as they are, for the template
    let kwargs = r.chat_template_kwargs.unwrap_or_default();
    let rich = !offered.is_empty()
        || !kwargs.is_empty()
        || r.messages.iter().any(|m| m.tool_calls.is_some() || m.role == "tool");
    let mut messages = Vec::with_capacity(r.messages.len());
    let mut rich_messages = Vec::new();
    for m in r.messages {
        let text = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(BadParam(format!(
                            "messages: content of type {:?}: only text is supported",
                            p.kind
                        )));
                    }
                    t.push_str(p.text.as_deref().unwrap_or(""));
                }
                t
            }
        };
        if rich {
            let mut v = json!({"role": m.role, "content": text});
            if let Some(calls) = m.tool_calls {
                // templates read arguments as an object (Kimi's and Hermes' tojson them)
                let calls: Vec<Value> = calls
                    .into_iter()
                    .map(|mut c| {
                        if let Some(a) = c["function"]["arguments"].as_str().and_then(|a| serde_json::from_str(a).ok())
                        {
                            c["function"]["arguments"] = a;
                        }
                        c
                    })
                    .collect();
                v["tool_calls"] = calls.into();
            }
            if let Some(id) = m.tool_call_id {
                v["tool_call_id"] = id.into();
            }
            if let Some(n) = m.name {
                v["name"] = n.into();
            }
            rich_messages.push(v);
        } else {
            messages.push((m.role, text));
        }
    }
    let include_usage = r.common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let stream = r.common.stream;
    let prompt = if rich {
        Prompt::Messages { messages: rich_messages, tools: offered.clone(), kwargs }
    } else {
        Prompt::Chat(messages)
    };
    let mut req = common(r.common, prompt, arrived, d)?;
    if let Some(name) = forced {
        if req.constraint.is_some() {
            return Err(BadParam(
                "tool_choice \"required\" or a function cannot be combined with response_format".into(),
            ));
        }
        req.constraint = Some(Constraint::ToolCall { tools: offered.clone(), name, parallel: r.parallel_tool_calls });
    }
    if r.logprobs {
        // the engine reports the sampled token's log-probability with the top n (at least one)
        req.logprobs = r.top_logprobs.unwrap_or(0).max(1);
    }
    let tools = !offered.is_empty();
    // call markers are control tokens in some vocabularies (Kimi K2's)
    req.special_text = tools;
    let more = more_choices(&req, &[], n)?;
    Ok(Parsed { req, tools, stream, include_usage, more })
}

/// The bytes a prompt holds (4 a token), for [`MAX_CHOICE_BYTES`].
fn prompt_bytes(p: &Prompt) -> usize {
    match p {
        Prompt::Text(t) => t.len(),
        Prompt::Tokens(ids) => 4 * ids.len(),
        Prompt::Chat(m) => m.iter().map(|(r, c)| r.len() + c.len()).sum(),
        Prompt::Messages { messages, tools, kwargs } => {
            let json =
                messages.iter().chain(tools).map(|v| serde_json::to_string(v).map_or(0, |s| s.len())).sum::<usize>();
            json + kwargs.iter().map(|(k, v)| k.len() + v.to_string().len()).sum::<usize>()
        }
    }
}

/// The choices after `req` of a request for `n` choices of `req`'s prompt and of each of
/// `prompts`: choice i * n + j is prompt i with seed + j, so n > 1 gives n draws and the same
/// seed the same choices. Each is its own engine request, run side by side on the slots.
fn more_choices(req: &Request, prompts: &[Prompt], n: usize) -> Result<Vec<Request>, BadParam> {
    let count = prompts.len() + 1;
    let choices = count.saturating_mul(n);
    if n == 0 {
        return Err(BadParam("n = 0: must be 1 or more".into()));
    }
    if choices > MAX_CHOICES {
        return Err(BadParam(format!("{count} prompt(s) x n = {n}: at most {MAX_CHOICES} choices a request")));
    }
    let bytes = (prompt_bytes(&req.prompt) + prompts.iter().map(prompt_bytes).sum::<usize>()).saturating_mul(n);
    if bytes > MAX_CHOICE_BYTES {
        return Err(BadParam(format!(
            "prompt: {bytes} bytes of prompts over {choices} choices; at most {MAX_CHOICE_BYTES} a request"
        )));
    }
    let base = req.sampling.seed;
    let mut more = Vec::with_capacity(choices - 1);
    for (i, p) in std::iter::once(&req.prompt).chain(prompts).enumerate() {
        for j in (if i == 0 { 1 } else { 0 })..n {
            let mut c = req.clone();
            c.prompt = p.clone();
            c.sampling.seed = base.wrapping_add(j as u64);
            more.push(c);
        }
    }
    Ok(more)
}

pub fn completion_request(r: CompletionRequest, arrived: Instant, d: &SamplingDefaults) -> Result<Parsed, BadParam> {
    let include_usage = r.common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let stream = r.common.stream;
    let n = r.common.n.unwrap_or(1) as usize;
    let mut prompts = prompts(r.prompt)?;
    let first = prompts.remove(0);
    let mut req = common(r.common, first, arrived, d)?;
    req.logprobs = r.logprobs.unwrap_or(0);
    let more = more_choices(&req, &prompts, n)?;
    Ok(Parsed { req, tools: false, stream, include_usage, more })
}

pub fn llama_completion_request(
    r: LlamaCompletionRequest,
    arrived: Instant,
    defaults: &SamplingDefaults,
) -> Result<Request, BadParam> {
    let mut req = sampled(r.sampling, prompt(r.prompt)?, arrived, defaults)?;
    // n_predict -1 = until the server's cap or the context (llama-server); other negatives are
    // mistakes, not "unlimited"
    req.max_tokens = match r.n_predict {
        None | Some(-1) => 0,
        Some(n) if n < 0 => return Err(BadParam(format!("n_predict {n}: must be -1 (no limit) or >= 1"))),
        Some(0) => {
            return Err(BadParam(
                "n_predict 0 (only cache the prompt) is not supported; give -1 (no limit) or >= 1".into(),
            ))
        }
        Some(n) => n.min(u32::MAX as i64) as u32,
    };
    req.logprobs = r.n_probs.unwrap_or(0);
    let _ = r.cache_prompt;
    Ok(req)
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(f: &Finish) -> &'static str {
    match f.reason {
        FinishReason::Length(_) => "length",
        FinishReason::Stop | FinishReason::Eos | FinishReason::Cancelled => "stop",
    }
}

/// One position of a chat completion's `logprobs.content`, with `top` entries.
pub fn chat_logprob(p: &PositionLogprobs, top: usize) -> Value {
    let entry = |text: &str, lp: f32| json!({"token": text, "logprob": lp, "bytes": text.as_bytes()});
    let mut v = entry(&p.sampled.text, p.sampled.logprob);
    v["top_logprobs"] = p.top.iter().take(top).map(|t| entry(&t.text, t.logprob)).collect();
    v
}

/// llama-server's `completion_probabilities` entry of one position (`n_probs`): the sampled
/// token and the `n` most likely, each with its id, text, bytes and log-probability (never
/// `-inf`, which JSON cannot hold: the lowest f32, as llama-server).
pub fn llama_probs(p: &PositionLogprobs, n: usize) -> Value {
    let entry = |t: &tandem_engine::TokenLogprob| json!({"id": t.id, "token": t.text, "bytes": t.text.as_bytes(), "logprob": t.logprob.max(f32::MIN)});
    let mut v = entry(&p.sampled);
    v["top_logprobs"] = p.top.iter().take(n).map(entry).collect();
    v
}

/// llama-server's `/completion` answer (or its last streamed chunk), `content` given.
pub fn llama_final(content: &str, f: &Finish, stop_strings: &[String], model: &str) -> Value {
    let u = &f.usage;
    let t = &f.timings;
    let computed = u.prompt_tokens.saturating_sub(u.cached_tokens);
    let ms = |n: u32, per_s: f64| if per_s > 0.0 { n as f64 / per_s * 1000.0 } else { 0.0 };
    let prompt_ms = ms(computed, t.prefill_tokens_per_second);
    let predicted_ms = ms(u.completion_tokens, t.decode_tokens_per_second);
    let stop_type = match f.reason {
        FinishReason::Eos => "eos",
        FinishReason::Stop => "word",
        FinishReason::Length(_) => "limit",
        FinishReason::Cancelled => "none",
    };
    // the engine does not say which stop string matched: name the only one when there is one
    let stopping_word = match (f.reason, stop_strings) {
        (FinishReason::Stop, [one]) => one.as_str(),
        _ => "",
    };
    json!({
        "content": content,
        "stop": true,
        "model": model,
        "tokens_predicted": u.completion_tokens,
        "tokens_evaluated": u.prompt_tokens,
        "tokens_cached": u.cached_tokens,
        "truncated": false,
        "stopped_eos": f.reason == FinishReason::Eos,
        "stopped_word": f.reason == FinishReason::Stop,
        "stopped_limit": matches!(f.reason, FinishReason::Length(_)),
        "stop_type": stop_type,
        "stopping_word": stopping_word,
        "context_full": f.reason == FinishReason::Length(LengthLimit::Context),
        "timings": {
            "cache_n": u.cached_tokens,
            "prompt_n": computed,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": if computed > 0 { prompt_ms / computed as f64 } else { 0.0 },
            "prompt_per_second": t.prefill_tokens_per_second,
            "predicted_n": u.completion_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": if u.completion_tokens > 0 { predicted_ms / u.completion_tokens as f64 } else { 0.0 },
            "predicted_per_second": t.decode_tokens_per_second,
            "queue_ms": t.queue.as_secs_f64() * 1000.0,
            "time_to_first_token_ms": t.time_to_first_token.as_secs_f64() * 1000.0,
        },
    })
}

#[cfg(test)]
mod tests;
