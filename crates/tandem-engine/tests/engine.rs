//! The engine on the tiny fixture models: continuous batching gives the same tokens as running
//! alone, the prompt cache and system prompt are reused, limits and stops end generations as
//! they say, aborts and deadlines free slots, bad requests are refused with the reason.

use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tandem_engine::{
    Engine, EngineConfig, Error, Event, Failure, Finish, FinishReason, LengthLimit, Prompt, Request, SamplingParams,
};
use tandem_model::{Context, ContextParams, Exec, Model};
use tandem_model::{GgufModel, LoadOptions};
use tandem_tokenizer::Tokenizer;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// The log of every engine in this test binary: one global subscriber, installed by [`engine`]
/// before any engine starts. A test picks its own lines by its requests' ids.
fn log_of(id_prefix: &str) -> Vec<String> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    #[derive(Clone)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = Buf(buf.clone());
        let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || sink.clone()).finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this binary");
        buf
    });
    let mine = format!("request{{id={id_prefix}");
    String::from_utf8_lossy(&buf.lock().unwrap()).lines().filter(|l| l.contains(&mine)).map(str::to_string).collect()
}

fn engine(model: &str, n_ctx: usize, config: EngineConfig) -> Engine {
    // The subscriber before any engine logs: a line whose callsite was first reached with none
    // installed stayed disabled after it was (in parallel runs, "request started" and "request
    // finished" went missing).
    log_of("");
    let gguf = Arc::new(GgufModel::open(fixture(model), LoadOptions::default()).unwrap());
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let model = Arc::new(Model::load(gguf).unwrap());
    let threads = tandem_cpu::Threads::new(1, 1).unwrap();
    let params = ContextParams { n_ctx, ..ContextParams::default() };
    let ctx = Context::new(model, Exec::cpu(threads), params).unwrap();
    Engine::start(ctx, tok, config).unwrap()
}

fn greedy(prompt: &str, max_tokens: u32) -> Request {
    let mut r = Request::new(Prompt::Text(prompt.into()));
    r.sampling = SamplingParams::greedy();
    r.max_tokens = max_tokens;
    r
}

fn named(mut r: Request, id: &str) -> Request {
    r.id = id.into();
    r
}

/// Every event of one request, until its end.
fn collect(rx: &Receiver<Event>) -> (Vec<u32>, String, Result<Finish, Failure>) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).expect("the engine stopped sending") {
            Event::Token { id, text: t, .. } => {
                ids.push(id);
                text.push_str(&t);
            }
            Event::Finished { text: t, finish } => {
                text.push_str(&t);
                return (ids, text, Ok(finish));
            }
            Event::Failed(f) => return (ids, text, Err(f)),
        }
    }
}

fn run(e: &Engine, req: Request) -> (Vec<u32>, String, Finish) {
    let (tx, rx) = channel();
    e.handle().submit(req, Box::new(tx)).unwrap();
    let (ids, text, f) = collect(&rx);
    (ids, text, f.unwrap())
}

const PROMPTS: [&str; 4] = [
    "The quick brown fox",
    "Mixture of experts models route every token",
    "In the beginning there was the word",
    "Language models read text as a sequence of tokens. Each token is a small piece of text",
];

#[test]
fn sixteen_requests_on_four_slots_match_each_alone() {
    let alone: Vec<_> = {
        let e = engine("deepseek2-mla-tiny.gguf", 256, EngineConfig::default());
        (0..16).map(|i| run(&e, greedy(PROMPTS[i % 4], 6 + i as u32)).0).collect()
    };
    let config = EngineConfig { n_parallel: 4, prefill_chunk: 7, ..EngineConfig::default() };
    let e = engine("deepseek2-mla-tiny.gguf", 256, config);
    let rxs: Vec<_> = (0..16)
        .map(|i| {
            let (tx, rx) = channel();
            e.handle().submit(greedy(PROMPTS[i % 4], 6 + i as u32), Box::new(tx)).unwrap();
            rx
        })
        .collect();
    for (i, rx) in rxs.iter().enumerate() {
        let (ids, _, f) = collect(rx);
        assert_eq!(ids, alone[i], "request {i}");
        let f = f.unwrap();
        assert_eq!(f.usage.completion_tokens as usize, ids.len());
    }
    // batches really were shared: fewer steps than tokens computed
    let stats = e.handle().stats().clone();
    assert!(stats.steps.get() < stats.generated_tokens.get(), "{} steps", stats.steps.get());
}

