//! `tandem serve` under hostile clients, in process: API keys on every call but health (HTTP
//! 401, gRPC UNAUTHENTICATED) and Abort scoped to the key that made a request (10,000 blind
//! Aborts cancel nothing), malformed bytes as client errors (invalid UTF-8 in gRPC, a body that
//! is not JSON, a bad n_predict), connections that send nothing or crawl (closed within the
//! header timeout), a flood of idle connections past the cap (health still answers at once), and
//! TLS on the HTTP port. The figures are printed (`--nocapture`).

mod serve_util;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use serve_util::{endless, first_token, raise_open_file_limit, start_with, TestServer, PROMPTS};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_engine::EngineConfig;
use tandem_server::{pb, Limits, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const KEYS: [&str; 2] = ["key-of-alice", "key-of-bob"];

struct Served {
    t: TestServer,
    http: SocketAddr,
}

async fn serve(options: Options, config: EngineConfig) -> Served {
    serve_ctx(options, config, 2048).await
}

async fn serve_ctx(options: Options, config: EngineConfig, n_ctx: usize) -> Served {
    let mut t = start_with("llama-tiny.gguf", n_ctx, config, options).await;
    let http = t.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    Served { t, http }
}

/// One HTTP/1.1 request on a fresh connection: status and body.
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, String) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req = hyper::Request::builder().method(method).uri(path).header("host", addr.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = sender.send_request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

const JSON: (&str, &str) = ("content-type", "application/json");

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// A gRPC client whose every call carries `key` (if any).
async fn client_with_key(
    addr: SocketAddr,
    key: Option<&str>,
) -> pb::inference_service_client::InferenceServiceClient<
    tonic::service::interceptor::InterceptedService<Channel, impl tonic::service::Interceptor>,
> {
    let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let value: Option<MetadataValue<_>> = key.map(|k| bearer(k).parse().unwrap());
    pb::inference_service_client::InferenceServiceClient::with_interceptor(
        channel,
        move |mut req: tonic::Request<()>| {
            if let Some(v) = &value {
                req.metadata_mut().insert("authorization", v.clone());
            }
            Ok(req)
        },
    )
}

async fn grpc_health(addr: SocketAddr) -> Result<i32, tonic::Status> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let r = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await?;
    Ok(r.into_inner().status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_every_call_but_health_and_scope_aborts() {
    let options = Options { api_keys: KEYS.iter().map(|k| k.to_string()).collect(), ..Options::default() };
    // slots long enough that the two streams below outlast 10,000 Aborts
    let s = serve_ctx(options, EngineConfig { n_parallel: 2, ..EngineConfig::default() }, 65536).await;
    let alice = bearer(KEYS[0]);
    // HTTP: health is open, the rest needs a key
    assert_eq!(http(s.http, "GET", "/health", &[], "").await.0, StatusCode::OK);
    for (headers, want) in [
        (vec![], StatusCode::UNAUTHORIZED),
        (vec![("authorization", "Bearer key-of-alic")], StatusCode::UNAUTHORIZED),
        (vec![("authorization", "Bearer key-of-alice ")], StatusCode::OK),
        (vec![("authorization", alice.as_str())], StatusCode::OK),
    ] {
        let (status, body) = http(s.http, "GET", "/v1/models", &headers, "").await;
        assert_eq!(status, want, "{headers:?}: {body}");
        if want == StatusCode::UNAUTHORIZED {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["type"], "authentication_error", "{body}");
        }
    }
    let completion = r#"{"prompt": "Hello", "n_predict": 2}"#;
    assert_eq!(http(s.http, "POST", "/completion", &[JSON], completion).await.0, StatusCode::UNAUTHORIZED);
    let (status, body) = http(s.http, "POST", "/completion", &[JSON, ("authorization", &alice)], completion).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let metrics = s.t.server.metrics_addr().unwrap();
    assert_eq!(http(metrics, "GET", "/metrics", &[], "").await.0, StatusCode::UNAUTHORIZED);
    let (status, text) = http(metrics, "GET", "/metrics", &[("authorization", &alice)], "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("tandem_connections_open{port=\"http\"}"), "{text}");

    // gRPC: health is open, the rest needs a key
    let addr = s.t.server.local_addr();
    assert_eq!(grpc_health(addr).await.unwrap(), 1);
    let mut nobody = client_with_key(addr, None).await;
    let st = nobody.get_model_info(pb::GetModelInfoRequest {}).await.unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    let st = nobody.abort(pb::AbortRequest { request_id: "x".into() }).await.unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    let mut a = client_with_key(addr, Some(KEYS[0])).await;
    let mut b = client_with_key(addr, Some(KEYS[1])).await;
    a.get_model_info(pb::GetModelInfoRequest {}).await.unwrap();

    // Alice's stream, under an id she chose and one the server made; Bob cannot abort either
    let mut mine = endless(PROMPTS[0], 0);
    mine.request_id = "alice-1".into();
    let mut stream = a.generate(mine).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.request_id, "alice-1");
    let mut other = a.generate(endless(PROMPTS[1], 0)).await.unwrap().into_inner();
    let server_id = other.message().await.unwrap().unwrap().request_id;
    assert!(server_id.starts_with("req-") && server_id.len() == 36, "{server_id}");
    let started = Instant::now();
    let mut found = 0;
    for i in 0..10_000u32 {
        let guess = match i {
            0 => "alice-1".to_string(),
            1 => server_id.clone(),
            _ => format!("req-{:032x}", u128::from(i) * 0x9E37_79B9_7F4A_7C15),
        };
        found += u32::from(b.abort(pb::AbortRequest { request_id: guess }).await.unwrap().into_inner().found);
    }
    println!("10000 Aborts with another key in {:.2} s: {found} found", started.elapsed().as_secs_f64());
    assert_eq!(found, 0);
    // both streams still run
    assert_eq!(s.t.engine.handle().pending(), 2);
    assert_eq!(s.t.engine.handle().stats().requests_cancelled.get(), 0);
    // Alice can
    assert!(a.abort(pb::AbortRequest { request_id: "alice-1".into() }).await.unwrap().into_inner().found);
    assert!(a.abort(pb::AbortRequest { request_id: server_id }).await.unwrap().into_inner().found);
    for s in [&mut stream, &mut other] {
        let mut last = None;
        while let Some(m) = s.message().await.unwrap() {
            last = m.finish;
        }
        assert_eq!(last.map(|f| f.reason), Some(pb::FinishReason::Cancelled as i32));
    }
}

