//! Tool calls as the real chat templates write them (tandem-tokenizer's built-ins, copied from
//! the models' own templates) parse back into the same calls: an assistant turn with a call is
//! rendered, the model's part of the transcript is cut out, and `tools::parse` must find the call.

use serde_json::json;
use tandem_server::tools::{parse, ToolCall};
use tandem_tokenizer::{ChatTemplate, BUILTIN_TEMPLATES};

fn template(name: &str) -> ChatTemplate {
    let src = BUILTIN_TEMPLATES.iter().find(|(n, _)| *n == name).unwrap().1;
    ChatTemplate::new(src, "<s>", "</s>").unwrap()
}

/// The transcript of an assistant turn that calls get_weather(city=Paris), without what the
/// template writes before the turn (the same conversation rendered up to the generation prompt).
fn assistant_turn(name: &str) -> String {
    let t = template(name);
    let tools =
        [json!({"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}}}})];
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let call = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]});
    let before = t.render(std::slice::from_ref(&user), Some(&tools), true).unwrap();
    let all = t.render(&[user, call], Some(&tools), false).unwrap();
    // the generation prompt may open more than the transcript holds (DeepSeek-R1's `<think>`)
    let prefix = [before.as_str(), before.trim_end().trim_end_matches("<think>")]
        .into_iter()
        .find(|p| all.starts_with(p))
        .unwrap_or_else(|| panic!("{name}: the conversation does not extend the prompt:\n{before}\n---\n{all}"));
    // the model's own part ends at its end-of-turn token, which ends generation (not text)
    let turn = &all[prefix.len()..];
    let end = ["<|eot_id|>", "<|im_end|>", "<｜end▁of▁sentence｜>"].iter().filter_map(|e| turn.find(e)).min();
    turn[..end.unwrap_or(turn.len())].to_string()
}

#[test]
fn calls_rendered_by_the_real_templates_parse_back() {
    let want = vec![ToolCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }];
    for name in ["kimi-k2", "hermes", "qwen", "deepseek3", "deepseek-r1", "llama3"] {
        let turn = assistant_turn(name);
        let (content, calls) = parse(&turn);
        assert_eq!(calls, want, "{name}: {turn:?}");
        assert!(!content.contains("get_weather"), "{name}: {content:?}");
        println!("{name}: {turn:?}");
    }
}
