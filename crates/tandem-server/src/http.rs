//! The HTTP API (axum) beside gRPC, over the same engine, slots and prompt cache: OpenAI's
//! `/v1/chat/completions`, `/v1/completions` and `/v1/models`, llama-server's `/completion`,
//! `/tokenize`, `/detokenize`, `/apply-template` and `/health`. Errors use OpenAI's shape
//! (`{"error": {"message", "type", "code"}}`); streams are server-sent events. A client that
//! disconnects drops the response body, which closes the request's reply channel: the engine
//! then frees its slot, as for a gRPC cancel.

use crate::openai::{self, BadParam};
use crate::reasoning::{ReasoningFormat, Splitter};
use crate::service::{KeyIndex, State, StreamGuard};
use crate::stream::{merged, sse, Step};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State as AxState};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tandem_engine::{Error as EngineError, Event, Failure, Finish, PositionLogprobs, Prepared, Request, Sink, Usage};
use tokio::sync::mpsc;

/// Largest request body, in bytes (a long prompt fits; a runaway upload does not).
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// Most token ids a /detokenize call may send.
const MAX_DETOKENIZE_IDS: usize = 1 << 20;

/// The API's routes, behind [`guard`]; `/metrics` too with `--metrics`.
pub(crate) fn router(state: Arc<State>) -> Router {
    let routes = match state.metrics_on_api() {
        true => Router::new().route("/metrics", get(crate::metrics::metrics)),
        false => Router::new(),
    };
    routes
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/completion", post(llama_completion))
        .route("/tokenize", post(tokenize))
        .route("/apply-template", post(apply_template))
        .route("/detokenize", post(detokenize))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/slots/{id}", post(crate::slot_files::slot_action))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/messages/count_tokens", post(crate::anthropic::count_tokens))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Every route but health needs an API key when keys are set (401, as llama-server); a POST body
/// must say it is JSON (415), so that a web page cannot post a "simple" cross-origin request
/// (text/plain, form data) to a server on localhost.
async fn guard(AxState(state): AxState<Arc<State>>, mut req: axum::extract::Request, next: Next) -> Response {
    let path = req.uri().path();
    if path != "/health" && path != "/v1/health" {
        // Anthropic's clients send x-api-key (as llama-server, Authorization wins when both are there)
        let given = req.headers().get(header::AUTHORIZATION).or_else(|| req.headers().get("x-api-key"));
        match state.authorize(given.map(|v| v.as_bytes())) {
            Ok(Some(k)) => {
                req.extensions_mut().insert(k);
            }
            Ok(None) => {}
            Err(msg) => {
                let mut e = ApiError::new(StatusCode::UNAUTHORIZED, msg);
                e.kind = "authentication_error";
                return e.into_response();
            }
        }
    }
    if req.method() == Method::POST && !is_json(req.headers().get(header::CONTENT_TYPE)) {
        let msg = "the body must be JSON: Content-Type: application/json";
        return ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, msg).into_response();
    }
    next.run(req).await
}

/// `application/json`, with parameters or not (`; charset=utf-8`).
fn is_json(content_type: Option<&axum::http::HeaderValue>) -> bool {
    let Some(v) = content_type.and_then(|v| v.to_str().ok()) else { return false };
    v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        let kind = match status {
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE => {
                "invalid_request_error"
            }
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable_error",
            StatusCode::CONFLICT => "conflict_error",
            StatusCode::NOT_IMPLEMENTED => "not_supported_error",
            _ => "server_error",
        };
        ApiError { status, kind, message: message.into() }
    }

    pub(crate) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub(crate) fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.status.as_u16()}})
    }

    /// The error as Anthropic's API answers it: `{"type": "error", "error": {"type", "message"}}`.
    pub(crate) fn anthropic(self) -> Response {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "api_error",
        };
        (self.status, Json(json!({"type": "error", "error": {"type": kind, "message": self.message}}))).into_response()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<BadParam> for ApiError {
    fn from(e: BadParam) -> ApiError {
        ApiError::bad(e.0)
    }
}

