//! Anthropic's Messages API of `tandem serve` (`/v1/messages`, `/v1/messages/count_tokens`) end
//! to end, in process, with the official `anthropic` package and a hyper client.

mod serve_util;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use serve_util::{python_script, start};
use tandem_engine::EngineConfig;
use tokio::net::{TcpListener, TcpStream};

/// Anthropic's Messages API through the official `anthropic` package
/// (scripts/anthropic_client_check.py): text whole and streamed, a forced tool call as a
/// `tool_use` block, a tool result sent back, count_tokens, errors in Anthropic's shape; and the
/// key in `x-api-key`, as Anthropic's clients send it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_work_with_the_anthropic_package() {
    let python = std::env::var("TANDEM_HTTP_PYTHON").expect(
        "TANDEM_HTTP_PYTHON is not set: run scripts/test.sh, which installs anthropic into .test-venv and sets it",
    );
    let hermes = tandem_tokenizer::resolve_template_arg("hermes").unwrap();
    let mut s =
        start("llama-tiny.gguf", 2048, EngineConfig { chat_template: Some(hermes), ..EngineConfig::default() }).await;
    let addr = s.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let base = format!("http://{addr}");
    let stdout = python_script(python, "anthropic_client_check.py", &["--base-url", &base]).await;
    assert!(stdout.contains("round trip") && stdout.ends_with("OK\n"), "{stdout}");
    println!("{stdout}");
    drop(s);

    let options = tandem_server::Options { api_keys: vec!["k1".into()], ..Default::default() };
    let mut t = serve_util::start_with("llama-tiny.gguf", 256, EngineConfig::default(), options).await;
    let addr = t.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let body = json!({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).to_string();
    for (key, want) in [("k1", StatusCode::OK), ("k2", StatusCode::UNAUTHORIZED)] {
        let req = hyper::Request::post(format!("http://{addr}/v1/messages"))
            .header("content-type", "application/json")
            .header("x-api-key", key)
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(conn);
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status();
        let v: Value = serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(status, want, "{key}: {v}");
        if want == StatusCode::OK {
            assert_eq!((v["type"].as_str(), v["usage"]["output_tokens"].as_u64()), (Some("message"), Some(2)), "{v}");
        } else {
            assert_eq!(v["error"]["type"], "authentication_error", "{v}");
        }
    }
}
