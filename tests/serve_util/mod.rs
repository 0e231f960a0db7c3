//! Helpers of the `tandem serve` tests: an in-process server over a tiny fixture model on
//! 127.0.0.1 with a port the system chooses, a real tonic client, and request builders.
#![allow(dead_code)]

pub mod process;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tandem_engine::{Engine, EngineConfig};
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{Context, ContextParams, Exec, Model};
use tandem_server::pb;
use tandem_server::{ModelDescription, RunningServer};
use tandem_tokenizer::Tokenizer;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::Channel;

pub type Client = pb::inference_service_client::InferenceServiceClient<Channel>;

pub const PROMPTS: [&str; 4] = [
    "The quick brown fox",
    "Mixture of experts models route every token",
    "In the beginning there was the word",
    "Language models read text as a sequence of tokens. Each token is a small piece of text",
];

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

pub fn engine(model: &str, n_ctx: usize, config: EngineConfig) -> Engine {
    let gguf = Arc::new(GgufModel::open(fixture(model), LoadOptions::default()).unwrap());
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let model = Arc::new(Model::load(gguf).unwrap());
    let threads = tandem_cpu::Threads::new(1, 1).unwrap();
    let params = ContextParams { n_ctx, ..ContextParams::default() };
    let ctx = Context::new(model, Exec::cpu(threads), params).unwrap();
    Engine::start(ctx, tok, config).unwrap()
}

/// Runs `python scripts/SCRIPT ARGS` off the async runtime's threads and returns what it printed
/// to stdout; fails the test, with its stdout and stderr, when it does not succeed.
pub async fn python_script(python: String, script: &str, args: &[&str]) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts").join(script);
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(python).arg(path).args(args).output())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("running scripts/{script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// The open-file limit, raised first to the most this process may have (tests that open
/// thousands of connections).
pub fn raise_open_file_limit() -> usize {
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur as usize
    }
}

/// A server that is not ready yet (health NOT_SERVING), with metrics.
pub async fn start_unready() -> RunningServer {
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
    tandem_server::start(grpc, Some(metrics)).await.unwrap()
}

pub struct TestServer {
    pub server: RunningServer,
    pub engine: Engine,
    pub client: Client,
}

pub async fn start(model: &str, n_ctx: usize, config: EngineConfig) -> TestServer {
    start_with(model, n_ctx, config, tandem_server::Options::default()).await
}

/// [`start`] with API keys, limits or TLS (the client is plain and carries no key: use it only
/// where the options allow that).
pub async fn start_with(
    model: &str,
    n_ctx: usize,
    config: EngineConfig,
    options: tandem_server::Options,
) -> TestServer {
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = tandem_server::start_with(grpc, Some(metrics), options).await.unwrap();
    let engine = tokio::task::block_in_place(|| engine(model, n_ctx, config));
    let desc = ModelDescription { name: String::new(), demo: false, placement: "all tensors on CPU".into() };
    server.set_ready(engine.handle(), &desc).await;
    let client = connect(&server).await;
    TestServer { server, engine, client }
}

pub async fn connect(server: &RunningServer) -> Client {
    Client::connect(format!("http://{}", server.local_addr())).await.unwrap()
}

pub fn greedy(prompt: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(prompt.into())),
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        options: Some(pb::GenerationOptions { max_tokens, ..Default::default() }),
        ..Default::default()
    }
}

/// A greedy request that generates until `max_tokens` (or the context), never stopping at EOS.
pub fn endless(prompt: &str, max_tokens: u32) -> pb::GenerateRequest {
    let mut r = greedy(prompt, max_tokens);
    if let Some(o) = r.options.as_mut() {
        o.ignore_eos = true;
    }
    r
}

/// What one stream delivered.
#[derive(Debug, Default)]
pub struct Streamed {
    pub ids: Vec<u32>,
    pub text: String,
    pub messages: usize,
    pub finish: Option<pb::Finish>,
    pub status: Option<tonic::Status>,
}

impl Streamed {
    pub fn finish(&self) -> &pb::Finish {
        self.finish.as_ref().unwrap_or_else(|| panic!("no finish: {self:?}"))
    }

    pub fn reason(&self) -> pb::FinishReason {
        pb::FinishReason::try_from(self.finish().reason).unwrap()
    }
}

pub async fn drain_stream(mut s: tonic::Streaming<pb::GenerateResponse>, mut out: Streamed) -> Streamed {
    loop {
        match s.message().await {
            Ok(Some(m)) => {
                out.messages += 1;
                out.ids.extend(&m.token_ids);
                out.text.push_str(&m.text);
                if m.finish.is_some() {
                    out.finish = m.finish;
                }
            }
            Ok(None) => return out,
            Err(st) => {
                out.status = Some(st);
                return out;
            }
        }
    }
}

/// Runs a Generate call to its end.
pub async fn generate(client: &mut Client, req: pb::GenerateRequest) -> Result<Streamed, tonic::Status> {
    let s = client.generate(req).await?.into_inner();
    Ok(drain_stream(s, Streamed::default()).await)
}

/// Starts a Generate call and waits for its first token.
pub async fn first_token(
    client: &mut Client,
    req: pb::GenerateRequest,
) -> (tonic::Streaming<pb::GenerateResponse>, pb::GenerateResponse) {
    let mut s = client.generate(req).await.unwrap().into_inner();
    let m = s.message().await.unwrap().unwrap();
    assert_eq!(m.token_ids.len(), 1, "{m:?}");
    (s, m)
}

/// A plain channel to the server (for the health and reflection clients).
pub async fn channel(server: &RunningServer) -> Channel {
    Channel::from_shared(format!("http://{}", server.local_addr())).unwrap().connect().await.unwrap()
}

/// Sends a request and returns the response with its body still unread.
pub async fn http_send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> hyper::Response<hyper::body::Incoming> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    sender.send_request(req).await.unwrap()
}

pub async fn http_call(addr: SocketAddr, method: &str, path: &str, body: &str) -> (StatusCode, String) {
    let resp = http_send(addr, method, path, body.as_bytes().to_vec()).await;
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}