impl From<&EngineError> for ApiError {
    fn from(e: &EngineError) -> ApiError {
        let msg = e.to_string();
        let mut err = match e {
            EngineError::InvalidParam(_)
            | EngineError::InvalidRequest(_)
            | EngineError::Tokenizer(_)
            | EngineError::NoChatTemplate => ApiError::bad(msg),
            EngineError::QueueFull(_) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, msg),
            EngineError::AlreadyRunning(_) => ApiError::new(StatusCode::CONFLICT, msg),
            EngineError::Unavailable(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, msg),
            EngineError::Model(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg),
        };
        // llama-server's type for a prompt longer than the context
        if matches!(e, EngineError::InvalidRequest(m) if m.contains("the context holds")) {
            err.kind = "exceed_context_size_error";
        }
        err
    }
}

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> ApiError {
        let status = match s.code() {
            tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
            tonic::Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            tonic::Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, s.message())
    }
}

pub(crate) fn failure(f: &Failure) -> ApiError {
    match f {
        Failure::DeadlineExceeded => ApiError::new(StatusCode::GATEWAY_TIMEOUT, f.to_string()),
        Failure::Unavailable(m) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, m.clone()),
        Failure::Internal(m) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m.clone()),
    }
}

/// The body as JSON of type `T`; an unreadable, oversized or malformed body is a 4xx.
pub(crate) fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "this route does not take that method")
}

async fn health(AxState(state): AxState<Arc<State>>) -> Response {
    match state.engine() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(s) => ApiError::from(s).into_response(),
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub(crate) fn model_name(state: &State) -> String {
    state.model_name().unwrap_or_default().to_string()
}

async fn models(AxState(state): AxState<Arc<State>>) -> Result<Json<Value>, ApiError> {
    let engine = state.engine()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": model_name(&state),
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "meta": {"n_ctx": engine.info().n_ctx, "n_vocab": engine.info().n_vocab},
        }],
    })))
}

/// llama-server's `GET /props`: the slots, the context, the sampling a request gets for what it
/// leaves out, the chat template and the special tokens.
/// Sampling parameters in llama-server's `params` shape (`n_predict` -1: no limit but the
/// server's and the context; `seed` -1: a new one each request).
fn params_json(p: &tandem_engine::SamplingParams, n_predict: Option<u32>, seed: Option<u64>) -> Value {
    json!({
        "n_predict": n_predict.map_or(-1, i64::from),
        "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
        "typical_p": p.typical_p, "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability, "xtc_threshold": p.xtc_threshold,
        "repeat_penalty": p.repeat_penalty,
        "repeat_last_n": if p.penalty_last_n == usize::MAX { -1 } else { p.penalty_last_n as i64 },
        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "mirostat": p.mirostat, "mirostat_tau": p.mirostat_tau, "mirostat_eta": p.mirostat_eta,
        "dry_multiplier": p.dry_multiplier, "dry_base": p.dry_base, "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": if p.dry_penalty_last_n == u32::MAX { -1 } else { i64::from(p.dry_penalty_last_n) },
        "dry_sequence_breakers": p.dry_sequence_breakers,
        "seed": seed.map_or(-1, |s| s as i64),
    })
}

async fn props(AxState(state): AxState<Arc<State>>) -> Result<Json<Value>, ApiError> {
    let engine = state.engine()?;
    let tok = engine.tokenizer();
    let max = engine.config().max_tokens;
    Ok(Json(json!({
        "default_generation_settings": {
            "n_ctx": engine.info().n_ctx,
            "params": params_json(&state.sampling().params, (max > 0).then_some(max), state.sampling().seed),
        },
        "total_slots": engine.config().n_parallel,
        "model_alias": model_name(&state),
        "chat_template": engine.chat_template().unwrap_or_default(),
        "bos_token": tok.bos_text(),
        "eos_token": tok.eos_text(),
        "modalities": {"vision": false, "audio": false},
        "build_info": concat!("tandem ", env!("CARGO_PKG_VERSION")),
    })))
}

#[derive(serde::Deserialize)]
struct SlotsQuery {
    fail_on_no_slot: Option<String>,
}

