//! The tool-call formats of the models tandem serves, as their chat templates write them, and the
//! grammar that makes a model call a tool when a request says it must (OpenAI's `tool_choice`
//! `"required"` or a named function): Kimi K2 (`<|tool_calls_section_begin|>` …), DeepSeek V3 /
//! R1 (`function<｜tool▁sep｜>NAME` and a fenced JSON block), DeepSeek V3.1 (`NAME<｜tool▁sep｜>{…}`),
//! Hermes / Qwen (`<tool_call>{"name", "arguments"}</tool_call>`), and a bare JSON object for
//! templates with no markers (llama 3's `{"name", "parameters"}`). The format is read from the
//! template's text; the arguments are held to each tool's `parameters` schema.

use crate::{Error, Result};
use serde_json::{json, Value};
use tandem_tokenizer::{vocab::attr, Tokenizer};

pub const KIMI_BEGIN: &str = "<|tool_calls_section_begin|>";
pub const KIMI_END: &str = "<|tool_calls_section_end|>";
pub const KIMI_CALL: &str = "<|tool_call_begin|>";
pub const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";
pub const KIMI_CALL_END: &str = "<|tool_call_end|>";
pub const DS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
pub const DS_END: &str = "<｜tool▁calls▁end｜>";
pub const DS_CALL: &str = "<｜tool▁call▁begin｜>";
pub const DS_SEP: &str = "<｜tool▁sep｜>";
pub const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
pub const HERMES: &str = "<tool_call>";
pub const HERMES_END: &str = "</tool_call>";

/// How a chat template writes an assistant's tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{…}<|tool_call_end|>…`
    Kimi,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{…}\n```<｜tool▁call▁end｜>…`
    DeepSeekFenced,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…`
    DeepSeek,
    /// `<tool_call>\n{"name": N, "arguments": {…}}\n</tool_call>`
    Hermes,
    /// The whole answer one object `{"name": N, KEY: {…}}`.
    Json { key: &'static str },
}

impl ToolFormat {
    /// The format a chat template's text writes calls in.
    pub fn of_template(src: &str) -> ToolFormat {
        if src.contains(KIMI_CALL) {
            ToolFormat::Kimi
        } else if src.contains(DS_CALL) {
            if src.contains("```json") {
                ToolFormat::DeepSeekFenced
            } else {
                ToolFormat::DeepSeek
            }
        } else if src.contains(HERMES) {
            ToolFormat::Hermes
        } else if src.contains("\"parameters\": dictionary") || src.contains("\"parameters\": {") {
            // llama 3.x: {"name": function name, "parameters": dictionary of argument name and its value}
            ToolFormat::Json { key: "parameters" }
        } else {
            ToolFormat::Json { key: "arguments" }
        }
    }
}