#[test]
fn limits_say_which_one_ended_the_generation() {
    let config = EngineConfig { max_tokens: 5, ..EngineConfig::default() };
    let e = engine("llama-tiny.gguf", 64, config);
    let mut r = greedy(PROMPTS[0], 3);
    r.ignore_eos = true;
    let (ids, _, f) = run(&e, r.clone());
    assert_eq!((ids.len(), f.reason), (3, FinishReason::Length(LengthLimit::Request)));
    r.max_tokens = 50;
    let (ids, _, f) = run(&e, r.clone());
    assert_eq!((ids.len(), f.reason), (5, FinishReason::Length(LengthLimit::Server)));
    r.max_tokens = 0;
    assert_eq!(run(&e, r).2.reason, FinishReason::Length(LengthLimit::Server));
    // the context: 64 positions, a prompt of 60
    let e = engine("llama-tiny.gguf", 64, EngineConfig::default());
    let mut r = Request::new(Prompt::Tokens(vec![100; 60]));
    r.ignore_eos = true;
    let (ids, _, f) = run(&e, r);
    assert_eq!(f.reason, FinishReason::Length(LengthLimit::Context));
    assert_eq!(ids.len(), 64 - 60 + 1);
}

#[test]
fn stop_strings_end_generation_and_are_not_sent() {
    let e = engine("llama-tiny.gguf", 128, EngineConfig::default());
    let mut r = greedy(PROMPTS[1], 24);
    r.ignore_eos = true;
    let (_, full, _) = run(&e, r.clone());
    assert!(full.chars().count() > 6, "{full:?}");
    let stop: String = full.chars().skip(3).take(3).collect();
    r.stop = vec![stop.clone()];
    let (_, text, f) = run(&e, r);
    assert_eq!(f.reason, FinishReason::Stop);
    assert_eq!(text, full[..full.find(&stop).unwrap()]);
}

#[test]
fn prompt_cache_and_system_prompt_are_reused() {
    let long: String = PROMPTS.iter().cycle().take(12).copied().collect::<Vec<_>>().join(" ");
    let config = EngineConfig {
        n_parallel: 2,
        system_prompt: Some("You are a helpful assistant.".into()),
        log_prompts: true,
        ..EngineConfig::default()
    };
    let e = engine("deepseek2-mla-tiny.gguf", 512, config);
    let sys = e.handle().info().system_prompt_tokens as u32;
    assert!(sys > 4);
    let (first_ids, _, f1) = run(&e, named(greedy(&long, 4), "cache-1"));
    assert_eq!(f1.usage.cached_tokens, sys, "a first request starts from the system prompt");
    let (_, _, f2) = run(&e, named(greedy(&format!("{long} and then"), 4), "cache-2"));
    assert!(f2.usage.cached_tokens >= f1.usage.prompt_tokens - 1, "{:?} vs {:?}", f2.usage, f1.usage);
    // a reused prefix gives the same tokens as computing it
    let (again, _, f3) = run(&e, named(greedy(&long, 4), "cache-3"));
    assert_eq!(again, first_ids);
    assert_eq!(f3.usage.cached_tokens, f3.usage.prompt_tokens - 1);
    // a prompt that diverges from the cache is logged with where and what
    run(&e, named(greedy(&format!("{} zebra {}", &long[..60], &long[60..]), 2), "cache-4"));
    let lines = log_of("cache-");
    assert!(lines.iter().any(|l| l.contains("diverges") && l.contains("zebra")), "{lines:?}");
    // every request's lines carry its id
    for id in ["cache-1", "cache-2", "cache-3", "cache-4"] {
        let done = format!("request{{id={id}}}: tandem_engine::slot: request finished");
        assert!(lines.iter().any(|l| l.contains(&done)), "{id}: {lines:?}");
    }
    assert!(e.handle().stats().cache_divergences.get() >= 1);
}

#[test]
fn prompt_text_stays_out_of_the_log_by_default() {
    let long: String = PROMPTS.iter().cycle().take(12).copied().collect::<Vec<_>>().join(" ");
    let config = EngineConfig { n_parallel: 2, ..EngineConfig::default() };
    let e = engine("llama-tiny.gguf", 512, config);
    run(&e, named(greedy(&long, 2), "quiet-1"));
    run(&e, named(greedy(&format!("{} zebra {}", &long[..60], &long[60..]), 2), "quiet-2"));
    let lines = log_of("quiet-");
    let diverged: Vec<&String> = lines.iter().filter(|l| l.contains("diverges")).collect();
    assert_eq!(diverged.len(), 1, "{lines:?}");
    assert!(diverged[0].contains("hash") && !diverged[0].contains("zebra"), "{diverged:?}");
    for word in ["quick", "brown", "Mixture", "experts", "beginning", "Language", "sequence"] {
        assert!(long.contains(word));
        assert!(!lines.iter().any(|l| l.contains(word)), "{word:?} in the log: {lines:?}");
    }
}

