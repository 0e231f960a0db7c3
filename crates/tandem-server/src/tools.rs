//! Tool calls in a model's output, in the formats of the models tandem serves: Kimi K2
//! (`<|tool_calls_section_begin|>` … `functions.NAME:IDX<|tool_call_argument_begin|>{…}` …),
//! DeepSeek V3 / R1 (`<｜tool▁calls▁begin｜>` … `function<｜tool▁sep｜>NAME` and a fenced JSON
//! block, or V3.1's `NAME<｜tool▁sep｜>{…}`), Hermes / Qwen (`<tool_call>{"name", "arguments"}
//! </tool_call>`), and a bare JSON object `{"name", "arguments"}` as the whole answer. What is
//! not a call stays content. While streaming, content goes out until a call begins; the calls
//! are sent whole at the end.

use crate::reasoning::partial_suffix;
use serde_json::{json, Value};

/// A parsed call: the function's name and its arguments as JSON text (OpenAI's shape).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

use tandem_engine::tool_format::{
    DS_BEGIN, DS_CALL, DS_CALL_END, DS_END, DS_SEP, HERMES, HERMES_END, KIMI_ARGS, KIMI_BEGIN, KIMI_CALL,
    KIMI_CALL_END, KIMI_END,
};

/// Where a block of calls may begin.
const STARTS: [&str; 3] = [KIMI_BEGIN, DS_BEGIN, HERMES];

/// Splits `text` into content and the calls in it. Text that looks like a call but does not
/// parse stays content, so nothing the model wrote is lost.
pub fn parse(text: &str) -> (String, Vec<ToolCall>) {
    if let Some(i) = text.find(KIMI_BEGIN) {
        if let Some(calls) = kimi(&text[i + KIMI_BEGIN.len()..]) {
            return (text[..i].trim_end().to_string(), calls);
        }
    }
    if let Some(i) = text.find(DS_BEGIN) {
        if let Some(calls) = deepseek(&text[i + DS_BEGIN.len()..]) {
            return (text[..i].trim_end().to_string(), calls);
        }
    }
    if let Some(i) = text.find(HERMES) {
        if let Some((calls, rest)) = hermes(&text[i..]) {
            let content = format!("{}{}", &text[..i], rest).trim().to_string();
            return (content, calls);
        }
    }
    // the whole answer one JSON call (models without call markers, as llama-server's generic format)
    if let Ok(v) = serde_json::from_str::<Value>(text.trim()) {
        let calls: Vec<ToolCall> = match v.get("tool_calls").and_then(Value::as_array) {
            Some(list) => list.iter().filter_map(json_call).collect(),
            None => json_call(&v).into_iter().collect(),
        };
        if !calls.is_empty() {
            return (String::new(), calls);
        }
    }
    (text.to_string(), Vec::new())
}

/// `{"name": N, "arguments": A}` (A an object or JSON text; also `parameters`).
fn json_call(v: &Value) -> Option<ToolCall> {
    let f = v.get("function").unwrap_or(v);
    let name = f.get("name")?.as_str()?.to_string();
    let args = f.get("arguments").or_else(|| f.get("parameters")).cloned().unwrap_or(json!({}));
    Some(ToolCall { name, arguments: arguments_text(args)? })
}

/// Arguments as OpenAI sends them: JSON text of an object.
fn arguments_text(args: Value) -> Option<String> {
    match args {
        Value::String(s) => serde_json::from_str::<Value>(&s).ok().filter(Value::is_object).map(|v| v.to_string()),
        v @ Value::Object(_) => Some(v.to_string()),
        _ => None,
    }
}

fn kimi(section: &str) -> Option<Vec<ToolCall>> {
    marked_calls(section, KIMI_END, KIMI_CALL, KIMI_CALL_END, |call| {
        let (id, args) = call.split_once(KIMI_ARGS)?;
        // functions.NAME:INDEX
        let id = id.trim();
        let name = id.strip_prefix("functions.").unwrap_or(id);
        Some((name.rsplit_once(':').map_or(name, |(n, _)| n), args.trim()))
    })
}

fn deepseek(section: &str) -> Option<Vec<ToolCall>> {
    marked_calls(section, DS_END, DS_CALL, DS_CALL_END, |call| {
        let (head, body) = call.split_once(DS_SEP)?;
        if head.trim() == "function" {
            // V3 / R1: function<sep>NAME\n```json\n{...}\n```
            let (name, rest) = body.split_once('\n')?;
            let rest = rest.trim();
            let rest = rest.strip_prefix("```json").or_else(|| rest.strip_prefix("```")).unwrap_or(rest);
            Some((name.trim(), rest.strip_suffix("```").unwrap_or(rest).trim()))
        } else {
            // V3.1: NAME<sep>{...}
            Some((head.trim(), body.trim()))
        }
    })
}

/// The calls of a section of marked calls (up to `end`): each one between `call` and `call_end`,
/// whose text `name_args` splits into the function's name and its JSON arguments. `None` when
/// there is none or one is malformed.
fn marked_calls<'a>(
    section: &'a str,
    end: &str,
    call: &str,
    call_end: &str,
    name_args: impl Fn(&'a str) -> Option<(&'a str, &'a str)>,
) -> Option<Vec<ToolCall>> {
    let section = section.split(end).next().unwrap_or(section);
    let mut calls = Vec::new();
    for c in section.split(call).skip(1) {
        let (name, args) = name_args(c.split(call_end).next()?)?;
        let args: Value = serde_json::from_str(args).ok()?;
        calls.push(ToolCall { name: name.to_string(), arguments: arguments_text(args)? });
    }
    (!calls.is_empty()).then_some(calls)
}

