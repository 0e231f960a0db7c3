//! Slot files (llama-server's `--slot-save-path` and `POST /slots/{id}?action=save|restore|erase`):
//! a sequence's cache written to a file and read back gives the logits of the cache it was saved
//! from, bit for bit, on every fixture architecture and cache type; a file of another model,
//! cache type or context, cut short or damaged, is refused in one line and leaves the sequence
//! as it was; over HTTP a restored slot serves its conversation's next request from the cache.

mod serve_util;

use serde_json::{json, Value};
use serve_util::fixture;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use tandem_model::{Batch, CacheType, Context, ContextParams, Exec, GgufModel, LoadOptions, Model};
use tokio::net::TcpListener;

const MODELS: [&str; 4] =
    ["llama-tiny.gguf", "deepseek2-mla-tiny.gguf", "deepseek2-legacy-tiny.gguf", "deepseek2-mla-tiny-Q4_K_M.gguf"];

fn context(model: &str, n_ctx: usize, cache: CacheType) -> Context {
    let gguf = Arc::new(GgufModel::open(fixture(model), LoadOptions::default()).unwrap());
    let model = Arc::new(Model::load(gguf).unwrap());
    let threads = tandem_cpu::Threads::new(1, 1).unwrap();
    let params = ContextParams { n_ctx, cache_type_k: cache, cache_type_v: cache, ..ContextParams::default() };
    Context::new(model, Exec::cpu(threads), params).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The error of restoring `path` into sequence 2 of `ctx`, which must keep the rows it had.
fn refused(ctx: &mut Context, path: &Path) -> String {
    ctx.truncate(2, 0);
    ctx.decode(&Batch::sequence(&[1, 2], 0, 2, false)).unwrap();
    let e = ctx.restore_sequence(2, path).expect_err("restored").to_string();
    assert_eq!(ctx.seq_len(2), 2, "{e}");
    assert!(!e.contains('\n'), "{e}");
    e
}

#[test]
fn a_restored_sequence_gives_the_logits_of_the_saved_one() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 50 + 1).collect();
    for model in MODELS {
        for cache in [CacheType::F16, CacheType::Q8_0] {
            let what = format!("{model} {cache:?}");
            let path = dir.path().join(format!("{model}-{cache:?}.slot"));
            let mut a = context(model, 128, cache);
            a.decode(&Batch::sequence(&prompt, 0, 0, false)).unwrap();
            let written = a.save_sequence(0, &prompt, &path).unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), written, "{what}");

            // another context (another sequence number) takes it up where `a` stands
            let mut b = context(model, 128, cache);
            let (tokens, read) = b.restore_sequence(3, &path).unwrap();
            assert_eq!((tokens, read, b.seq_len(3)), (prompt.clone(), written, prompt.len()), "{what}");
            let n = prompt.len() as u32;
            for (step, t) in [5u32, 9, 11].into_iter().enumerate() {
                let la = a.decode(&Batch::sequence(&[t], n + step as u32, 0, true)).unwrap();
                let lb = b.decode(&Batch::sequence(&[t], n + step as u32, 3, true)).unwrap();
                assert_eq!(bits(&la), bits(&lb), "{what}, step {step}");
            }

            // what no restore may take
            let other = if cache == CacheType::F16 { CacheType::Q8_0 } else { CacheType::F16 };
            let e = refused(&mut context(model, 128, other), &path);
            assert!(e.contains("KV cache") && e.contains("-ctk"), "{what}: {e}");
            let e = refused(&mut context(model, 16, cache), &path);
            assert!(e.contains("holds 37 positions, the context has 16"), "{what}: {e}");
            let another = MODELS.iter().find(|m| **m != model).unwrap();
            let e = refused(&mut context(another, 128, cache), &path);
            assert!(e.contains("saved from another model"), "{what}: {e}");
        }
    }
}