/// A Lark grammar (llguidance's) for output that is a call of one of `tools` (one or more with
/// `parallel`; one call of `only` when given) in `format`. Markers that are control tokens of the vocabulary are
/// named by id, so the model must write that token; `think_open`: the prompt left a `<think>`
/// block open, which the model closes before the calls.
pub fn call_grammar(
    format: ToolFormat,
    tools: &[Value],
    only: Option<&str>,
    parallel: bool,
    tok: &Tokenizer,
    think_open: bool,
) -> Result<String> {
    let bad = |m: String| Error::InvalidRequest(format!("tool_choice: {m}"));
    let mut chosen = Vec::new();
    for t in tools {
        let f = t.get("function").unwrap_or(t);
        let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
        let Some(name) = name else { return Err(bad(format!("the tool {t} has no function.name"))) };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let params = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ (Value::Object(_) | Value::Bool(true))) => p.clone(),
            Some(p) => return Err(bad(format!("the parameters of {name:?} are not a JSON schema: {p}"))),
        };
        chosen.push((name.to_string(), params));
    }
    if chosen.is_empty() {
        return Err(bad(match only {
            Some(n) => format!("{n:?} is not among the tools"),
            None => "\"required\" needs tools".into(),
        }));
    }
    // a marker: the control token by id where it is one, else its text
    let m = |text: &str| -> String {
        match tok.token_id(text) {
            Some(id) if tok.token_attr(id).is_some_and(|a| a & attr::CONTROL != 0) => format!("<[{id}]>"),
            _ => lit(text),
        }
    };
    // compact JSON, as the templates write it (and no room for endless whitespace)
    let schema = |s: &Value| {
        let mut s = if s.is_object() { s.clone() } else { json!({}) };
        s["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        format!("%json {s}")
    };
    let mut rules = Vec::new();
    let calls = if parallel && only.is_none() { "call+" } else { "call" };
    let start = match format {
        ToolFormat::Kimi => {
            let alts: Vec<String> = chosen
                .iter()
                .map(|(n, p)| {
                    format!(
                        "{} {} INDEX {} {} {}",
                        m(KIMI_CALL),
                        lit(&format!("functions.{n}:")),
                        m(KIMI_ARGS),
                        schema(p),
                        m(KIMI_CALL_END)
                    )
                })
                .collect();
            rules.push(format!("call: {}", alts.join("\n    | ")));
            rules.push("INDEX: /[0-9]{1,3}/".into());
            format!("{} {calls} {}", m(KIMI_BEGIN), m(KIMI_END))
        }
        ToolFormat::DeepSeek | ToolFormat::DeepSeekFenced => {
            let fenced = format == ToolFormat::DeepSeekFenced;
            let alts: Vec<String> = chosen
                .iter()
                .map(|(n, p)| {
                    let body = if fenced {
                        format!(
                            "{} {} {} {} {}",
                            lit("function"),
                            m(DS_SEP),
                            lit(&format!("{n}\n```json\n")),
                            schema(p),
                            lit("\n```")
                        )
                    } else {
                        format!("{} {} {}", lit(n), m(DS_SEP), schema(p))
                    };
                    format!("{} {body} {}", m(DS_CALL), m(DS_CALL_END))
                })
                .collect();
            rules.push(format!("call: {}", alts.join("\n    | ")));
            format!("{} {calls} {}", m(DS_BEGIN), m(DS_END))
        }
        ToolFormat::Hermes => {
            let objects = object_schema(&chosen, "arguments");
            rules.push(format!("call: {} \"\\n\" {} \"\\n\" {}", m(HERMES), schema(&objects), m(HERMES_END)));
            if calls == "call" {
                "call".into()
            } else {
                "call (\"\\n\" call)*".into()
            }
        }
        ToolFormat::Json { key } => schema(&object_schema(&chosen, key)),
    };
    let start = if think_open { format!("think GAP? {start}") } else { start };
    let mut g = format!("start: {start}\n");
    if think_open {
        // the thinking ends at its first </think>; a blank line or two may follow
        g.push_str("think[suffix=\"</think>\"]: /(?s:.*)/\nGAP: /[ \\n]{1,4}/\n");
    }
    for r in rules {
        g.push_str(&r);
        g.push('\n');
    }
    Ok(g)
}

/// `{"name": N, KEY: ARGS}` for each (N, ARGS schema).
fn object_schema(chosen: &[(String, Value)], key: &str) -> Value {
    let one = |(n, p): &(String, Value)| {
        json!({"type": "object", "properties": {"name": {"const": n}, key: p},
               "required": ["name", key], "additionalProperties": false})
    };
    match chosen {
        [c] => one(c),
        _ => json!({"anyOf": chosen.iter().map(one).collect::<Vec<_>>()}),
    }
}

/// A Lark string literal of `s`.
fn lit(s: &str) -> String {
    // JSON string escapes are Lark's
    Value::String(s.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_read_from_the_templates() {
        let of = |name: &str| {
            let src = tandem_tokenizer::BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == name).unwrap().1;
            ToolFormat::of_template(src)
        };
        assert_eq!(of("kimi-k2"), ToolFormat::Kimi);
        assert_eq!(of("deepseek-r1"), ToolFormat::DeepSeekFenced);
        assert_eq!(of("deepseek3"), ToolFormat::DeepSeek);
        assert_eq!(of("hermes"), ToolFormat::Hermes);
        assert_eq!(of("qwen"), ToolFormat::Hermes);
        assert_eq!(of("llama3"), ToolFormat::Json { key: "parameters" });
        assert_eq!(of("chatml"), ToolFormat::Json { key: "arguments" });
    }
}
