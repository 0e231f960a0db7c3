//! Chat templates: the Jinja in `tokenizer.chat_template`, rendered with minijinja set up the way
//! transformers' `apply_chat_template` sets up Python's jinja2 (trim_blocks, lstrip_blocks, loop
//! controls, `raise_exception`, `strftime_now`, a `tojson` that writes what Python's `json.dumps`
//! writes) plus Python's string/dict/list methods (`.strip()`, `.get()`, `.items()`, ...).

use crate::{Error, Result};
use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, ErrorKind};
use serde_json::Value as Json;

const NAME: &str = "chat_template";

/// The built-in templates `--chat-template NAME` chooses (templates/README.md says where each
/// comes from).
pub const BUILTIN_TEMPLATES: [(&str, &str); 7] = [
    ("chatml", include_str!("../templates/chatml.jinja")),
    ("llama3", include_str!("../templates/llama3.jinja")),
    ("deepseek3", include_str!("../templates/deepseek3.jinja")),
    ("deepseek-r1", include_str!("../templates/deepseek-r1.jinja")),
    ("kimi-k2", include_str!("../templates/kimi-k2.jinja")),
    ("qwen", include_str!("../templates/qwen.jinja")),
    ("hermes", include_str!("../templates/hermes.jinja")),
];

/// Where a chat template came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateSource {
    /// `--chat-template NAME`.
    Builtin(&'static str),
    /// `--chat-template JINJA` or `--chat-template-file`.
    Given,
    /// The GGUF's `tokenizer.chat_template`.
    Model,
    /// None in the model and none given: chatml, as llama-server.
    Fallback,
}

/// The template source text for `--chat-template VALUE`: a built-in name, or Jinja (anything with
/// `{{` or `{%`). Anything else is an error naming the built-ins.
pub fn resolve_template_arg(value: &str) -> std::result::Result<(String, TemplateSource), String> {
    if let Some((name, src)) = BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == value.trim()) {
        return Ok((src.to_string(), TemplateSource::Builtin(name)));
    }
    if value.contains("{{") || value.contains("{%") {
        return Ok((value.to_string(), TemplateSource::Given));
    }
    let names: Vec<&str> = BUILTIN_TEMPLATES.iter().map(|(n, _)| *n).collect();
    Err(format!(
        "--chat-template {:?}: not a built-in template ({}) and not Jinja; give a file with --chat-template-file",
        value.chars().take(80).collect::<String>(),
        names.join(", ")
    ))
}

/// The template to use: `given` (from the flags) if any, else the model's, else chatml.
pub fn choose_template(given: Option<(String, TemplateSource)>, model: Option<&str>) -> (String, TemplateSource) {
    match (given, model) {
        (Some(g), _) => g,
        (None, Some(m)) => (m.to_string(), TemplateSource::Model),
        (None, None) => (BUILTIN_TEMPLATES[0].1.to_string(), TemplateSource::Fallback),
    }
}

/// A parsed chat template and the special-token texts it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

/// One chat message in the OpenAI shape: `{"role": "user", "content": "..."}`, possibly with
/// `tool_calls`, `tool_call_id` or list-of-parts content.
pub fn message(role: &str, content: &str) -> Json {
    serde_json::json!({ "role": role, "content": content })
}