/// Saves leave only their files behind, a name of the 255 bytes llama-server allows included
/// (its temporary file must fit the same limit).
#[test]
fn saves_leave_only_their_files_whatever_the_name_length() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (1..20).collect();
    let mut a = context(MODELS[0], 64, CacheType::F16);
    a.decode(&Batch::sequence(&prompt, 0, 0, false)).unwrap();
    let long = format!("{}.bin", "k".repeat(251));
    for name in ["a.bin", "a.txt", long.as_str()] {
        let path = dir.path().join(name);
        let written = a.save_sequence(0, &prompt, &path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), written, "{}", name.len());
        let (tokens, _) = context(MODELS[0], 64, CacheType::F16).restore_sequence(0, &path).unwrap();
        assert_eq!(tokens, prompt);
    }
    let mut left: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, ["a.bin", "a.txt", long.as_str()]);
}

#[test]
fn damaged_slot_files_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("good.slot");
    let prompt: Vec<u32> = (1..21).collect();
    let mut ctx = context("deepseek2-mla-tiny.gguf", 64, CacheType::F16);
    ctx.decode(&Batch::sequence(&prompt, 0, 0, false)).unwrap();
    ctx.save_sequence(0, &prompt, &path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let bad = dir.path().join("bad.slot");
    let mut with = |bytes: &[u8]| {
        std::fs::write(&bad, bytes).unwrap();
        refused(&mut ctx, &bad)
    };
    assert!(with(b"").contains("ends inside its header"));
    assert!(with(&good[..good.len() - 1]).contains("its header says"));
    assert!(with(&[&good[..], b"x"].concat()).contains("its header says"));
    assert!(with(&vec![0u8; good.len()]).contains("not a tandem slot file"));
    let mut v = good.clone();
    v[8] = 9; // the version
    assert!(with(&v).contains("format version 9"));
    let mut v = good.clone();
    v[48..52].copy_from_slice(&u32::MAX.to_le_bytes()); // the token count
    assert!(with(&v).contains("the context has 64"));
    let mut v = good.clone();
    v[52..56].copy_from_slice(&100_000u32.to_le_bytes()); // the first token
    assert!(with(&v).contains("beyond the vocabulary"));
    let e = ctx.restore_sequence(2, &dir.path().join("missing.slot")).unwrap_err().to_string();
    assert!(e.contains("missing.slot"), "{e}");

    // a changed byte in the rows (the first, one in the middle, the last layer's checksum): found
    // by its layer's checksum; the rows were being replaced, so the sequence is left empty
    let rows_at = 52 + 4 * prompt.len();
    for at in [rows_at, (rows_at + good.len()) / 2, good.len() - 1] {
        let mut v = good.clone();
        v[at] ^= 0x10;
        std::fs::write(&bad, &v).unwrap();
        ctx.truncate(2, 0);
        ctx.decode(&Batch::sequence(&[1, 2], 0, 2, false)).unwrap();
        let e = ctx.restore_sequence(2, &bad).expect_err("restored").to_string();
        assert!(e.contains("damaged (its checksum") && !e.contains('\n'), "byte {at}: {e}");
        assert_eq!(ctx.seq_len(2), 0, "byte {at}");
    }
    assert_eq!(ctx.restore_sequence(2, &path).unwrap().0, prompt, "the good file still restores");

    // a bit of every header byte changed, and the file cut at every length below its end: refused
    let mut rng = tandem_quant::testing::Rng(5);
    for at in 0..52 {
        let mut v = good.clone();
        v[at] ^= 1 << (rng.next_u64() % 8);
        std::fs::write(&bad, &v).unwrap();
        let e = refused(&mut ctx, &bad);
        assert!(!e.is_empty(), "byte {at}");
        std::fs::write(&bad, &good[..at]).unwrap();
        assert!(ctx.restore_sequence(2, &bad).is_err(), "cut at {at}");
    }
    // the good file still restores after all that
    assert_eq!(ctx.restore_sequence(2, &path).unwrap().0, prompt);
}

/// A server of llama-tiny with `n_parallel` slots and its own `--slot-save-path` directory.
struct SlotServer {
    dir: tempfile::TempDir,
    addr: SocketAddr,
    _t: serve_util::TestServer,
}