/// llama-server's `GET /slots`: each slot as of the engine's last step, without prompt text;
/// `?fail_on_no_slot=1` answers 503 when every slot is busy; 501 with `--no-slots`.
async fn slots(
    AxState(state): AxState<Arc<State>>,
    axum::extract::Query(q): axum::extract::Query<SlotsQuery>,
) -> Result<Json<Value>, ApiError> {
    if !state.slots_on() {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "This server does not support slots endpoint. Start it without `--no-slots`",
        ));
    }
    let engine = state.engine()?;
    let views = engine.stats().slot_views();
    if q.fail_on_no_slot.is_some_and(|v| !v.is_empty()) && views.iter().all(|v| v.request.is_some()) {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no slot available"));
    }
    let n_ctx = engine.info().n_ctx;
    let slots = views.iter().enumerate().map(|(id, v)| {
        json!({
            "id": id,
            "id_task": v.request.as_deref().map_or(json!(-1), |r| json!(r)),
            "n_ctx": n_ctx,
            "speculative": false,
            "is_processing": v.request.is_some(),
            "n_cached_tokens": v.n_cached,
            "n_prompt_tokens": v.n_prompt_tokens,
            "n_prompt_tokens_cache": v.n_prompt_cached,
            "n_prompt_tokens_processed": v.n_prompt_processed,
            "params": v.sampling.as_ref().map(|p| {
                let mut j = params_json(p, v.n_remain.map(|r| r + v.n_decoded), Some(p.seed));
                j["stop"] = json!(v.stop);
                j
            }),
            "next_token": {
                "has_next_token": v.request.is_some(),
                "n_remain": v.n_remain.map_or(-1, i64::from),
                "n_decoded": v.n_decoded,
            },
        })
    });
    Ok(Json(Value::Array(slots.collect())))
}

/// The engine's reply channel for one HTTP request.
struct HttpSink {
    tx: mpsc::UnboundedSender<Event>,
    /// The last event was sent.
    done: bool,
    _guard: StreamGuard,
}

impl Drop for HttpSink {
    fn drop(&mut self) {
        if !self.done {
            let _ =
                self.tx.send(Event::Failed(Failure::Internal("the engine stopped before the request finished".into())));
        }
    }
}

impl Sink for HttpSink {
    fn send(&mut self, event: Event) -> bool {
        self.done |= !matches!(event, Event::Token { .. });
        self.tx.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Tokenizes `prompt` (a chat's template rendered once) off the async threads.
pub(crate) async fn prepare(state: &Arc<State>, prompt: &tandem_engine::Prompt) -> Result<Arc<Prepared>, ApiError> {
    let engine = state.engine()?.clone();
    let prompt = prompt.clone();
    let prepared = tokio::task::spawn_blocking(move || engine.prepare(&prompt))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("submitting the request: {e}")))?
        .map_err(|e| ApiError::from(&e))?;
    Ok(Arc::new(prepared))
}

/// Submits `req` (tokenized off the async threads, or as `prepared` from its prompt) under a
/// fresh random id, `prefix` and hex.
pub(crate) async fn submit(
    state: &Arc<State>,
    mut req: Request,
    prepared: Option<Arc<Prepared>>,
    prefix: &str,
    key: Option<KeyIndex>,
) -> Result<(String, mpsc::UnboundedReceiver<Event>), ApiError> {
    let engine = state.engine()?.clone();
    req.id = state.new_id(prefix);
    let id = req.id.clone();
    let (tx, rx) = mpsc::unbounded_channel();
    let sink = Box::new(HttpSink { tx, done: false, _guard: StreamGuard::new(state.clone(), &id, key) });
    tokio::task::spawn_blocking(move || match prepared {
        Some(p) if p.is_for(&req.prompt) => engine.submit_prepared(req, &p, sink),
        _ => engine.submit(req, sink),
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("submitting the request: {e}")))?
    .map_err(|e| ApiError::from(&e))?;
    Ok((id, rx))
}

/// A whole generation, for the non-streaming answers.
pub(crate) struct Collected {
    pub text: String,
    logprobs: Vec<PositionLogprobs>,
    pub finish: Finish,
}

pub(crate) async fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Token { text: t, logprobs: lp, .. }) => {
                text.push_str(&t);
                logprobs.extend(lp);
            }
            Some(Event::Finished { text: t, finish }) => {
                text.push_str(&t);
                return Ok(Collected { text, logprobs, finish });
            }
            Some(Event::Failed(f)) => return Err(failure(&f)),
            None => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the engine dropped the request")),
        }
    }
}