impl ChatTemplate {
    /// Parses `source`; syntax errors are reported here, not at the first render.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(Error::from)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string()).map_err(Error::from)?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
    }

    /// The Jinja text it was parsed from.
    pub fn source(&self) -> String {
        self.env.get_template(NAME).map(|t| t.source().to_string()).unwrap_or_default()
    }

    /// Renders `messages` (OpenAI-shaped JSON objects); `tools` is passed as the `tools` variable.
    /// The render's budget ([`render_fuel`]) stops a template that loops or grows without end
    /// with an error.
    pub fn render(&self, messages: &[Json], tools: Option<&[Json]>, add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`ChatTemplate::render`] with more variables for the template (llama.cpp's
    /// `chat_template_kwargs`, e.g. `enable_thinking` or `thinking`); they cannot replace
    /// `messages`, `tools`, `add_generation_prompt` or the BOS and EOS texts.
    pub fn render_with(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        let mut env = self.env.clone();
        env.set_fuel(Some(render_fuel(messages, tools)));
        let tmpl = env.get_template(NAME).map_err(Error::from)?;
        let ctx = minijinja::context! {
            messages => Value::from(Serde(messages)),
            tools => tools.map(|t| Value::from(Serde(t))),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..Value::from(Serde(extra))
        };
        Ok(tmpl.render(ctx)?)
    }
}

