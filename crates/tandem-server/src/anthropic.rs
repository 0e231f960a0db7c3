//! Anthropic's Messages API, as llama-server serves it: `POST /v1/messages` (streamed or not)
//! and `POST /v1/messages/count_tokens`. A request is translated into an OpenAI chat request, so
//! the chat template, tools, samplers, limits and checks are those of `/v1/chat/completions`;
//! the answer comes back in Anthropic's content blocks (`thinking`, `text`, `tool_use`) and,
//! streamed, in its named events (`message_start`, `content_block_start`, `content_block_delta`,
//! `content_block_stop`, `message_delta`, `message_stop`). Only text content is taken; images
//! and documents are refused by name.

use crate::http::{self, ApiError};
use crate::openai::{self, BadParam};
use crate::reasoning::Splitter;
use crate::service::{KeyIndex, State};
use crate::tools::{AnswerStream, ToolCall};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State as AxState;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;
use tandem_engine::{Event, Finish, FinishReason};

/// A Messages API request (the fields tandem reads; `metadata` and the like are ignored).
#[derive(Deserialize, Debug)]
pub struct MessagesRequest {
    pub max_tokens: Option<u32>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub messages: Vec<InMessage>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    /// `{"type": "enabled", "budget_tokens": N}` or `{"type": "disabled"}`: the chat template's
    /// thinking switch (`thinking` and `enable_thinking`, as DeepSeek-V3.1's and Qwen3's read
    /// it); the budget is not enforced.
    pub thinking: Option<Value>,
}

#[derive(Deserialize, Debug)]
pub struct InMessage {
    pub role: String,
    /// A string or a list of content blocks.
    pub content: Value,
}

/// The text of a string or of a list of text blocks; any other block is an error naming it.
fn text_of(v: &Value, what: &str) -> Result<String, BadParam> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for b in blocks {
                match b["type"].as_str() {
                    Some("text") => text.push_str(b["text"].as_str().unwrap_or_default()),
                    other => {
                        return Err(BadParam(format!("{what}: a block of type {other:?}: only text is supported")))
                    }
                }
            }
            Ok(text)
        }
        other => Err(BadParam(format!("{what}: {other} is neither text nor a list of blocks"))),
    }
}

