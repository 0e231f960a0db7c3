//! The `tandem serve` binary under a flood of idle connections, as many as this process may
//! open (its open-file limit, raised to the hard maximum, less some room; at most
//! TANDEM_FLOOD, 20,000 by default), half to each port: health over HTTP and gRPC still answers
//! within a second, a generation in flight is untouched, and the server says what it evicted.
//! Alone in its test binary, so that no other test competes for the descriptors.

mod serve_util;

use serve_util::process::Served;
use serve_util::{endless, first_token, raise_open_file_limit, PROMPTS};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn descriptor_budget(wanted: usize) -> usize {
    wanted.min(raise_open_file_limit().saturating_sub(300))
}

async fn http_health(addr: &str) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).await.unwrap();
    answer
}

async fn grpc_health(addr: SocketAddr) -> i32 {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner().status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_within_a_second_under_a_flood_of_idle_connections() {
    let wanted = std::env::var("TANDEM_FLOOD").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let n = descriptor_budget(wanted);
    let model = serve_util::fixture("llama-tiny.gguf");
    let mut s = Served::start(&["-m", model.to_str().unwrap(), "-c", "8192", "-t", "1", "--max-connections", "1024"]);
    let http =
        s.log.iter().find_map(|l| l.split("HTTP on http://").nth(1)).unwrap().split(' ').next().unwrap().to_string();
    let mut client = s.client().await;
    let (mut stream, _) = first_token(&mut client, endless(PROMPTS[0], 3000)).await;

    let start = Instant::now();
    let mut idle = Vec::with_capacity(n);
    for i in 0..n {
        let addr = if i % 2 == 0 { http.clone() } else { s.addr.to_string() };
        match TcpStream::connect(&addr).await {
            Ok(t) => idle.push(t),
            Err(e) => panic!("connection {i} of {n}: {e}"),
        }
    }
    let opened = start.elapsed();
    let mut worst = Duration::ZERO;
    for _ in 0..10 {
        let t = Instant::now();
        let answer =
            tokio::time::timeout(Duration::from_secs(1), http_health(&http)).await.expect("HTTP /health took over 1 s");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        worst = worst.max(t.elapsed());
        let t = Instant::now();
        let status =
            tokio::time::timeout(Duration::from_secs(1), grpc_health(s.addr)).await.expect("gRPC health took over 1 s");
        assert_eq!(status, 1);
        worst = worst.max(t.elapsed());
    }
    // the generation went on through it
    let mut tokens = 1;
    while let Some(m) = stream.message().await.unwrap() {
        tokens += m.token_ids.len();
    }
    assert_eq!(tokens, 3000);
    let metrics = format!("{n} idle connections opened in {:.2} s; worst of 10 HTTP + 10 gRPC health checks {:.1} ms; the generation in flight finished its 3000 tokens",
        opened.as_secs_f64(), worst.as_secs_f64() * 1e3);
    println!("{metrics}");
    drop(idle);
    s.signal(libc::SIGTERM);
    s.wait_for("stopped");
    assert_eq!(s.exit_code(), 0);
}