/// minijinja's fuel for rendering a conversation: about one unit an instruction and one per 64
/// bytes made. The built-in templates (Kimi K2, DeepSeek V3 and R1, Hermes, Qwen, Llama 3, ChatML)
/// took 15 to 85 units a message over a 201-message tool conversation, so a million (64 MB,
/// milliseconds) plus 4,000 a message or tool and one per 4 bytes of their JSON leaves real
/// templates room many times over, while a loop without end or a string doubled in a loop stops
/// in linear time and memory. Not covered: a list doubled in a loop (`l = l + l`), which
/// minijinja 3.1 makes whole past 32 lazy concatenations without charging fuel.
fn render_fuel(messages: &[Json], tools: Option<&[Json]>) -> u64 {
    /// Counts the bytes written to it (the JSON's length, without making the string).
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len() as u64;
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let items = messages.iter().chain(tools.unwrap_or_default());
    let (n, bytes) = items.fold((0u64, 0u64), |(n, b), m| {
        let mut c = Count(0);
        // writing a Value to a sink that never fails cannot fail
        let _ = serde_json::to_writer(&mut c, m);
        (n + 1, b + c.0)
    });
    1_000_000 + 4_000 * n + bytes / 4
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json =
        serde_json::to_value(&value).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let (item, key) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    write_json(&mut out, &json, &PyJson { indent, item, key, sort_keys: sort_keys.unwrap_or(false) }, 0);
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

fn write_json(out: &mut String, v: &Json, f: &PyJson, depth: usize) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = f.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&f.item);
                }
                newline(out, depth + 1);
                write_json(out, x, f, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if f.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&f.item);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(&f.key);
                write_json(out, x, f, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        Json::Number(n) if n.is_f64() => {
            // Python writes floats with repr(): 1.0, 1e-05, 1e+20
            let x = n.as_f64().unwrap_or(0.0);
            let s = if x.is_finite() && x == x.trunc() && x.abs() < 1e16 { format!("{x:.1}") } else { n.to_string() };
            out.push_str(&s);
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `strftime_now(format)`: the current UTC time with the C strftime fields templates use.
fn strftime_now(fmt: &str) -> std::result::Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Ok(strftime(fmt, secs))
}

fn strftime(fmt: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = (secs / 86_400) as i64;
    let tod = secs % 86_400;
    // civil-from-days (Howard Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (m, wd) = ((month - 1) as usize, days.rem_euclid(7) as usize);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('B') => out.push_str(MONTHS[m]),
            Some('b') => out.push_str(&MONTHS[m][..3]),
            Some('A') => out.push_str(DAYS[wd]),
            Some('a') => out.push_str(&DAYS[wd][..3]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_raises() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\
             [{{ m.role }}]{{ m.content.strip() }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let msgs = [message("user", " hi ")];
        assert_eq!(t.render(&msgs, None, true).unwrap(), "[user]hi[assistant]");
        let err = t.render(&[message("bad", "x")], None, false).unwrap_err().to_string();
        assert!(err.contains("no bad roles"), "{err}");
        assert!(ChatTemplate::new("{% if %}", "", "").is_err());
    }

    #[test]
    fn tojson_writes_python_json() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", "", "").unwrap();
        let env_ctx = serde_json::json!({"a": [1, 2.0, "é<"], "b": {}});
        let tmpl = t.env.get_template(NAME).unwrap();
        let s = tmpl.render(minijinja::context! { x => Value::from(Serde(&env_ctx)) }).unwrap();
        assert_eq!(
            s,
            "{\"a\": [1, 2.0, \"é<\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    2.0,\n    \"é<\"\n  ],\n  \"b\": {}\n}"
        );
    }

    #[test]
    fn strftime_formats_dates() {
        // 2024-07-26 13:25:09 UTC, a Friday
        assert_eq!(strftime("%d %b %Y %H:%M:%S %A %B %%", 1_722_000_309), "26 Jul 2024 13:25:09 Friday July %");
    }

    #[test]
    fn every_builtin_renders_a_tool_conversation() {
        let tools = [serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}})];
        let messages = [
            serde_json::json!({"role": "system", "content": "You are terse."}),
            serde_json::json!({"role": "user", "content": "Weather in Paris?"}),
            serde_json::json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
            serde_json::json!({"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}),
            serde_json::json!({"role": "assistant", "content": "Sunny, 18 C."}),
            serde_json::json!({"role": "user", "content": "Thanks!"}),
        ];
        for (name, src) in BUILTIN_TEMPLATES {
            let t = ChatTemplate::new(src, "<s>", "</s>").unwrap_or_else(|e| panic!("{name}: {e}"));
            let with_tools = if name == "chatml" { None } else { Some(&tools[..]) };
            let out = t.render(&messages, with_tools, true).unwrap_or_else(|e| panic!("{name}: {e}"));
            for text in ["Weather in Paris?", "Sunny, 18 C.", "Thanks!"] {
                assert!(out.contains(text), "{name} lost {text:?}:\n{out}");
            }
            if name != "chatml" {
                assert!(out.contains("get_weather") && out.contains("18 C, sunny"), "{name}:\n{out}");
            }
        }
        assert!(resolve_template_arg("kimi-k2").is_ok());
        assert_eq!(resolve_template_arg("{{ messages }}").map(|r| r.1), Ok(TemplateSource::Given));
        let e = resolve_template_arg("chatm").unwrap_err();
        assert!(e.contains("chatml, llama3") && e.contains("--chat-template-file"), "{e}");
        assert_eq!(choose_template(None, None).1, TemplateSource::Fallback);
    }

    #[test]
    fn templates_that_loop_or_grow_without_end_are_stopped() {
        // A model file's template is input like any other: these would run for hours or take
        // all the memory. Each must end in a one-line error, in a budget that grows with the
        // conversation (a long one still renders, see the end).
        let hostile = [
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(1) }}",
            "{{ 'x' * 99999999 }}",
            "{% for m in messages %}{% for i in range(100000) %}{{ m.content }}{% endfor %}{% endfor %}",
        ];
        let msgs = [message("user", &"y".repeat(1000))];
        for src in hostile {
            let t = ChatTemplate::new(src, "", "").unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let msgs = msgs.clone();
            std::thread::spawn(move || tx.send(t.render(&msgs, None, true).map(|s| s.len())));
            let got = rx
                .recv_timeout(std::time::Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("{src}: still rendering"));
            let e = got.expect_err(src).to_string();
            assert!(!e.contains('\n'), "{src}: {e}");
        }
        // 2,000 messages of 2 KB through the Kimi K2 template: within the budget.
        let (_, kimi) = BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == "kimi-k2").unwrap();
        let t = ChatTemplate::new(kimi, "", "").unwrap();
        let long: Vec<Json> =
            (0..2000).map(|i| message(if i % 2 == 0 { "user" } else { "assistant" }, &"z".repeat(2048))).collect();
        assert!(t.render(&long, None, true).unwrap().len() > 2000 * 2048);
    }
}