/// The OpenAI chat request that asks what `r` asks.
pub fn to_openai(r: MessagesRequest) -> Result<openai::ChatRequest, BadParam> {
    let mut messages = Vec::new();
    if let Some(system) = &r.system {
        messages.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    for (i, m) in r.messages.iter().enumerate() {
        let blocks = match &m.content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            other => return Err(BadParam(format!("messages[{i}].content: {other} is neither text nor blocks"))),
        };
        let (mut text, mut calls) = (String::new(), Vec::new());
        for b in &blocks {
            match (m.role.as_str(), b["type"].as_str()) {
                (_, Some("text")) => text.push_str(b["text"].as_str().unwrap_or_default()),
                // what the model thought is not sent back to it (as the templates drop it)
                ("assistant", Some("thinking" | "redacted_thinking")) => {}
                ("assistant", Some("tool_use")) => calls.push(json!({
                    "id": b["id"], "type": "function",
                    "function": {"name": b["name"], "arguments": b["input"].to_string()},
                })),
                ("user", Some("tool_result")) => messages.push(json!({
                    "role": "tool", "tool_call_id": b["tool_use_id"],
                    "content": text_of(&b["content"], &format!("messages[{i}] tool_result"))?,
                })),
                (role, kind) => {
                    return Err(BadParam(format!(
                    "messages[{i}]: a {role} block of type {kind:?}: only text, tool_use and tool_result are supported"
                )))
                }
            }
        }
        match m.role.as_str() {
            "assistant" if !calls.is_empty() => {
                messages.push(json!({"role": "assistant", "content": text, "tool_calls": calls}))
            }
            "assistant" | "user" if !text.is_empty() || blocks.is_empty() => {
                messages.push(json!({"role": m.role, "content": text}))
            }
            "assistant" | "user" => {}
            other => return Err(BadParam(format!("messages[{i}].role {other:?}: user or assistant"))),
        }
    }
    let tools: Option<Vec<Value>> = r
        .tools
        .map(|tools| {
            tools
                .into_iter()
                .map(|t| match t["type"].as_str() {
                    None | Some("custom") => Ok(json!({"type": "function", "function": {
                        "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}})),
                    Some(other) => Err(BadParam(format!("tools: a tool of type {other:?}: only custom tools"))),
                })
                .collect()
        })
        .transpose()?;
    let (tool_choice, parallel) = match &r.tool_choice {
        None => (Value::Null, true),
        Some(c) => {
            let parallel = c["disable_parallel_tool_use"] != true;
            let choice = match c["type"].as_str() {
                Some("auto") => json!("auto"),
                Some("any") => json!("required"),
                Some("none") => json!("none"),
                Some("tool") => json!({"type": "function", "function": {"name": c["name"]}}),
                _ => return Err(BadParam(format!("tool_choice: {c} (type auto, any, tool or none)"))),
            };
            (choice, parallel)
        }
    };
    let kwargs = match r.thinking.as_ref().map(|t| t["type"].as_str()) {
        None => Value::Null,
        Some(Some(kind @ ("enabled" | "disabled"))) => {
            let on = kind == "enabled";
            json!({"thinking": on, "enable_thinking": on})
        }
        Some(_) => return Err(BadParam("thinking: type enabled or disabled".into())),
    };
    let chat = json!({
        "messages": messages, "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "chat_template_kwargs": kwargs,
        "max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
        "stop": r.stop_sequences, "stream": r.stream,
    });
    serde_json::from_value(chat).map_err(|e| BadParam(format!("invalid request: {e}")))
}

/// Anthropic's `stop_reason` and `stop_sequence` (the one stop sequence when there is one: the
/// engine does not say which matched).
fn stop(f: &Finish, calls: bool, stops: &[String]) -> (&'static str, Value) {
    match f.reason {
        _ if calls => ("tool_use", Value::Null),
        FinishReason::Stop => ("stop_sequence", if stops.len() == 1 { json!(stops[0]) } else { Value::Null }),
        FinishReason::Length(_) => ("max_tokens", Value::Null),
        FinishReason::Eos | FinishReason::Cancelled => ("end_turn", Value::Null),
    }
}

/// Anthropic's usage: prompt tokens computed apart from those read from the prompt cache.
fn usage(f: &Finish) -> Value {
    let u = &f.usage;
    json!({"input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens), "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

/// A `tool_use` block; arguments that are not a JSON object come as `{}` (as a client could
/// not call with them anyway) with the text kept in nothing else.
fn tool_use(c: &ToolCall, id: String) -> Value {
    let input = serde_json::from_str::<Value>(&c.arguments).ok().filter(Value::is_object).unwrap_or(json!({}));
    json!({"type": "tool_use", "id": id, "name": c.name, "input": input})
}

/// The whole answer as a message.
pub fn message(
    id: &str,
    model: &str,
    parts: (String, String, Vec<ToolCall>),
    f: &Finish,
    stops: &[String],
    new_id: &mut dyn FnMut() -> String,
) -> Value {
    let (reasoning, text, calls) = parts;
    let mut content = Vec::new();
    if !reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
    }
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    content.extend(calls.iter().map(|c| tool_use(c, new_id())));
    let (reason, sequence) = stop(f, !calls.is_empty(), stops);
    json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": reason, "stop_sequence": sequence, "usage": usage(f)})
}

/// A named event of a stream, before it is written.
type Named = (&'static str, Value);

fn event(name: &'static str, data: Value) -> Named {
    (name, data)
}

fn sse(events: Vec<Named>) -> Vec<SseEvent> {
    events.into_iter().map(|(name, data)| SseEvent::default().event(name).data(data.to_string())).collect()
}

/// The open content block of a stream.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    None,
    Thinking,
    Text,
}

/// Turns a streamed answer into Anthropic's events.
struct Blocks {
    open: Open,
    index: usize,
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<Named>) {
        if self.open != Open::None {
            out.push(event("content_block_stop", json!({"type": "content_block_stop", "index": self.index})));
            self.index += 1;
            self.open = Open::None;
        }
    }

    /// Deltas of thinking and of text, each in its block.
    fn push(&mut self, (reasoning, text): (String, String), out: &mut Vec<Named>) {
        for (kind, s) in [(Open::Thinking, reasoning), (Open::Text, text)] {
            if s.is_empty() {
                continue;
            }
            if self.open != kind {
                self.close(out);
                let block = match kind {
                    Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                    _ => json!({"type": "text", "text": ""}),
                };
                out.push(event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": self.index, "content_block": block}),
                ));
                self.open = kind;
            }
            let delta = match kind {
                Open::Thinking => json!({"type": "thinking_delta", "thinking": s}),
                _ => json!({"type": "text_delta", "text": s}),
            };
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
            ));
        }
    }

    /// The calls, each a `tool_use` block with its input in one delta.
    fn calls(&mut self, calls: &[ToolCall], new_id: &mut dyn FnMut() -> String, out: &mut Vec<Named>) {
        self.close(out);
        for c in calls {
            let mut block = tool_use(c, new_id());
            let input = std::mem::replace(&mut block["input"], json!({}));
            out.push(event(
                "content_block_start",
                json!({"type": "content_block_start", "index": self.index, "content_block": block}),
            ));
            let delta = json!({"type": "input_json_delta", "partial_json": input.to_string()});
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
            ));
            out.push(event("content_block_stop", json!({"type": "content_block_stop", "index": self.index})));
            self.index += 1;
        }
    }
}

