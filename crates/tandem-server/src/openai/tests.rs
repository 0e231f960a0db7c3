use super::*;

#[test]
fn openai_fields_map_onto_the_request() {
    let r: ChatRequest = serde_json::from_str(
        r#"{"model":"x","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
            "max_tokens":7,"temperature":0,"stop":"END","seed":3,"stream":true,
            "stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2,
            "top_k":-1,"ignore_eos":true,"grammar":"root ::= \"a\""}"#,
    )
    .unwrap();
    let Parsed { req, stream, include_usage, .. } = chat_request(r, Instant::now(), &Default::default()).ok().unwrap();
    assert!(stream && include_usage);
    // llama-server's extensions on the OpenAI route: top_k -1 keeps every token
    assert!(req.ignore_eos && req.constraint.is_some() && req.sampling.top_k == 0);
    assert_eq!(req.prompt, Prompt::Chat(vec![("user".into(), "hi".into())]));
    assert_eq!((req.max_tokens, req.sampling.temperature, req.sampling.seed, req.logprobs), (7, 0.0, 3, 2));
    assert_eq!(req.stop, ["END"]);
}

#[test]
fn bad_values_are_refused_with_the_parameter_named() {
    let cmpl = |v: Value| completion_request(serde_json::from_value(v).unwrap(), Instant::now(), &Default::default());
    // a prompt list and n: one request per choice, prompt-major, seeds counting up
    let p = cmpl(json!({"prompt": ["a", "b"], "n": 2, "seed": 7})).ok().unwrap();
    let all: Vec<&Request> = std::iter::once(&p.req).chain(&p.more).collect();
    let got: Vec<(Prompt, u64)> = all.iter().map(|r| (r.prompt.clone(), r.sampling.seed)).collect();
    let (a, b) = (Prompt::Text("a".into()), Prompt::Text("b".into()));
    assert_eq!(got, vec![(a.clone(), 7), (a, 8), (b.clone(), 7), (b, 8)]);
    let p = cmpl(json!({"prompt": [[1, 2], [3]]})).ok().unwrap();
    assert_eq!((p.req.prompt, p.more[0].prompt.clone()), (Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])));
    for (v, says) in [
        (json!({"prompt": "a", "n": 0}), "n = 0"),
        (json!({"prompt": ["a", "b"], "n": 600}), "at most 1024 choices"),
        (json!({"prompt": "x".repeat(1 << 20), "n": 100}), "104857600 bytes of prompts over 100 choices"),
    ] {
        assert!(cmpl(v.clone()).err().unwrap().0.contains(says), "{v}");
    }
    let chat = |v: Value| chat_request(serde_json::from_value(v).unwrap(), Instant::now(), &Default::default());
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let p = chat(json!({"messages": msgs, "n": 3, "seed": 5})).ok().unwrap();
    let seeds: Vec<u64> = std::iter::once(&p.req).chain(&p.more).map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, vec![5, 6, 7]);
    assert!(p.more.iter().all(|r| r.prompt == p.req.prompt));
    assert_eq!(chat(json!({"messages": msgs, "n": 2, "stream": true})).ok().unwrap().more.len(), 1);
    let big = json!([{"role": "user", "content": "x".repeat(1 << 20)}]);
    assert!(chat(json!({"messages": big, "n": 100})).err().unwrap().0.contains("bytes of prompts"));
    let r: LlamaCompletionRequest = serde_json::from_value(json!({"prompt": ["a", "b"]})).unwrap();
    assert!(llama_completion_request(r, Instant::now(), &Default::default()).err().unwrap().0.contains("prompt"));
    let many: Vec<String> = (0..17).map(|i| i.to_string()).collect();
    let r: LlamaCompletionRequest = serde_json::from_value(json!({"prompt": "a", "stop": many})).unwrap();
    assert!(llama_completion_request(r, Instant::now(), &Default::default()).err().unwrap().0.contains("stop"));
    // tools, tool_choice and output constraints
    let chat = |extra: Value| {
        let mut v = json!({"messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"type": "function", "function": {"name": "f"}}]});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        chat_request(serde_json::from_value(v).unwrap(), Instant::now(), &Default::default())
    };
    let err = |extra: Value| chat(extra).err().unwrap().0;
    assert!(err(json!({"tool_choice": {"type": "function", "function": {"name": "g"}}})).contains("\"g\""));
    assert!(err(json!({"tool_choice": "sometimes"})).contains("tool_choice"));
    assert!(err(json!({"tools": [{"type": "function"}]})).contains("function.name"));
    assert!(err(json!({"response_format": {"type": "xml"}})).contains("response_format"));
    assert!(err(json!({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""})).contains("one of"));
    let ok = chat(json!({"tool_choice": {"type": "function", "function": {"name": "f"}}})).ok().unwrap();
    assert!(ok.tools && ok.req.special_text);
    let Prompt::Messages { tools, .. } = &ok.req.prompt else { panic!("{:?}", ok.req.prompt) };
    // templates get a description and parameters even when the client sent none
    assert_eq!(tools[0]["function"]["description"], "");
    assert_eq!(tools[0]["function"]["parameters"]["type"], "object");
    let forced = |c: &Option<Constraint>| match c {
        Some(Constraint::ToolCall { tools, name, parallel }) => Some((tools.len(), name.clone(), *parallel)),
        _ => None,
    };
    assert_eq!(forced(&ok.req.constraint), Some((1, Some("f".into()), false)));
    let required = chat(json!({"tool_choice": "required", "parallel_tool_calls": true})).ok().unwrap();
    assert_eq!(forced(&required.req.constraint), Some((1, None, true)));
    assert_eq!(forced(&chat(json!({"tool_choice": "auto"})).ok().unwrap().req.constraint), None);
    assert!(err(json!({"tool_choice": "required", "response_format": {"type": "json_object"}}))
        .contains("cannot be combined"));
    assert!(err(json!({"tool_choice": "required", "tools": []})).contains("needs tools"));
    let none = chat(json!({"tool_choice": "none"})).ok().unwrap();
    assert!(!none.tools && matches!(none.req.prompt, Prompt::Chat(_)));
}

#[test]
fn llama_server_fields_map_onto_the_request() {
    let r: LlamaCompletionRequest = serde_json::from_str(
        r#"{"prompt":[1,2,3],"n_predict":-1,"top_k":0,"min_p":0.1,"cache_prompt":true,"stop":["\n"]}"#,
    )
    .unwrap();
    let req = llama_completion_request(r, Instant::now(), &Default::default()).ok().unwrap();
    assert_eq!(req.prompt, Prompt::Tokens(vec![1, 2, 3]));
    assert_eq!((req.max_tokens, req.sampling.top_k, req.sampling.min_p), (0, 0, 0.1));
    let last_n = |v: i64| {
        let r: LlamaCompletionRequest =
            serde_json::from_value(serde_json::json!({"prompt": "a", "repeat_last_n": v})).unwrap();
        llama_completion_request(r, Instant::now(), &Default::default())
            .map(|r| r.sampling.penalty_last_n)
            .map_err(|e| e.0)
    };
    assert_eq!(last_n(-1), Ok(usize::MAX), "llama-server's -1: the whole context");
    // no seed (or -1): a new one each request, as llama-server; a given one is kept
    let seed_of = |v: Value| {
        let r: LlamaCompletionRequest = serde_json::from_value(v).unwrap();
        llama_completion_request(r, Instant::now(), &Default::default()).map_err(|e| e.0).unwrap().sampling.seed
    };
    let none = serde_json::json!({"prompt": "a"});
    assert_ne!(seed_of(none.clone()), seed_of(none));
    assert_ne!(
        seed_of(serde_json::json!({"prompt": "a", "seed": -1})),
        seed_of(serde_json::json!({"prompt": "a", "seed": -1}))
    );
    assert_eq!(seed_of(serde_json::json!({"prompt": "a", "seed": 5})), 5);
    assert_eq!(last_n(0), Ok(0));
    assert_eq!(last_n(32), Ok(32));
    assert!(last_n(-2).unwrap_err().contains("repeat_last_n -2"));
}

#[test]
fn the_servers_sampling_flags_fill_what_a_request_leaves_out() {
    let d = SamplingDefaults {
        params: SamplingParams { temperature: 0.6, min_p: 0.01, top_k: 0, ..SamplingParams::default() },
        seed: Some(3407),
    };
    let chat = |v: Value| chat_request(serde_json::from_value(v).unwrap(), Instant::now(), &d).ok().unwrap().req;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let bare = chat(json!({"messages": msgs}));
    assert_eq!(bare.sampling, SamplingParams { seed: 3407, ..d.params.clone() });
    let own = chat(json!({"messages": msgs, "temperature": 0.2, "seed": 9}));
    assert_eq!((own.sampling.temperature, own.sampling.min_p, own.sampling.seed), (0.2, 0.01, 9));
    // -1 asks for a new seed, whatever the server's
    assert_ne!(chat(json!({"messages": msgs, "seed": -1})).sampling.seed, 3407);
    let llama =
        |v: Value| llama_completion_request(serde_json::from_value(v).unwrap(), Instant::now(), &d).ok().unwrap();
    let bare = llama(json!({"prompt": "a"}));
    assert_eq!(bare.sampling, SamplingParams { seed: 3407, ..d.params.clone() });
    assert_eq!(llama(json!({"prompt": "a", "top_k": 5, "min_p": 0.2})).sampling.top_k, 5);
}

#[test]
fn logit_bias_is_read_in_openais_and_llama_servers_forms() {
    let d = SamplingDefaults {
        params: SamplingParams { logit_bias: vec![(7, 2.0)], ..SamplingParams::default() },
        seed: None,
    };
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let chat = |extra: Value| {
        let mut v = json!({"messages": msgs});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        chat_request(serde_json::from_value(v).unwrap(), Instant::now(), &d).map(|p| p.req).map_err(|e| e.0)
    };
    // none given: the server's; given, even empty, replaces it
    assert_eq!(chat(json!({})).unwrap().sampling.logit_bias, vec![(7, 2.0)]);
    assert_eq!(chat(json!({"logit_bias": {}})).unwrap().sampling.logit_bias, vec![]);
    let r = chat(json!({"logit_bias": {"15043": -100, "2": false, " Hello": 1.5}})).unwrap();
    assert_eq!(r.sampling.logit_bias, vec![(15043, -100.0), (2, f32::NEG_INFINITY)]);
    assert_eq!(r.logit_bias_text, vec![(" Hello".to_string(), 1.5)]);
    let r =
        chat(json!({"logit_bias": [[15043, 1], ["x", false]], "repeat_penalty": 1.2, "repeat_last_n": -1})).unwrap();
    assert_eq!(r.sampling.logit_bias, vec![(15043, 1.0)]);
    assert_eq!(r.logit_bias_text, vec![("x".to_string(), f32::NEG_INFINITY)]);
    assert_eq!((r.sampling.repeat_penalty, r.sampling.penalty_last_n), (1.2, usize::MAX));
    for bad in [json!({"5": true}), json!({"5": "1"}), json!([[5]]), json!([[-5, 1]]), json!([5, 1]), json!("5")] {
        let e = chat(json!({"logit_bias": bad})).err().unwrap();
        assert!(e.starts_with("logit_bias: "), "{bad}: {e}");
    }
    let llama = llama_completion_request(
        serde_json::from_value(json!({"prompt": "a", "logit_bias": [[3, -1.5]]})).unwrap(),
        Instant::now(),
        &d,
    )
    .ok()
    .unwrap();
    assert_eq!(llama.sampling.logit_bias, vec![(3, -1.5)]);
}