async fn slot_server(n_parallel: usize) -> SlotServer {
    let dir = tempfile::tempdir().unwrap();
    let options = tandem_server::Options { slot_save_path: Some(dir.path().to_path_buf()), ..Default::default() };
    let config = tandem_engine::EngineConfig { n_parallel, ..Default::default() };
    let mut t = serve_util::start_with("llama-tiny.gguf", 512, config, options).await;
    let addr = t.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    SlotServer { dir, addr, _t: t }
}

impl SlotServer {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (status, text) = serve_util::http_call(self.addr, "POST", path, &body.to_string()).await;
        (status.as_u16(), serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}")))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_slot_serves_its_conversation_from_the_cache() {
    let s = slot_server(1).await;
    let (addr, dir) = (s.addr, &s.dir);
    let post = |path: &'static str, body: Value| s.post(path, body);
    let complete = |prompt: &str| json!({"prompt": prompt, "n_predict": 8, "temperature": 0, "ignore_eos": true, "cache_prompt": true});
    let conversation = "The first conversation, long enough to be worth keeping in a file";
    let (status, first) = post("/completion", complete(conversation)).await;
    assert_eq!(status, 200, "{first}");

    let (status, saved) = post("/slots/0?action=save", json!({"filename": "conv.bin"})).await;
    assert_eq!(status, 200, "{saved}");
    let n = saved["n_saved"].as_u64().unwrap();
    assert!(n > 8, "{saved}");
    let size = std::fs::metadata(dir.path().join("conv.bin")).unwrap().len();
    assert_eq!((saved["id_slot"].as_u64(), saved["n_written"].as_u64()), (Some(0), Some(size)), "{saved}");
    assert!(saved["timings"]["save_ms"].as_f64().is_some(), "{saved}");

    // another conversation takes the slot, then the cache is erased
    let (status, _) = post("/completion", complete("Something else entirely, about the weather")).await;
    assert_eq!(status, 200);
    let (status, erased) = post("/slots/0?action=erase", json!({})).await;
    assert_eq!(status, 200, "{erased}");
    assert!(erased["n_erased"].as_u64() > Some(0), "{erased}");
    let (status, again) = post("/completion", complete(conversation)).await;
    assert_eq!(status, 200);
    assert_eq!(again["tokens_cached"], 0, "an erased slot caches nothing: {again}");

    let (status, restored) = post("/slots/0?action=restore", json!({"filename": "conv.bin"})).await;
    assert_eq!(status, 200, "{restored}");
    assert_eq!((restored["n_restored"].as_u64(), restored["n_read"].as_u64()), (Some(n), Some(size)), "{restored}");
    let (status, slots) = serve_util::http_call(addr, "GET", "/slots", "").await;
    assert_eq!(status.as_u16(), 200);
    assert_eq!(serde_json::from_str::<Value>(&slots).unwrap()[0]["n_cached_tokens"].as_u64(), Some(n), "{slots}");
    // the same conversation once more: its prompt from the file, the same words
    let (status, resumed) = post("/completion", complete(conversation)).await;
    assert_eq!(status, 200);
    let prompt_tokens = resumed["tokens_evaluated"].as_u64().unwrap();
    assert_eq!(resumed["tokens_cached"].as_u64(), Some(prompt_tokens - 1), "{resumed}");
    assert_eq!(resumed["content"], first["content"], "{resumed}");

    // what is refused, each in one line
    for (path, body, status, says) in [
        ("/slots/0?action=save", json!({"filename": "../escape.bin"}), 400, "Invalid filename"),
        ("/slots/0?action=save", json!({}), 400, "filename"),
        ("/slots/0?action=restore", json!({"filename": "missing.bin"}), 400, "missing.bin"),
        ("/slots/0?action=fly", json!({}), 400, "Invalid action"),
        ("/slots/x?action=erase", json!({}), 400, "Invalid slot ID"),
        ("/slots/7?action=erase", json!({}), 400, "this server has 1 slots"),
    ] {
        let (got, body) = post(path, body).await;
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(got == status && msg.contains(says) && !msg.contains('\n'), "{path}: {got} {body}");
    }
    std::fs::write(dir.path().join("junk.bin"), b"TANDEMKV and then nothing useful").unwrap();
    let (status, body) = post("/slots/0?action=restore", json!({"filename": "junk.bin"})).await;
    assert_eq!(status, 400, "{body}");
    let (status, after) = post("/completion", complete(conversation)).await;
    let kept = after["tokens_evaluated"].as_u64().map(|n| n - 1);
    assert_eq!((status, after["tokens_cached"].as_u64()), (200, kept), "a refused file leaves the cache as it was");
    assert!(!dir.path().parent().unwrap().join("escape.bin").exists());