/// `POST /v1/messages`. Errors answer in Anthropic's shape.
pub async fn messages(
    AxState(state): AxState<Arc<State>>,
    key: Option<Extension<KeyIndex>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match answer(state, key.map(|k| k.0), body).await {
        Ok(r) => r,
        Err(e) => e.anthropic(),
    }
}

async fn answer(
    state: Arc<State>,
    key: Option<KeyIndex>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let chat = to_openai(http::parse(body)?)?;
    let openai::Parsed { req, stream, tools, .. } = openai::chat_request(chat, Instant::now(), state.sampling())?;
    let prepared = http::prepare(&state, &req.prompt).await?;
    let opens = http::prompt_opens(&state, &prepared);
    let stops = req.stop.clone();
    let split = Splitter::new(state.reasoning_format(), opens);
    let (id, rx) = http::submit(&state, req, Some(prepared), "msg_", key).await?;
    let model = http::model_name(&state);
    let ids = state.clone();
    let mut new_id = move || ids.new_id("toolu_");
    if !stream {
        let c = http::collect(rx).await?;
        let parts = crate::tools::whole_answer(split, tools, &c.text);
        return Ok(Json(message(&id, &model, parts, &c.finish, &stops, &mut new_id)).into_response());
    }
    let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
        "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 0, "output_tokens": 0}}});
    let mut blocks = Blocks { open: Open::None, index: 0 };
    let mut answer = AnswerStream::new(split, tools);
    Ok(crate::stream::sse_events(rx, sse(vec![event("message_start", start)]), move |ev| {
        let mut out = Vec::new();
        match ev {
            Event::Token { text, .. } => {
                blocks.push(answer.push(&text), &mut out);
                (sse(out), false)
            }
            Event::Finished { text, finish } => {
                let (r, t, calls) = answer.finish(&text);
                blocks.push((r, t), &mut out);
                blocks.calls(&calls, &mut new_id, &mut out);
                blocks.close(&mut out);
                let (reason, sequence) = stop(&finish, !calls.is_empty(), &stops);
                out.push(event(
                    "message_delta",
                    json!({"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(&finish)}),
                ));
                out.push(event("message_stop", json!({"type": "message_stop"})));
                (sse(out), true)
            }
            Event::Failed(f) => {
                let e = http::failure(&f);
                let data = json!({"type": "error", "error": {"type": "api_error", "message": e.message()}});
                (sse(vec![event("error", data)]), true)
            }
        }
    }))
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the chat template renders it.
pub async fn count_tokens(AxState(state): AxState<Arc<State>>, body: Result<Bytes, BytesRejection>) -> Response {
    let counted = async {
        let chat = to_openai(http::parse(body)?)?;
        let parsed = openai::chat_request(chat, Instant::now(), state.sampling())?;
        let engine = state.engine()?.clone();
        let n = tokio::task::spawn_blocking(move || engine.prompt_tokens(&parsed.req.prompt).map(|t| t.len()))
            .await
            .map_err(|e| ApiError::internal(format!("counting tokens: {e}")))?
            .map_err(|e| ApiError::from(&e))?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    };
    counted.await.unwrap_or_else(ApiError::anthropic)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Result<openai::ChatRequest, BadParam> {
        to_openai(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn a_conversation_with_tools_becomes_openais() {
        let chat = req(json!({
        "model": "x", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "temperature": 0.2,
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call it."},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ]}))
        .ok()
        .unwrap();
        let v = serde_json::to_value(format!("{chat:?}")).unwrap();
        let s = v.as_str().unwrap();
        for want in ["Be brief.", "Checking.", "toolu_1", "{\\\"city\\\":\\\"Paris\\\"}", "18C", "And tomorrow?", "END"]
        {
            assert!(s.contains(want), "{want}: {s}");
        }
        assert!(!s.contains("I should call it."), "{s}");
        assert!(chat.chat_template_kwargs.is_none(), "no thinking switch unless asked");
        let on = req(json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                            "thinking": {"type": "enabled", "budget_tokens": 1024}}))
        .ok()
        .unwrap();
        assert_eq!(on.chat_template_kwargs.unwrap()["thinking"], true);
        assert_eq!(chat.messages.len(), 5, "{s}");
        assert_eq!(chat.messages[3].role, "tool");
        assert_eq!(chat.tool_choice, Some(json!({"type": "function", "function": {"name": "get_weather"}})));
    }

    #[test]
    fn a_stream_opens_and_closes_one_block_at_a_time() {
        let mut b = Blocks { open: Open::None, index: 0 };
        let mut out = Vec::new();
        b.push(("Let me".into(), String::new()), &mut out);
        b.push((" think.".into(), "It is".into()), &mut out);
        b.push((String::new(), " sunny.".into()), &mut out);
        let call = ToolCall { name: "get_weather".into(), arguments: r#"{"city": "Paris"}"#.into() };
        b.calls(&[call], &mut || "toolu_1".into(), &mut out);
        b.close(&mut out);
        let events = out;
        let names: Vec<&str> = events.iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
            ]
        );
        let idx: Vec<u64> = events.iter().map(|e| e.1["index"].as_u64().unwrap()).collect();
        assert_eq!(idx, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]);
        assert_eq!(events[2].1["delta"], json!({"type": "thinking_delta", "thinking": " think."}));
        assert_eq!(events[6].1["delta"], json!({"type": "text_delta", "text": " sunny."}));
        assert_eq!(events[8].1["content_block"]["name"], "get_weather");
        assert_eq!(events[9].1["delta"]["partial_json"], r#"{"city":"Paris"}"#);
    }

    #[test]
    fn what_is_not_text_is_refused_by_name() {
        let image = json!({"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]});
        assert!(req(image).err().unwrap().0.contains("\"image\""));
        let web = json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                         "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
        assert!(req(web).err().unwrap().0.contains("web_search_20250305"));
        let choice = json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                            "tool_choice": {"type": "sometimes"}});
        assert!(req(choice).err().unwrap().0.contains("tool_choice"));
        let role = json!({"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]});
        assert!(req(role).err().unwrap().0.contains("user or assistant"));
    }
}