/// The proto's TokenizeRequest with `text` as bytes, to send what a string field may not hold.
#[derive(Clone, PartialEq, prost::Message)]
struct RawTokenizeRequest {
    #[prost(bytes = "vec", tag = "1")]
    text: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_the_clients_fault() {
    let s = serve(Options::default(), EngineConfig::default()).await;
    // invalid UTF-8 in a gRPC string: INVALID_ARGUMENT, not INTERNAL
    let channel = Channel::from_shared(format!("http://{}", s.t.server.local_addr())).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<RawTokenizeRequest, pb::TokenizeResponse>::default();
    let path = "/tandem.v1.InferenceService/Tokenize".parse().unwrap();
    let req = tonic::Request::new(RawTokenizeRequest { text: b"ok \xff\xfe bytes".to_vec() });
    let st = grpc.unary(req, path, codec).await.unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument, "{st:?}");
    assert!(st.message().contains("malformed request"), "{st:?}");

    // HTTP bodies that do not say they are JSON: 415
    let body = r#"{"prompt": "Hello", "n_predict": 2}"#;
    for headers in
        [vec![], vec![("content-type", "text/plain")], vec![("content-type", "application/x-www-form-urlencoded")]]
    {
        let (status, text) = http(s.http, "POST", "/completion", &headers, body).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{headers:?}: {text}");
        assert!(text.contains("application/json"), "{text}");
    }
    let json_utf8 = [("content-type", "application/json; charset=utf-8")];
    assert_eq!(http(s.http, "POST", "/completion", &json_utf8, body).await.0, StatusCode::OK);
    // n_predict: -1 is "no limit", other negatives and 0 are mistakes
    for (n, want) in [(-2, StatusCode::BAD_REQUEST), (0, StatusCode::BAD_REQUEST), (-1, StatusCode::OK)] {
        let body = format!(r#"{{"prompt": "Hello", "n_predict": {n}}}"#);
        let (status, text) = http(s.http, "POST", "/completion", &[JSON], &body).await;
        assert_eq!(status, want, "n_predict {n}: {text}");
        if want != StatusCode::OK {
            assert!(text.contains("n_predict"), "{text}");
        }
    }
}

/// Reads until the server closes the connection (or `limit` passes): how long that took.
async fn time_to_close(tcp: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(limit.saturating_sub(start.elapsed()), tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => {}
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_crawling_and_idle_connections_are_closed_in_time() {
    let limits = Limits {
        header_timeout: Duration::from_millis(600),
        idle_timeout: Duration::from_millis(1200),
        ..Limits::default()
    };
    let s = serve(Options { limits, ..Options::default() }, EngineConfig::default()).await;
    let grpc = s.t.server.local_addr();
    // silent, on both ports
    for addr in [s.http, grpc] {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let t = time_to_close(&mut tcp, Duration::from_secs(5)).await.expect("a silent connection was never closed");
        println!("silent connection to {addr} closed after {:.2} s", t.as_secs_f64());
        assert!(t >= Duration::from_millis(500) && t < Duration::from_millis(1500), "{t:?}");
    }
    // slowloris: request headers at 5 bytes/s never finish
    let mut tcp = TcpStream::connect(s.http).await.unwrap();
    let start = Instant::now();
    let head = b"POST /completion HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";
    let mut closed = None;
    for chunk in head.chunks(1) {
        if tcp.write_all(chunk).await.is_err() {
            closed = Some(start.elapsed());
            break;
        }
        if let Some(t) = time_to_close(&mut tcp, Duration::from_millis(200)).await {
            closed = Some(start.elapsed() - Duration::from_millis(200) + t);
            break;
        }
    }
    let t = closed.expect("a slowloris connection was never closed");
    println!("slowloris connection (5 bytes/s) closed after {:.2} s", t.as_secs_f64());
    assert!(t < Duration::from_millis(1500), "{t:?}");
    // HTTP/1.1 keep-alive: waiting for the next request's headers is under the header timeout
    let mut tcp = TcpStream::connect(s.http).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tcp.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    let t = time_to_close(&mut tcp, Duration::from_secs(5)).await.expect("an idle connection was never closed");
    println!("idle HTTP/1.1 keep-alive connection closed after {:.2} s", t.as_secs_f64());
    assert!(t >= Duration::from_millis(500) && t < Duration::from_millis(1500), "{t:?}");
    // HTTP/2 (gRPC's): idle after a request, closed after the idle timeout
    let tcp = TcpStream::connect(grpc).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(tcp)).await.unwrap();
    let conn = tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method("POST")
        .uri(format!("http://{grpc}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.into_body().collect().await.unwrap();
    let idle_from = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), conn).await.expect("an idle HTTP/2 connection was never closed").ok();
    let t = idle_from.elapsed();
    println!("idle HTTP/2 connection closed after {:.2} s", t.as_secs_f64());
    assert!(t >= Duration::from_millis(1000) && t < Duration::from_millis(2500), "{t:?}");
    // a long generation is not idle: it outlives both limits
    let (status, body) = http(
        s.http,
        "POST",
        "/completion",
        &[JSON],
        &format!(r#"{{"prompt": "{}", "n_predict": 400, "ignore_eos": true, "stream": true}}"#, PROMPTS[0]),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#""stop":true"#), "{}", &body[body.len().saturating_sub(300)..]);
    let stats = s.t.server.stats();
    println!("HTTP port: {:?}\ngRPC port: {:?}", stats.http, stats.grpc);
    assert!(stats.grpc.timed_out.load(std::sync::atomic::Ordering::Relaxed) >= 2);
}

/// Connections the test may open: the open-file limit (raised to its maximum) less some room.
fn connection_budget(wanted: usize) -> usize {
    wanted.min(raise_open_file_limit().saturating_sub(512) / 2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_at_once_under_a_flood_of_idle_connections() {
    // in one process each connection costs two descriptors (ours and the server's, until it is
    // evicted); tests/serve_hostile_process (the binary) goes to the limit
    let limits = Limits { max_connections: 256, ..Limits::default() };
    let s = serve(Options { limits, ..Options::default() }, EngineConfig::default()).await;
    let grpc = s.t.server.local_addr();
    let n = connection_budget(std::env::var("TANDEM_FLOOD").ok().and_then(|v| v.parse().ok()).unwrap_or(4000));
    let start = Instant::now();
    let mut idle = Vec::with_capacity(n);
    for i in 0..n {
        let addr = if i % 2 == 0 { s.http } else { grpc };
        match TcpStream::connect(addr).await {
            Ok(t) => idle.push(t),
            Err(e) => panic!("connection {i}: {e}"),
        }
    }
    println!("{n} idle connections opened in {:.2} s", start.elapsed().as_secs_f64());
    let worst = check_health_fast(s.http, grpc, 10).await;
    println!("worst of 10 HTTP + 10 gRPC health checks under the flood: {:.1} ms", worst.as_secs_f64() * 1e3);
    let (h, g) = (&s.t.server.stats().http, &s.t.server.stats().grpc);
    println!("HTTP port: {h:?}\ngRPC port: {g:?}");
    assert!(h.open.load(std::sync::atomic::Ordering::Relaxed) <= 256);
    assert!(h.evicted.load(std::sync::atomic::Ordering::Relaxed) > 0);
    // a generation in flight is never evicted for a newcomer
    let mut client = s.t.client.clone();
    let (mut stream, _) = first_token(&mut client, endless(PROMPTS[0], 300)).await;
    for _ in 0..600 {
        idle.push(TcpStream::connect(grpc).await.unwrap());
    }
    let mut tokens = 1;
    while let Some(m) = stream.message().await.unwrap() {
        tokens += m.token_ids.len();
    }
    assert_eq!(tokens, 300);
}

/// Health over HTTP and gRPC, `rounds` times each, each within a second: the slowest.
async fn check_health_fast(http_addr: SocketAddr, grpc: SocketAddr, rounds: usize) -> Duration {
    let mut worst = Duration::ZERO;
    for _ in 0..rounds {
        let t = Instant::now();
        let (status, _) = tokio::time::timeout(Duration::from_secs(1), http(http_addr, "GET", "/health", &[], ""))
            .await
            .expect("HTTP /health took over 1 s");
        assert_eq!(status, StatusCode::OK);
        worst = worst.max(t.elapsed());
        let t = Instant::now();
        let st =
            tokio::time::timeout(Duration::from_secs(1), grpc_health(grpc)).await.expect("gRPC health took over 1 s");
        assert_eq!(st.unwrap(), 1);
        worst = worst.max(t.elapsed());
    }
    worst
}

/// A self-signed certificate for 127.0.0.1 and localhost, written as PEM into `dir`.
fn self_signed(dir: &std::path::Path) -> (tandem_server::TlsFiles, String) {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let files = tandem_server::TlsFiles { cert: dir.join("cert.pem"), key: dir.join("key.pem") };
    let pem = cert.cert.pem();
    std::fs::write(&files.cert, &pem).unwrap();
    std::fs::write(&files.key, cert.signing_key.serialize_pem()).unwrap();
    (files, pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_answers_with_the_configured_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (files, pem) = self_signed(dir.path());
    let limits = Limits { header_timeout: Duration::from_millis(800), ..Limits::default() };
    let s = serve(Options { tls: Some(files), limits, ..Options::default() }, EngineConfig::default()).await;
    use rustls_pki_types::pem::PemObject;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    roots.add(rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()).unwrap();
    #[allow(deprecated)]
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(s.http).await.unwrap();
    let tls = connector.connect("localhost".try_into().unwrap(), tcp).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method("POST")
        .uri("/completion")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(r#"{"prompt": "Hello", "n_predict": 3, "ignore_eos": true}"#)))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["tokens_predicted"], 3, "{v}");
    // plain HTTP to the TLS port gets nowhere, and the server stays up
    let (mut tcp, _) = (TcpStream::connect(s.http).await.unwrap(), ());
    tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), tcp.read_to_end(&mut buf)).await;
    assert!(!buf.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf));
    let tcp = TcpStream::connect(s.http).await.unwrap();
    assert!(connector.connect("localhost".try_into().unwrap(), tcp).await.is_ok());
}