    // without --slot-save-path: 501, as llama-server
    let mut plain = serve_util::start("llama-tiny.gguf", 256, Default::default()).await;
    let addr = plain.server.serve_http(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let (status, text) = serve_util::http_call(addr, "POST", "/slots/0?action=erase", "{}").await;
    assert_eq!(status.as_u16(), 501, "{text}");
    assert!(text.contains("--slot-save-path"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn id_slot_takes_a_request_to_the_slot_restored_for_it() {
    let s = slot_server(2).await;
    let post = |path: &'static str, body: Value| s.post(path, body);
    let complete =
        |prompt: &str, slot: i64| json!({"prompt": prompt, "n_predict": 4, "temperature": 0, "id_slot": slot});
    let conversation = "An agent's conversation, set aside in a file";
    let (_, first) = post("/completion", complete(conversation, -1)).await;
    let prompt_tokens = first["tokens_evaluated"].as_u64().unwrap();
    assert_eq!(post("/slots/0?action=save", json!({"filename": "a.bin"})).await.0, 200);
    assert_eq!(post("/slots/0?action=erase", json!({})).await.0, 200);
    assert_eq!(post("/slots/1?action=restore", json!({"filename": "a.bin"})).await.0, 200);

    // the conversation goes on, so much longer that the restored share of it is under half: the
    // engine's own choice would be the least recently used slot (0, erased); id_slot 1 finds it
    let longer = format!("{conversation}{}", " and it went on and on about other things".repeat(8));
    let (status, pinned) = post("/completion", complete(&longer, 1)).await;
    let cached = pinned["tokens_cached"].as_u64().unwrap_or(0);
    assert_eq!(status, 200, "{pinned}");
    assert!(cached + 1 >= prompt_tokens && cached < pinned["tokens_evaluated"].as_u64().unwrap(), "{pinned}");
    // without it, another such turn goes to slot 0 and computes everything
    let other = format!("{conversation}{}", " and then the talk turned to the weather again".repeat(8));
    let (status, free) = post("/completion", complete(&other, -1)).await;
    assert_eq!((status, free["tokens_cached"].as_u64()), (200, Some(0)), "{free}");

    let (status, body) = post("/completion", complete(&longer, 2)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap_or_default().contains("this server has 2 slots"), "{body}");
}

/// A slot action sent while the slot generates waits for it, and runs as soon as the request ends
/// by itself (the engine thread does not go to sleep with an action waiting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_action_waits_for_its_slot_to_be_idle() {
    use http_body_util::BodyExt;
    let s = slot_server(1).await;
    let long =
        json!({"prompt": "Once upon a time", "n_predict": 48, "ignore_eos": true, "temperature": 0, "stream": true});
    let resp = serve_util::http_send(s.addr, "POST", "/completion", long.to_string().into_bytes()).await;
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    let addr = s.addr;
    let save = tokio::spawn(async move {
        serve_util::http_call(addr, "POST", "/slots/0?action=save", r#"{"filename": "busy.bin"}"#).await
    });
    body.frame().await.unwrap().unwrap();
    assert!(!save.is_finished(), "saved while the slot was generating");
    while let Some(frame) = body.frame().await {
        frame.unwrap();
    }
    let done = tokio::time::timeout(std::time::Duration::from_secs(60), save).await;
    let (status, text) = done.expect("the save still waits after the request ended").unwrap();
    assert_eq!(status.as_u16(), 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(v["n_saved"].as_u64().is_some_and(|n| n >= 48), "the whole generation is in the file: {v}");
}