#[test]
fn abort_and_deadline_free_the_slot() {
    let e = engine("llama-tiny.gguf", 256, EngineConfig::default());
    let h = e.handle();
    let (tx, rx) = channel();
    let mut r = greedy(PROMPTS[2], 0);
    r.ignore_eos = true;
    r.id = "long-one".into();
    h.submit(r.clone(), Box::new(tx)).unwrap();
    assert!(matches!(rx.recv().unwrap(), Event::Token { .. }));
    assert!(matches!(h.submit(r.clone(), Box::new(channel().0)), Err(Error::AlreadyRunning(_))));
    assert!(h.abort("long-one"));
    let (_, _, f) = collect(&rx);
    assert_eq!(f.unwrap().reason, FinishReason::Cancelled);
    assert!(!h.abort("long-one"));
    // the one slot is free again: a deadline ends the next request
    let (tx, rx) = channel();
    r.deadline = Some(Instant::now() + Duration::from_millis(5));
    h.submit(r, Box::new(tx)).unwrap();
    assert_eq!(collect(&rx).2, Err(Failure::DeadlineExceeded));
    assert_eq!(run(&e, greedy(PROMPTS[0], 2)).0.len(), 2);
    assert_eq!(h.pending(), 0);
}

#[test]
fn queue_full_and_bad_requests_are_refused() {
    let config = EngineConfig { n_parallel: 1, queue_size: 1, ..EngineConfig::default() };
    let e = engine("llama-tiny.gguf", 64, config);
    let h = e.handle();
    let bad = |r: Request| h.submit(r, Box::new(channel().0)).unwrap_err().to_string();
    let with = |f: &dyn Fn(&mut Request)| {
        let mut r = greedy("hi", 1);
        f(&mut r);
        r
    };
    assert!(bad(with(&|r| r.sampling.temperature = f32::NAN)).contains("temperature"));
    assert!(bad(with(&|r| r.sampling.temperature = -1.0)).contains("temperature = -1"));
    assert!(bad(with(&|r| r.sampling.top_p = 0.0)).contains("top_p"));
    assert!(bad(with(&|r| r.sampling.top_p = 1.5)).contains("top_p"));
    assert!(bad(with(&|r| r.prompt = Prompt::Text(String::new()))).contains("empty"));
    assert!(bad(with(&|r| r.prompt = Prompt::Tokens(vec![]))).contains("empty"));
    let n_vocab = h.info().n_vocab as u32;
    let msg = bad(with(&|r| r.prompt = Prompt::Tokens(vec![1, n_vocab + 7])));
    assert!(msg.contains(&format!("{}", n_vocab + 7)) && msg.contains(&n_vocab.to_string()), "{msg}");
    let msg = bad(with(&|r| r.prompt = Prompt::Tokens(vec![5; 100])));
    assert!(msg.contains("100 tokens") && msg.contains("64"), "{msg}");
    assert!(bad(with(&|r| r.logprobs = 1000)).contains("logprobs"));
    // far too long to fit: refused by its length in bytes, before it is tokenized
    let msg = bad(with(&|r| r.prompt = Prompt::Text("lorem ipsum ".repeat(330_000))));
    assert!(msg.contains("3960000 bytes") && msg.contains("the context holds 64"), "{msg}");
    // too long, but not by its bytes alone: tokenized, then refused
    let msg = bad(with(&|r| r.prompt = Prompt::Text("lorem ipsum ".repeat(40))));
    assert!(msg.contains(" tokens, the context holds 64"), "{msg}");
    // one running, one waiting, the third refused
    let mut long = greedy(PROMPTS[0], 0);
    long.ignore_eos = true;
    let (tx1, rx1) = channel();
    let (tx2, rx2) = channel();
    h.submit(long.clone(), Box::new(tx1)).unwrap();
    h.submit(long.clone(), Box::new(tx2)).unwrap();
    assert!(matches!(h.submit(long, Box::new(channel().0)), Err(Error::QueueFull(1))));
    drop(e); // shutdown fails both with UNAVAILABLE
    assert!(matches!(collect(&rx1).2, Err(Failure::Unavailable(_))));
    assert!(matches!(collect(&rx2).2, Err(Failure::Unavailable(_))));
}