/// Every `<tool_call>{…}</tool_call>` of `text` (which starts with one), and the text around them.
fn hermes(text: &str) -> Option<(Vec<ToolCall>, String)> {
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut t = text;
    while let Some(i) = t.find(HERMES) {
        rest.push_str(&t[..i]);
        let after = &t[i + HERMES.len()..];
        let (body, next) = match after.find(HERMES_END) {
            Some(j) => (&after[..j], &after[j + HERMES_END.len()..]),
            None => (after, ""), // unclosed at the end of the output
        };
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        calls.push(json_call(&v)?);
        t = next;
    }
    rest.push_str(t);
    Some((calls, rest))
}

/// The OpenAI `tool_calls` array of `calls`, with fresh ids.
pub fn openai_calls(calls: &[ToolCall], new_id: &mut dyn FnMut() -> String, with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({"id": new_id(), "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}});
                if with_index {
                    v["index"] = i.into();
                }
                v
            })
            .collect(),
    )
}

/// Streaming: content until a call block may begin, the rest kept for [`parse`] at the end.
#[derive(Debug, Default)]
pub struct ToolStream {
    /// Everything from the possible start of a call on.
    held: String,
    /// A call block began (or the answer opened with `{`, maybe a bare JSON call).
    in_call: bool,
    sent_any: bool,
}

impl ToolStream {
    /// The content of `text` that can go out now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        if !self.sent_any && self.held.trim_start().starts_with('{') {
            self.in_call = true;
            return String::new();
        }
        if let Some(i) = STARTS.iter().filter_map(|s| self.held.find(s)).min() {
            self.in_call = true;
            let out = self.held[..i].to_string();
            self.held.drain(..i);
            return out;
        }
        // keep a possible marker's beginning
        let keep = STARTS.iter().map(|s| partial_suffix(&self.held, s)).max().unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        self.sent_any |= !out.trim().is_empty();
        out
    }

    /// At the end: content still to send, and the calls.
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        parse(&held)
    }
}

/// A streamed answer: thinking split from the text ([`crate::reasoning::Splitter`]) and, when
/// tools were offered, calls held back from the text and parsed at the end.
pub struct AnswerStream {
    split: crate::reasoning::Splitter,
    calls: Option<ToolStream>,
}

/// A whole answer as (thinking, text, calls): the calls parsed out of the text when tools were
/// offered.
pub fn whole_answer(
    mut split: crate::reasoning::Splitter,
    tools: bool,
    answer: &str,
) -> (String, String, Vec<ToolCall>) {
    let (mut reasoning, mut text) = split.push(answer);
    let (r, t) = split.finish();
    reasoning += &r;
    text += &t;
    if !tools {
        return (reasoning, text, Vec::new());
    }
    let (text, calls) = parse(&text);
    (reasoning, text, calls)
}

impl AnswerStream {
    pub fn new(split: crate::reasoning::Splitter, tools: bool) -> AnswerStream {
        AnswerStream { split, calls: tools.then(ToolStream::default) }
    }

    /// The (thinking, text) of `text` that can go out now.
    pub fn push(&mut self, text: &str) -> (String, String) {
        let (r, mut t) = self.split.push(text);
        if let Some(ts) = self.calls.as_mut() {
            t = ts.push(&t);
        }
        (r, t)
    }

    /// The end: the last `text`, then everything held back as (thinking, text) and the calls.
    pub fn finish(&mut self, text: &str) -> (String, String, Vec<ToolCall>) {
        let (mut r, mut t) = self.split.push(text);
        let (r2, t2) = self.split.finish();
        r += &r2;
        t += &t2;
        let mut calls = Vec::new();
        if let Some(ts) = self.calls.as_mut() {
            let mut sent = ts.push(&t);
            let (rest, found) = ts.finish();
            sent += &rest;
            t = sent;
            calls = found;
        }
        (r, t, calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: args.into() }
    }

    #[test]
    fn every_format_parses() {
        let want = vec![call("get_weather", r#"{"city":"Paris"}"#)];
        // Kimi K2, as its template writes an assistant's calls
        let kimi = "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>";
        assert_eq!(parse(kimi), ("Let me check.".into(), want.clone()));
        // DeepSeek V3 / R1
        let v3 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(parse(v3), (String::new(), want.clone()));
        // DeepSeek V3.1
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(parse(v31), (String::new(), want.clone()));
        // Hermes / Qwen, two calls
        let hermes = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse(hermes);
        assert_eq!(content, "Sure.");
        assert_eq!(calls, vec![want[0].clone(), call("get_time", "{}")]);
        // a bare JSON call, arguments as text
        assert_eq!(
            parse(r#"{"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}"#),
            (String::new(), want.clone())
        );
        // no call, or one that does not parse: all content
        assert_eq!(parse("It is sunny."), ("It is sunny.".into(), vec![]));
        let broken = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>";
        assert_eq!(parse(broken), (broken.into(), vec![]));
        assert_eq!(parse(r#"{"city": "Paris"}"#).1, vec![]);
    }

    #[test]
    fn streaming_sends_content_until_a_call() {
        let text = "Let me check the weather.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        for step in [1, 2, 3, 7, 1000] {
            let mut s = ToolStream::default();
            let mut content = String::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                content += &s.push(&piece.iter().collect::<String>());
                assert!(!content.contains('<'), "{content:?}");
            }
            let (rest, calls) = s.finish();
            assert_eq!((content + &rest).trim(), "Let me check the weather.", "step {step}");
            assert_eq!(calls, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
        }
        let mut s = ToolStream::default();
        assert_eq!(s.push("a <"), "a ");
        assert_eq!(s.push(" b"), "< b");
        assert_eq!(s.finish(), (String::new(), vec![]));
    }
}
