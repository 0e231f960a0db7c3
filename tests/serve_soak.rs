//! A soak of `tandem serve`: 2,000 requests, valid and hostile mixed, 8 at a time, against the
//! binary, after a warm-up (every slot at its full context, then 1,000 requests of the same mix).
//! Afterwards the server still serves, its anonymous RSS grew by less than 8% over the level
//! after the warm-up (~330 KiB of ~4 MiB: a leak of 170 bytes per request or more), and SIGTERM
//! still ends it with exit code 0. The RSS moves in allocator steps with no trend: 13 runs on one
//! machine ended +2.6% to +5.4% above the warm-up level, so the bound once at 5% failed by chance.
//! TANDEM_SOAK_REQUESTS overrides the count.

mod serve_util;

use serve_util::{drain_stream, endless, greedy, Client, Streamed, PROMPTS};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tandem_server::pb;
use tonic::Code;

const CONCURRENCY: usize = 8;
const UNICODE_VARIANTS: usize = 50;
/// Requests before the first measurement: allocator arenas, per-thread regex caches and h2
/// buffers grow to their working size over the first thousand or so, then stay.
const WARMUP: usize = 1000;
/// Slots (-np) and context per slot (-c over -np).
const SLOTS: usize = 4;

/// RssAnon of a process, in KiB.
fn rss_anon_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn tokens(ids: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Tokens(pb::TokenIds { ids })),
        ..greedy("", max_tokens)
    }
}

/// A Tokenize call with one of `UNICODE_VARIANTS` texts.
fn unicode_text(i: usize) -> pb::TokenizeRequest {
    let text = "\u{0}\u{ffff} 日本語 ".repeat(i % UNICODE_VARIANTS);
    pb::TokenizeRequest { text, add_special: true, parse_special: true }
}

/// Request `i` of the soak: which kind it is follows from `i`. Returns what must hold of it.
async fn one(c: &mut Client, addr: &str, i: usize) {
    let bad = |r: Result<tonic::Response<tonic::Streaming<pb::GenerateResponse>>, tonic::Status>, code: Code| {
        let st = r.map(|_| ()).expect_err("a hostile request was accepted");
        assert_eq!(st.code(), code, "request {i}: {st:?}");
    };
    match i % 16 {
        0..=5 => {
            let mut r = greedy(PROMPTS[i % 4], 1 + (i % 4) as u32);
            r.sampling.as_mut().unwrap().temperature = Some(if i.is_multiple_of(2) { 0.0 } else { 0.9 });
            r.sampling.as_mut().unwrap().seed = Some(i as u64);
            let out = serve_util::generate(c, r).await.unwrap();
            assert!(out.finish.is_some(), "request {i}: {out:?}");
        }
        6 => bad(c.generate(greedy("", 1)).await, Code::InvalidArgument),
        7 => {
            let mut r = greedy("x", 1);
            r.sampling.as_mut().unwrap().temperature = Some(f32::NAN);
            bad(c.generate(r).await, Code::InvalidArgument);
        }
        8 => bad(c.generate(tokens(vec![1, u32::MAX], 1)).await, Code::InvalidArgument),
        9 => bad(c.generate(tokens(vec![9; 5000], 1)).await, Code::InvalidArgument),
        10 => {
            // a client that leaves after the first token, closing its connection
            let mut own = Client::connect(format!("http://{addr}")).await.unwrap();
            let mut s = own.generate(endless(PROMPTS[1], 0)).await.unwrap().into_inner();
            let _ = s.message().await;
        }
        11 => {
            // a connection of its own: an h2 client that sees many of its calls time out (and
            // resets them) ends its connection with ENHANCE_YOUR_CALM after a thousand or so
            let mut own = Client::connect(format!("http://{addr}")).await.unwrap();
            let c = &mut own;
            let mut r = tonic::Request::new(endless(PROMPTS[2], 0));
            r.set_timeout(Duration::from_millis(1 + (i % 20) as u64));
            if let Ok(s) = c.generate(r).await {
                let out = drain_stream(s.into_inner(), Streamed::default()).await;
                assert_eq!(out.status.map(|s| s.code()), Some(Code::DeadlineExceeded), "request {i}");
            }
        }
        12 => {
            let found = c.abort(pb::AbortRequest { request_id: format!("nobody-{i}") }).await.unwrap();
            assert!(!found.into_inner().found);
        }
        13 => {
            let st = c.detokenize(pb::DetokenizeRequest { ids: vec![u32::MAX; 3], special: true }).await.unwrap_err();
            assert_eq!(st.code(), Code::InvalidArgument);
            let r = pb::TokenizeRequest {
                text: "\u{0}\u{ffff} 日本語 ".repeat(i % 50),
                add_special: true,
                parse_special: true,
            };
            c.tokenize(r).await.unwrap();
        }
        14 => {
            let chat = pb::ChatRequest { messages: vec![], ..Default::default() };
            assert_eq!(c.chat(chat).await.map(|_| ()).unwrap_err().code(), Code::InvalidArgument);
            let mut r = greedy(PROMPTS[3], 2);
            r.options.as_mut().unwrap().stop = vec!["x".repeat(10_000)];
            bad(c.generate(r).await, Code::InvalidArgument);
        }
        _ => {
            let mut r = greedy(PROMPTS[0], 3);
            r.options.as_mut().unwrap().logprobs = 5;
            r.options.as_mut().unwrap().stop = vec![" ".into(), "e".into(), String::new()];
            let out = serve_util::generate(c, r).await.unwrap();
            assert!(out.finish.is_some(), "request {i}: {out:?}");
        }
    }
}