const DONE: &str = "[DONE]";

/// The last events of an OpenAI stream after its finishing chunks `out`: with `include_usage`,
/// `usage_chunk` (a chunk of the stream) with no choices and the usage, then `[DONE]`.
fn stream_end(mut out: Vec<String>, usage_chunk: Option<Value>, usage: &[Usage]) -> Vec<String> {
    if let Some(mut u) = usage_chunk {
        u["choices"] = json!([]);
        u["usage"] = summed_usage(usage);
        out.push(u.to_string());
    }
    out.push(DONE.into());
    out
}

fn error_data(f: &Failure) -> Vec<String> {
    vec![failure(f).body().to_string()]
}

async fn chat(
    AxState(state): AxState<Arc<State>>,
    key: Option<Extension<KeyIndex>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let openai::Parsed { req, stream, include_usage, tools, more } =
        openai::chat_request(parse(body)?, arrived, state.sampling())?;
    let top = req.logprobs as usize;
    let want_logprobs = req.logprobs > 0;
    let format = state.reasoning_format();
    let prepared = prepare(&state, &req.prompt).await?;
    let opens = prompt_opens(&state, &prepared);
    let reqs = std::iter::once(req).chain(more).collect();
    let (ids, rxs) = submit_all(&state, reqs, Some(prepared), "chatcmpl-", key.map(|k| k.0)).await?;
    let (model, created) = (model_name(&state), now_secs());
    let body = json!({"id": ids[0], "object": "chat.completion", "created": created, "model": model});
    if !stream {
        let (mut choices, mut usage) = (Vec::with_capacity(rxs.len()), Vec::with_capacity(rxs.len()));
        for (index, rx) in rxs.into_iter().enumerate() {
            let c = collect(rx).await?;
            let mut choice = chat_choice(&c, Splitter::new(format, opens), tools, &state, want_logprobs.then_some(top));
            choice["index"] = index.into();
            choices.push(choice);
            usage.push(c.finish.usage);
        }
        let mut body = body;
        body["choices"] = choices.into();
        body["usage"] = summed_usage(&usage);
        return Ok(Json(body).into_response());
    }
    let mut chunk = body;
    chunk["object"] = "chat.completion.chunk".into();
    let first = (0..rxs.len())
        .map(|i| chat_chunk(&chunk, i, json!({"role": "assistant", "content": ""}), Value::Null, Value::Null))
        .collect();
    let translators = (0..rxs.len())
        .map(|i| {
            let (chunk, state) = (chunk.clone(), state.clone());
            let mut answer = crate::tools::AnswerStream::new(Splitter::new(format, opens), tools);
            let mut call_id = move || state.new_id("call_");
            let end = chunk.clone();
            // the deltas of a piece of text: thinking apart from the answer
            let deltas = move |(reasoning, content): (String, String), lp: Value, out: &mut Vec<String>| {
                if !reasoning.is_empty() {
                    out.push(chat_chunk(&chunk, i, json!({"reasoning_content": reasoning}), Value::Null, Value::Null));
                }
                if !content.is_empty() || !lp.is_null() {
                    out.push(chat_chunk(&chunk, i, json!({"content": content}), lp, Value::Null));
                }
            };
            move |ev| {
                let mut out = Vec::new();
                match ev {
                    Event::Token { text, logprobs, .. } => {
                        let lp = match (&logprobs, want_logprobs) {
                            (Some(p), true) => json!({"content": [openai::chat_logprob(p, top)]}),
                            _ => Value::Null,
                        };
                        if !text.is_empty() || !lp.is_null() {
                            deltas(answer.push(&text), lp, &mut out);
                        }
                        Step::More(out)
                    }
                    Event::Finished { text, finish } => {
                        let (r, c, calls) = answer.finish(&text);
                        deltas((r, c), Value::Null, &mut out);
                        let mut reason = Value::from(openai::finish_reason(&finish));
                        if !calls.is_empty() {
                            let list = crate::tools::openai_calls(&calls, &mut call_id, true);
                            out.push(chat_chunk(&end, i, json!({"tool_calls": list}), Value::Null, Value::Null));
                            reason = "tool_calls".into();
                        }
                        out.push(chat_chunk(&end, i, json!({}), Value::Null, reason));
                        Step::Done(out, finish.usage)
                    }
                    Event::Failed(f) => Step::Failed(error_data(&f)),
                }
            }
        })
        .collect();
    Ok(merged(rxs, first, translators, move |out, usage| stream_end(out, include_usage.then_some(chunk), usage)))
}

