//! `--override-kv` as llama.cpp has it: the logits of a fixture with `expert_used_count`
//! overridden match llama.cpp's with the same override (tests/fixtures/inference/overrides/, made
//! by scripts/gen_override_fixture.py), and bad overrides are one line.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/inference")
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("running tandem")
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// The worst position's `max|d| / max|ref|`.
fn worst(got: &[f32], want: &[f32], n_vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len());
    got.chunks_exact(n_vocab)
        .zip(want.chunks_exact(n_vocab))
        .map(|(g, w)| {
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// The one error line of a failed command (exit status 1 or 2, no panic).
fn error_line(o: &Output) -> String {
    assert!(!o.status.success(), "expected a failure");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("tandem: error:")).collect();
    assert_eq!(errors.len(), 1, "one error line expected: {err}");
    errors[0].to_string()
}

#[test]
fn an_overridden_expert_count_gives_llama_cpps_logits() {
    let meta: Value = serde_json::from_slice(
        &std::fs::read(dir().join("overrides/deepseek2-mla-f32.expert_used_count-1.json")).unwrap(),
    )
    .unwrap();
    let want = read_f32(&dir().join("overrides").join(meta["logits_file"].as_str().unwrap()));
    let n_vocab = meta["n_vocab"].as_u64().unwrap() as usize;
    let tokens: Vec<String> = meta["tokens"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
    let tokens = tokens.join(",");
    let model = dir().join(meta["model"].as_str().unwrap());
    let out = tempfile::tempdir().unwrap();
    let logits = |extra: &[&str], name: &str| {
        let file = out.path().join(name);
        let mut args = vec!["logits", "-m", model.to_str().unwrap(), "--tokens", &tokens, "--out"];
        args.extend([file.to_str().unwrap(), "-t", "2", "-c", "256", "-ctk", "f32", "-ctv", "f32"]);
        args.extend_from_slice(extra);
        let o = tandem(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (read_f32(&file), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (got, log) = logits(&["--override-kv", meta["override"].as_str().unwrap()], "override.f32");
    assert!(log.contains("metadata override: deepseek2.expert_used_count = i64 1 (the file: u32 3)"), "{log}");
    // F32 weights and cache: llama.cpp's bound (tests/logits.rs)
    let d = worst(&got, &want, n_vocab);
    assert!(d <= 1e-3, "with the override: worst {d:.2e} from llama.cpp's");
    // without it the logits are far from these: the override is what the test sees
    let (plain, _) = logits(&[], "plain.f32");
    let d = worst(&plain, &want, n_vocab);
    assert!(d > 0.1, "without the override: worst {d:.2e}");
    // repeated flags and commas are both read; the last value of a key wins
    let (again, _) = logits(
        &[
            "--override-kv",
            "general.name=str:x,deepseek2.expert_used_count=int:2",
            "--override-kv",
            "deepseek2.expert_used_count=int:1",
        ],
        "again.f32",
    );
    assert_eq!(again, got);
}

#[test]
fn bad_overrides_are_one_line() {
    let m = dir().join("deepseek2-mla-f32.gguf");
    let m = m.to_str().unwrap();
    for (kv, says) in [
        (
            "deepseek2.expert_used_count=int:x",
            "--override-kv 'deepseek2.expert_used_count=int:x': 'x' is not an integer",
        ),
        ("deepseek2.expert_used_count=uint:3", "unknown type 'uint'"),
        // the model's own checks read overridden values as the file's
        ("deepseek2.expert_used_count=int:9", "expert_used_count"),
        ("deepseek2.expert_used_count=int:-1", "expert_used_count"),
        ("deepseek2.block_count=str:three", "block_count"),
    ] {
        let out = std::env::temp_dir().join("tandem-override-kv-unwritten.f32");
        let e = error_line(&tandem(&[
            "logits",
            "-m",
            m,
            "--tokens",
            "1,2",
            "--out",
            out.to_str().unwrap(),
            "--override-kv",
            kv,
        ]));
        assert!(e.contains(says), "{kv}: {e}");
    }
    let e = error_line(&tandem(&["tokenize", "-m", m, "-p", "hi", "--override-kv", "nokey"]));
    assert!(e.contains("no '='"), "{e}");
}