async fn run_batch(client: &Client, addr: &str, range: std::ops::Range<usize>) {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(range.start));
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (mut c, next, end, addr) = (client.clone(), next.clone(), range.end, addr.to_string());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= end {
                        break;
                    }
                    one(&mut c, &addr, i).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_mixed_requests_leave_the_server_serving_without_growing() {
    let n: usize = std::env::var("TANDEM_SOAK_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let model = serve_util::fixture("llama-tiny.gguf").display().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "serve",
            "-m",
            &model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--http-port",
            "0",
            "-np",
            "4",
            "-c",
            "1024",
        ])
        .args(["--queue-size", "64", "-t", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines().map_while(Result::ok);
    let addr =
        lines.by_ref().find_map(|l| l.split("gRPC on ").nth(1).map(|r| r.split(' ').next().unwrap().to_string()));
    let addr = addr.expect("tandem serve printed no address");
    lines.by_ref().find(|l| l.contains("SERVING")).expect("tandem serve never became ready");
    std::thread::spawn(move || lines.for_each(drop)); // keep stderr flowing
    let client = Client::connect(format!("http://{addr}")).await.unwrap();

    let start = Instant::now();
    // warm-up: every slot's KV cache once at its full context (a cache keeps its capacity and is
    // bounded by -c), then a first share of the mix
    let fill: Vec<_> = (0..SLOTS)
        .map(|k| {
            let mut c = client.clone();
            tokio::spawn(async move { serve_util::generate(&mut c, endless(PROMPTS[k], 0)).await.unwrap() })
        })
        .collect();
    for f in fill {
        assert_eq!(f.await.unwrap().finish().length_limit(), pb::LengthLimit::Context);
    }
    // each tokenizing thread meets each text once: their regex caches grow to the inputs' needs
    let warm: Vec<_> = (0..CONCURRENCY)
        .map(|k| {
            let mut c = client.clone();
            tokio::spawn(async move {
                for i in 0..UNICODE_VARIANTS {
                    c.tokenize(unicode_text(i + k)).await.unwrap();
                }
            })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }
    run_batch(&client, &addr, 0..WARMUP).await;
    let before = rss_anon_kib(child.id());
    let mut at = WARMUP;
    while at < WARMUP + n {
        let end = (at + 500).min(WARMUP + n);
        run_batch(&client, &addr, at..end).await;
        println!("soak: {} of {n} requests: RssAnon {} KiB", end - WARMUP, rss_anon_kib(child.id()));
        at = end;
    }
    let after = rss_anon_kib(child.id());
    let growth = (after as f64 - before as f64) / before as f64 * 100.0;
    println!(
        "soak: {WARMUP} + {n} requests in {:.1} s; RssAnon {before} KiB after the warm-up, {after} KiB at the end ({growth:+.2}%)",
        start.elapsed().as_secs_f64()
    );
    assert!(growth < 8.0, "anonymous RSS grew {growth:.2}% ({before} -> {after} KiB)");

    let mut c = client.clone();
    let out = serve_util::generate(&mut c, greedy(PROMPTS[0], 2)).await.unwrap();
    assert_eq!(out.ids.len(), 2, "the server still serves");
    // SAFETY: kill(2) with the pid of the child this test started and still owns.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(child.wait().unwrap().code(), Some(0));
}
