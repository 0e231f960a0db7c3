//! `tandem serve -hf OWNER/REPO:QUANT` against a local stand-in of the Hugging Face Hub (its URL
//! layout: `/api/models/OWNER/REPO` lists the files, `/OWNER/REPO/resolve/main/FILE` serves them,
//! with range requests): it picks the split Q4_K_M fixture's three shards out of the listing,
//! downloads them into LLAMA_CACHE, resumes the one whose first transfer the stand-in cuts half
//! way, and serves the model; a second start finds them cached.

mod serve_util;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serve_util::process::Served;
use serve_util::{first_token, greedy};
use std::sync::{Arc, Mutex};

const REPO: &str = "tandem/tiny-GGUF";

#[derive(Default)]
struct Hub {
    /// (file, Range header) of every download request.
    requests: Mutex<Vec<(String, Option<String>)>>,
    /// Whether the cut has been made.
    cut: Mutex<bool>,
}

fn shard(file: &str) -> Option<Vec<u8>> {
    let n = file.strip_prefix("tiny-Q4_K_M-0000")?.chars().next()?;
    std::fs::read(serve_util::fixture(&format!("split-tiny-0000{n}-of-00003.gguf"))).ok()
}

async fn list(Path((owner, repo)): Path<(String, String)>) -> Response {
    if format!("{owner}/{repo}") != REPO {
        return StatusCode::NOT_FOUND.into_response();
    }
    let files = [
        "README.md",
        "tiny-Q8_0.gguf",
        "tiny-Q4_K_M-00001-of-00003.gguf",
        "tiny-Q4_K_M-00002-of-00003.gguf",
        "tiny-Q4_K_M-00003-of-00003.gguf",
    ];
    let siblings: Vec<_> = files.iter().map(|f| serde_json::json!({"rfilename": f})).collect();
    axum::Json(serde_json::json!({"id": REPO, "siblings": siblings})).into_response()
}

async fn resolve(
    State(hub): State<Arc<Hub>>,
    Path((_owner, _repo, file)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let range = headers.get("range").and_then(|v| v.to_str().ok()).map(String::from);
    hub.requests.lock().unwrap().push((file.clone(), range.clone()));
    let Some(bytes) = shard(&file) else { return StatusCode::NOT_FOUND.into_response() };
    let len = bytes.len();
    if let Some(r) = range {
        let from: usize = r.trim_start_matches("bytes=").trim_end_matches('-').parse().unwrap();
        let body = bytes[from..].to_vec();
        return Response::builder()
            .status(StatusCode::PARTIAL_CONTENT)
            .header("content-range", format!("bytes {from}-{}/{len}", len - 1))
            .header("content-length", body.len())
            .body(Body::from(body))
            .unwrap();
    }
    let mut cut = hub.cut.lock().unwrap();
    if file.contains("00002") && !*cut {
        // the first transfer of shard 2 stops half way: the connection breaks
        *cut = true;
        let half = bytes[..len / 2].to_vec();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(2);
        tokio::spawn(async move {
            let _ = tx.send(Ok(half)).await;
            // the half reaches the client before the connection breaks
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let _ = tx.send(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut"))).await;
        });
        return Response::builder()
            .header("content-length", len)
            .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
            .unwrap();
    }
    Response::builder().header("content-length", len).body(Body::from(bytes)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_downloads_a_split_model_resumes_a_cut_and_serves_it() {
    let hub = Arc::new(Hub::default());
    let app = Router::new()
        .route("/api/models/{owner}/{repo}", get(list))
        .route("/{owner}/{repo}/resolve/main/{file}", get(resolve))
        .with_state(hub.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let cache = tempfile::tempdir().unwrap();
    let env = [("HF_ENDPOINT", endpoint.as_str()), ("LLAMA_CACHE", cache.path().to_str().unwrap())];
    let args = ["-hf", "tandem/tiny-GGUF:Q4_K_M", "-c", "256", "-t", "1"];
    let mut s = tokio::task::block_in_place(|| Served::start_with_env(&args, &env));
    let mut client = s.client().await;
    let (_, first) = first_token(&mut client, greedy("Hello", 2)).await;
    assert_eq!(first.token_ids.len(), 1);
    let requests = hub.requests.lock().unwrap().clone();
    println!("requests: {requests:?}");
    let shard2: Vec<_> = requests.iter().filter(|(f, _)| f.contains("00002")).collect();
    assert_eq!(shard2.len(), 2, "{requests:?}");
    let half = std::fs::metadata(serve_util::fixture("split-tiny-00002-of-00003.gguf")).unwrap().len() / 2;
    assert_eq!(shard2[1].1.as_deref(), Some(format!("bytes={half}-").as_str()), "{requests:?}");
    assert!(s.log.iter().any(|l| l.contains("resuming at byte")), "{:?}", s.log);
    for n in 1..=3 {
        let got =
            std::fs::read(cache.path().join(format!("tandem_tiny-GGUF_tiny-Q4_K_M-0000{n}-of-00003.gguf"))).unwrap();
        let want = std::fs::read(serve_util::fixture(&format!("split-tiny-0000{n}-of-00003.gguf"))).unwrap();
        assert!(got == want, "shard {n} differs");
    }
    s.signal(libc::SIGTERM);
    s.wait_for("stopped");
    assert_eq!(s.exit_code(), 0);

    // cached: no download the second time
    let before = hub.requests.lock().unwrap().len();
    let mut s = tokio::task::block_in_place(|| Served::start_with_env(&args, &env));
    assert_eq!(hub.requests.lock().unwrap().len(), before);
    assert!(s.log.iter().any(|l| l.contains("(cached)")), "{:?}", s.log);
    s.signal(libc::SIGTERM);
    s.wait_for("stopped");
    assert_eq!(s.exit_code(), 0);

    // `tandem run -hf` as llama-cli takes it, from the cache; without -m or -hf, a clear error
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).envs(env.iter().copied()).output().unwrap()
    };
    let out = tokio::task::block_in_place(|| {
        run(&["run", "-hf", "tandem/tiny-GGUF:Q4_K_M", "-p", "Hello", "-n", "2", "-t", "1"])
    });
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(hub.requests.lock().unwrap().len(), before);
    let out = tokio::task::block_in_place(|| run(&["run", "-p", "Hello"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--model"), "{err}");
}