#[test]
fn logprobs_and_chat() {
    let e = engine("deepseek2-mla-tiny.gguf", 256, EngineConfig::default());
    let (tx, rx) = channel();
    let mut r = greedy(PROMPTS[0], 3);
    r.logprobs = 3;
    e.handle().submit(r, Box::new(tx)).unwrap();
    match rx.recv().unwrap() {
        Event::Token { id, logprobs: Some(lp), .. } => {
            assert_eq!(lp.sampled.id, id);
            assert_eq!(lp.top.len(), 3);
            assert_eq!(lp.top[0].id, id, "greedy takes the most likely token");
            assert!(lp.top[0].logprob <= 0.0 && lp.top[0].logprob >= lp.top[1].logprob);
        }
        other => panic!("{other:?}"),
    }
    let chat = Prompt::Chat(vec![("user".into(), "Hello".into())]);
    let text = e.handle().render_chat(&[("user".into(), "Hello".into())]).unwrap();
    assert!(text.contains("Hello"), "{text}");
    let mut r = Request::new(chat.clone());
    r.max_tokens = 2;
    assert!(run(&e, r.clone()).2.usage.prompt_tokens > 1);

    // prepared once: the rendered text and tokens of the prompt, then any number of submits of
    // requests with that prompt, and no other
    let h = e.handle();
    let rendered = h.stats().templates_rendered.get();
    let prepared = h.prepare(&chat).unwrap();
    assert_eq!(prepared.rendered(), Some(text.as_str()));
    assert_eq!(prepared.tokens(), h.prompt_tokens(&chat).unwrap());
    assert_eq!(h.stats().templates_rendered.get() - rendered, 2, "prepare and prompt_tokens");
    for seed in 0..3 {
        let (tx, rx) = channel();
        r.sampling.seed = seed;
        h.submit_prepared(r.clone(), &prepared, Box::new(tx)).unwrap();
        assert!(collect(&rx).2.is_ok());
    }
    assert_eq!(h.stats().templates_rendered.get() - rendered, 2, "submits render nothing");
    let other = Request::new(Prompt::Chat(vec![("user".into(), "Bye".into())]));
    let err = h.submit_prepared(other, &prepared, Box::new(channel().0)).unwrap_err().to_string();
    assert!(err.contains("prepared for another request"), "{err}");
    assert!(prepared.is_for(&chat) && h.prepare(&Prompt::Text("x".into())).unwrap().rendered().is_none());
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_between_decode_steps() {
    let config = EngineConfig { n_parallel: 2, prefill_chunk: 16, ..EngineConfig::default() };
    let e = engine("llama-tiny.gguf", 1024, config);
    let h = e.handle();
    let (tx_a, rx_a) = channel();
    let mut a = greedy(PROMPTS[0], 0);
    a.ignore_eos = true;
    h.submit(a, Box::new(tx_a)).unwrap();
    assert!(matches!(rx_a.recv().unwrap(), Event::Token { .. }));
    // B's 400-token prompt takes 25 steps of 16; A decodes a token in each of them
    let (tx_b, rx_b) = channel();
    h.submit(greedy(&PROMPTS[3].repeat(20), 1), Box::new(tx_b)).unwrap();
    let (ids, _, f) = collect(&rx_b);
    let f = f.unwrap();
    assert_eq!(ids.len(), 1);
    let computed = (f.usage.prompt_tokens - f.usage.cached_tokens) as usize;
    assert!(computed >= 320, "{:?}", f.usage);
    let during = rx_a.try_iter().count();
    assert!(during + 1 >= computed / 16, "A generated {during} tokens while B's {computed} were prefilled");
    drop(e);
}

/// Structured output on a random-weight model (whose text is noise): every sample matches.
#[test]
fn constrained_output_always_matches() {
    use tandem_engine::Constraint;
    let e = engine("llama-tiny.gguf", 1024, EngineConfig::default());
    let sample = |c: Constraint, seed: u64, max: u32| {
        let mut r = greedy(PROMPTS[1], max);
        r.sampling = SamplingParams { temperature: 1.0, seed, ..SamplingParams::default() };
        r.constraint = Some(c);
        run(&e, r)
    };
    for seed in 0..10 {
        let (_, text, f) = sample(Constraint::Gbnf(r#"root ::= ("yes" | "no") "!"?"#.into()), seed, 16);
        assert!(["yes", "no", "yes!", "no!"].contains(&text.as_str()), "{text:?} {f:?}");
    }
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "color": {"enum": ["red", "green", "blue"]}
        },
        "required": ["name", "age", "color"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false}
    });
    for seed in 0..10 {
        let (_, text, f) = sample(Constraint::JsonSchema(schema.clone()), seed, 64);
        assert_eq!(f.reason, FinishReason::Stop, "{text:?}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(v["name"].as_str().is_some_and(|s| s.chars().count() <= 6), "{v}");
        assert!(v["age"].as_u64().is_some_and(|a| a <= 99), "{v}");
        assert!(["red", "green", "blue"].contains(&v["color"].as_str().unwrap_or("")), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
    }
    let (_, text, _) = sample(Constraint::Regex("[0-9]{3}-[0-9]{4}".into()), 7, 16);
    assert!(text.len() == 8 && text.as_bytes()[3] == b'-', "{text:?}");
    // a grammar that does not compile is the request's fault, named
    let mut bad = greedy("x", 4);
    bad.constraint = Some(Constraint::Gbnf("root ::= (\"a\"".into()));
    let err = e.handle().submit(bad, Box::new(channel().0)).unwrap_err().to_string();
    assert!(err.contains("grammar"), "{err}");
}