/// A chat completion chunk of choice `index`.
fn chat_chunk(chunk: &Value, index: usize, delta: Value, lp: Value, reason: Value) -> String {
    let mut c = chunk.clone();
    c["choices"] = json!([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]);
    c.to_string()
}

/// Whether the chat template leaves a `<think>` block open for the answer (DeepSeek-R1's does),
/// when thinking is split from the answer.
pub(crate) fn prompt_opens(state: &State, prepared: &Prepared) -> bool {
    state.reasoning_format() == ReasoningFormat::Deepseek && prepared.rendered().is_some_and(Splitter::prompt_opens)
}

/// Legacy completions' `logprobs` object for a run of positions.
fn completion_logprobs(positions: &[PositionLogprobs], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for p in positions {
        tokens.push(p.sampled.text.clone());
        lps.push(p.sampled.logprob);
        let top: serde_json::Map<String, Value> = p.top.iter().map(|t| (t.text.clone(), json!(t.logprob))).collect();
        tops.push(top);
        offsets.push(*offset);
        *offset += p.sampled.text.len();
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

async fn completions(
    AxState(state): AxState<Arc<State>>,
    key: Option<Extension<KeyIndex>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let openai::Parsed { req, stream, include_usage, more, .. } =
        openai::completion_request(parse(body)?, arrived, state.sampling())?;
    let want_logprobs = req.logprobs > 0;
    let reqs: Vec<_> = std::iter::once(req).chain(more).collect();
    if !stream {
        return completions_batch(&state, reqs, key.map(|k| k.0)).await;
    }
    let (ids, rxs) = submit_all(&state, reqs, None, "cmpl-", key.map(|k| k.0)).await?;
    let chunk = json!({"id": ids[0], "object": "text_completion", "created": now_secs(), "model": model_name(&state)});
    let translators = (0..rxs.len())
        .map(|i| {
            let chunk = chunk.clone();
            let text_chunk = move |text: &str, lp: Value, reason: Value| {
                let mut c = chunk.clone();
                c["choices"] = json!([{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}]);
                c.to_string()
            };
            let mut offset = 0;
            move |ev| match ev {
                Event::Token { text, logprobs, .. } => {
                    if text.is_empty() && logprobs.is_none() {
                        return Step::More(Vec::new());
                    }
                    let lp = match logprobs {
                        Some(p) if want_logprobs => completion_logprobs(&[p], &mut offset),
                        _ => Value::Null,
                    };
                    Step::More(vec![text_chunk(&text, lp, Value::Null)])
                }
                Event::Finished { text, finish } => {
                    let reason = openai::finish_reason(&finish).into();
                    Step::Done(vec![text_chunk(&text, Value::Null, reason)], finish.usage)
                }
                Event::Failed(f) => Step::Failed(error_data(&f)),
            }
        })
        .collect();
    Ok(merged(rxs, Vec::new(), translators, move |out, usage| stream_end(out, include_usage.then_some(chunk), usage)))
}

/// Submits every choice of a request with several (a prompt list, `n` > 1) before reading any,
/// so they run side by side on the slots. A choice the queue cannot take fails the request (429),
/// and the choices already submitted are aborted.
async fn submit_all(
    state: &Arc<State>,
    reqs: Vec<tandem_engine::Request>,
    mut prepared: Option<Arc<Prepared>>,
    prefix: &str,
    key: Option<KeyIndex>,
) -> Result<(Vec<String>, Vec<mpsc::UnboundedReceiver<Event>>), ApiError> {
    let mut rxs = Vec::with_capacity(reqs.len());
    let mut ids = Vec::with_capacity(reqs.len());
    for req in reqs {
        // the `n` choices of one prompt share its tokens (and a chat its one rendering)
        let ready = match prepared.take() {
            Some(p) if p.is_for(&req.prompt) => Ok(p),
            _ => prepare(state, &req.prompt).await,
        };
        prepared = ready.as_ref().ok().cloned();
        match async { submit(state, req, Some(ready?), prefix, key).await }.await {
            Ok((id, rx)) => {
                ids.push(id);
                rxs.push(rx);
            }
            Err(e) => {
                if let Ok(engine) = state.engine() {
                    ids.iter().for_each(|id| _ = engine.abort(id));
                }
                return Err(e);
            }
        }
    }
    Ok((ids, rxs))
}

/// The usage of several choices, summed.
fn summed_usage(all: &[tandem_engine::Usage]) -> Value {
    let sum = |f: fn(&tandem_engine::Usage) -> u32| all.iter().map(|u| u64::from(f(u))).sum::<u64>();
    let (prompt, completion) = (sum(|u| u.prompt_tokens), sum(|u| u.completion_tokens));
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(|u| u.cached_tokens)}})
}

