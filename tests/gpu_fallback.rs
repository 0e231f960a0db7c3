//! The CUDA fallback, on every machine: with GPU placement flags (`-ngl 999 -ot exps=CPU`, `-ngl
//! 999`) and no usable GPU, `tandem run` and `tandem logits` print exactly one line saying why and
//! then produce exactly what they produce without the flags. The children run with
//! `CUDA_VISIBLE_DEVICES=` (no device visible), so this tests the fallback even on a GPU machine;
//! tests/gpu.rs checks the GPU itself.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository (for fixtures): `TANDEM_REPO` when the test binary runs away from its build tree
/// (scripts/gpu-check.sh), else where it was built.
fn repo() -> PathBuf {
    std::env::var_os("TANDEM_REPO").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The `tandem` binary: `TANDEM_BIN`, else the one cargo built with this test.
fn tandem_bin() -> PathBuf {
    std::env::var_os("TANDEM_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tandem")), PathBuf::from)
}

fn models() -> PathBuf {
    repo().join("tests/fixtures/models")
}

/// Every single-file model fixture and the first shard of the split one.
fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(models())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            !name.contains("-of-") || name.contains("00001-of-")
        })
        .collect();
    v.sort();
    assert!(v.len() >= 5, "expected the model fixtures, found {v:?}");
    v
}

fn tandem(args: &[&str]) -> Output {
    Command::new(tandem_bin()).args(args).env("CUDA_VISIBLE_DEVICES", "").output().expect("running tandem")
}

fn ok(o: &Output) -> (Vec<u8>, String) {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "tandem failed: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    (o.stdout.clone(), err)
}

/// The one fallback line of `stderr`; it gives a reason this build can have.
fn fallback_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("CUDA")).collect();
    assert_eq!(lines.len(), 1, "exactly one CUDA line expected: {stderr}");
    let line = lines[0];
    let reason = line
        .strip_prefix("tandem: CUDA unavailable (")
        .and_then(|r| r.strip_suffix("); running everything on the CPU"))
        .unwrap_or_else(|| panic!("not the fallback line: {line}"));
    if cfg!(feature = "cuda") {
        let known = [
            "no CUDA driver found: libcuda.so could not be loaded",
            "no CUDA device found",
            "tandem was built without kernels (nvcc was not found when it was built)",
        ];
        assert!(known.contains(&reason) || reason.starts_with("the CUDA driver failed"), "reason: {reason}");
    } else {
        assert_eq!(reason, "tandem was built without CUDA support");
    }
    line.to_string()
}

const GPU_FLAGS: [&[&str]; 2] = [&["-ngl", "999", "-ot", "exps=CPU"], &["-ngl", "999"]];

#[test]
fn run_falls_back_with_one_line_and_the_same_text() {
    for m in fixtures() {
        let m = m.to_str().unwrap();
        let base = [
            "run",
            "-m",
            m,
            "-p",
            "Hello world! The quick",
            "--raw",
            "-n",
            "12",
            "--temp",
            "0",
            "-t",
            "2",
            "-c",
            "256",
        ];
        let (want, plain_err) = ok(&tandem(&base));
        assert!(!plain_err.contains("CUDA"), "no GPU flags, no CUDA line: {plain_err}");
        assert!(!want.is_empty(), "{m}: no output");
        for flags in GPU_FLAGS {
            let args: Vec<&str> = base.iter().chain(flags.iter()).copied().collect();
            let (got, err) = ok(&tandem(&args));
            let line = fallback_line(&err);
            assert_eq!(got, want, "{m} {flags:?}: output differs from the CPU run");
            println!("{m} {flags:?}: {line}");
        }
    }
}

#[test]
fn logits_fall_back_with_byte_identical_output() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = "1,17,42,99,100,200,300,301,302,7,8,9";
    for (i, m) in fixtures().iter().enumerate() {
        let m = m.to_str().unwrap();
        let cpu = dir.path().join(format!("{i}.cpu.f32"));
        let base = ["logits", "-m", m, "--tokens", tokens, "-t", "2", "-c", "64"];
        let mut args = base.to_vec();
        args.extend(["--out", cpu.to_str().unwrap()]);
        let (_, err) = ok(&tandem(&args));
        assert!(!err.contains("CUDA"), "no GPU flags, no CUDA line: {err}");
        let want = std::fs::read(&cpu).unwrap();
        assert!(!want.is_empty());
        for (j, flags) in GPU_FLAGS.iter().enumerate() {
            let out = dir.path().join(format!("{i}.{j}.f32"));
            let mut args = base.to_vec();
            args.extend(["--out", out.to_str().unwrap()]);
            args.extend(flags.iter());
            let (_, err) = ok(&tandem(&args));
            fallback_line(&err);
            assert!(std::fs::read(&out).unwrap() == want, "{m} {flags:?}: logits differ from the CPU run");
        }
    }
}

#[test]
fn no_gpu_flags_mean_no_attempt_and_bad_placement_flags_are_errors() {
    let m = models().join("llama-tiny.gguf");
    let m = m.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("l.f32");
    let out = out.to_str().unwrap();
    // -ngl 0 and -ot rules that only name the CPU ask for no GPU: no CUDA line.
    for flags in [&["-ngl", "0"][..], &["-ot", "exps=CPU"], &["-ngl", "0", "--cpu-moe"]] {
        let mut args = vec!["logits", "-m", m, "--tokens", "1,2,3", "--out", out, "-t", "2"];
        args.extend(flags);
        let (_, err) = ok(&tandem(&args));
        assert!(!err.contains("CUDA"), "{flags:?}: {err}");
    }
    // Bad flags are errors of one line, never a silent fallback.
    for (flags, want) in [
        (&["-ot", "exps=GPU7"][..], "'GPU7' is not a device"),
        (&["-ot", "exps("], "exps("),
        (&["-ngl", "many"], "many"),
    ] {
        let mut args = vec!["logits", "-m", m, "--tokens", "1,2,3", "--out", out];
        args.extend(flags);
        let o = tandem(&args);
        assert!(!o.status.success(), "{flags:?} should fail");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains(want), "{flags:?}: {err}");
        assert!(!err.contains("CUDA unavailable"), "{flags:?}: {err}");
    }
}