/// One chat completion choice (index 0) of a whole generation: the thinking apart from the
/// answer, tool calls parsed when tools were offered, the log-probabilities when asked (`top`).
fn chat_choice(c: &Collected, split: Splitter, tools: bool, state: &Arc<State>, top: Option<usize>) -> Value {
    let (reasoning, content, calls) = crate::tools::whole_answer(split, tools, &c.text);
    let mut choice = json!({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": null,
                            "finish_reason": openai::finish_reason(&c.finish)});
    if !reasoning.is_empty() {
        choice["message"]["reasoning_content"] = reasoning.into();
    }
    if !calls.is_empty() {
        choice["message"]["tool_calls"] = crate::tools::openai_calls(&calls, &mut || state.new_id("call_"), false);
        if choice["message"]["content"] == "" {
            choice["message"]["content"] = Value::Null;
        }
        choice["finish_reason"] = "tool_calls".into();
    }
    if let Some(top) = top {
        choice["logprobs"] =
            json!({"content": c.logprobs.iter().map(|p| openai::chat_logprob(p, top)).collect::<Vec<_>>()});
    }
    choice
}

/// `/v1/completions` with several choices: each collected into `choices[index]`, usage summed.
async fn completions_batch(
    state: &Arc<State>,
    reqs: Vec<tandem_engine::Request>,
    key: Option<KeyIndex>,
) -> Result<Response, ApiError> {
    let want_logprobs = reqs[0].logprobs > 0;
    let (ids, rxs) = submit_all(state, reqs, None, "cmpl-", key).await?;
    let (mut choices, mut usage) = (Vec::with_capacity(rxs.len()), Vec::with_capacity(rxs.len()));
    for (index, rx) in rxs.into_iter().enumerate() {
        let c = collect(rx).await?;
        let lp = if want_logprobs { completion_logprobs(&c.logprobs, &mut 0) } else { Value::Null };
        choices.push(json!({"index": index, "text": c.text, "logprobs": lp,
                            "finish_reason": openai::finish_reason(&c.finish)}));
        usage.push(c.finish.usage);
    }
    Ok(Json(json!({"id": ids[0], "object": "text_completion", "created": now_secs(), "model": model_name(state),
                   "choices": choices, "usage": summed_usage(&usage)}))
    .into_response())
}

async fn llama_completion(
    AxState(state): AxState<Arc<State>>,
    key: Option<Extension<KeyIndex>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let r: openai::LlamaCompletionRequest = parse(body)?;
    let stream = r.stream;
    let req = openai::llama_completion_request(r, arrived, state.sampling())?;
    let stops = req.stop.clone();
    let n_probs = req.logprobs as usize;
    let (_, rx) = submit(&state, req, None, "cmpl-", key.map(|k| k.0)).await?;
    let model = model_name(&state);
    if !stream {
        let c = collect(rx).await?;
        let mut body = openai::llama_final(&c.text, &c.finish, &stops, &model);
        if n_probs > 0 {
            body["completion_probabilities"] = c.logprobs.iter().map(|p| openai::llama_probs(p, n_probs)).collect();
        }
        return Ok(Json(body).into_response());
    }
    // llama-server streams `{"content", "stop": false}` chunks, then the stats with `stop: true`
    Ok(sse(rx, Vec::new(), move |ev| match ev {
        Event::Token { id, text, logprobs } => {
            let mut chunk = json!({"content": text, "tokens": [id], "stop": false});
            match logprobs {
                Some(p) if n_probs > 0 => chunk["completion_probabilities"] = json!([openai::llama_probs(&p, n_probs)]),
                _ if text.is_empty() => return (Vec::new(), false),
                _ => {}
            }
            (vec![chunk.to_string()], false)
        }
        Event::Finished { text, finish } => {
            (vec![openai::llama_final(&text, &finish, &stops, &model).to_string()], true)
        }
        Event::Failed(f) => (error_data(&f), true),
    }))
}

async fn tokenize(
    AxState(state): AxState<Arc<State>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let r: openai::TokenizeRequest = parse(body)?;
    let engine = state.engine()?.clone();
    tokio::task::spawn_blocking(move || {
        let tok = engine.tokenizer();
        let ids = tok.encode(&r.content, r.add_special, r.parse_special).map_err(|e| ApiError::bad(e.to_string()))?;
        if !r.with_pieces {
            return Ok(Json(json!({"tokens": ids})));
        }
        let pieces: Vec<Value> = ids
            .iter()
            .map(|&id| {
                // As llama-server: the text where the bytes are UTF-8, else the bytes (a piece
                // that is part of a character).
                let bytes = tok.token_to_piece(id, true).unwrap_or(&[]);
                match std::str::from_utf8(bytes) {
                    Ok(text) => json!({"id": id, "piece": text}),
                    Err(_) => json!({"id": id, "piece": bytes}),
                }
            })
            .collect();
        Ok(Json(json!({"tokens": pieces})))
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("tokenizing: {e}")))?
}

async fn detokenize(
    AxState(state): AxState<Arc<State>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let r: openai::DetokenizeRequest = parse(body)?;
    let engine = state.engine()?;
    if r.tokens.len() > MAX_DETOKENIZE_IDS {
        return Err(ApiError::bad(format!("{} token ids, at most {MAX_DETOKENIZE_IDS}", r.tokens.len())));
    }
    let n_vocab = engine.info().n_vocab;
    if let Some((i, t)) = r.tokens.iter().enumerate().find(|(_, &t)| t as usize >= n_vocab) {
        return Err(ApiError::bad(format!("token id {t} at index {i} is outside the vocabulary of {n_vocab} tokens")));
    }
    let content = engine.tokenizer().decode(&r.tokens, true).map_err(|e| ApiError::bad(e.to_string()))?;
    Ok(Json(json!({"content": content})))
}

/// llama-server's `/apply-template`: the prompt a chat request's messages render to.
async fn apply_template(
    AxState(state): AxState<Arc<State>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let parsed = openai::chat_request(parse(body)?, Instant::now(), state.sampling())?;
    let engine = state.engine()?.clone();
    let prompt = tokio::task::spawn_blocking(move || engine.render_prompt(&parsed.req.prompt))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("rendering: {e}")))?
        .map_err(|e| ApiError::from(&e))?;
    Ok(Json(json!({"prompt": prompt})))
}
