//! The CUDA executor on a real GPU (built with `--features cuda`): the checks tests/executor.rs
//! runs on the kernel emulator — hybrid and all-GPU logits against the CPU's on every fixture, a
//! prompt through the prefill path against llama.cpp's, a decode step's crossings — and the
//! binary's GPU path. Without a usable GPU every test prints why and passes, unless
//! `TANDEM_REQUIRE_GPU=1` (scripts/gpu-check.sh) makes that a failure. tests/kernels.rs checks
//! the kernels themselves, on the emulator and on the GPU.
#![cfg(feature = "cuda")]

mod exec_util;

use exec_util::*;
use std::collections::HashMap;
use std::path::PathBuf;
use tandem_cuda::Runtime;
use tandem_gguf::GgufModel;
use tandem_model::Exec;

/// The first GPU with tandem's kernels, or `None` (printing why) when there is none.
fn gpu(test: &str) -> Option<Runtime> {
    match Runtime::open(tandem::kernels::images(), 0) {
        Ok(rt) => Some(rt),
        Err(e) if std::env::var_os("TANDEM_REQUIRE_GPU").is_some_and(|v| v == "1") => {
            panic!("{test}: TANDEM_REQUIRE_GPU=1 but CUDA is unavailable: {e}")
        }
        Err(e) => {
            println!("{test}: skipped, CUDA is unavailable: {e}");
            None
        }
    }
}

/// The CPU and CUDA0 holding `names`.
fn on_cuda0(gguf: &GgufModel, names: &[String]) -> Exec {
    let rt = gpu("executor").expect("a GPU (checked by the caller)");
    let placement: HashMap<String, usize> = names.iter().map(|n| (n.clone(), 0)).collect();
    Exec::with_cuda(threads(), vec![rt], gguf, &placement).unwrap()
}

#[test]
fn hybrid_and_all_gpu_logits_match_the_cpu_on_every_fixture() {
    if gpu("logits").is_some() {
        cuda_logits_match_the_cpu(&on_cuda0);
    }
}

#[test]
fn gpu_prefill_matches_llama_cpp() {
    if gpu("prefill").is_some() {
        cuda_prefill_matches_llama_cpp(&on_cuda0);
    }
}

#[test]
fn a_gpu_decode_step_crosses_twice_per_moe_layer() {
    if gpu("ledger").is_some() {
        decode_step_crossings(&[("CUDA0", &on_cuda0)]);
    }
}

/// The `tandem` binary: `TANDEM_BIN`, else the one cargo built with this test.
fn tandem_bin() -> PathBuf {
    std::env::var_os("TANDEM_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tandem")), PathBuf::from)
}

#[test]
fn the_binary_uses_the_gpu_for_gpu_flags() {
    let Some(_) = gpu("binary") else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = repo().join("tests/fixtures/models/deepseek2-mla-tiny-Q4_K_M.gguf");
    let m = m.to_str().unwrap();
    let tokens = "1,17,42,99,100,200,300,301,302,7,8,9";
    let run = |flags: &[&str], out: &str| {
        let mut args = vec!["logits", "-m", m, "--tokens", tokens, "--out", out, "-c", "64", "--token-by-token"];
        args.extend(flags);
        let o = std::process::Command::new(tandem_bin()).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{flags:?}: {err}");
        let bytes = std::fs::read(out).unwrap();
        (bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect::<Vec<f32>>(), err)
    };
    let cpu_out = dir.path().join("cpu.f32");
    let (want, _) = run(&[], cpu_out.to_str().unwrap());
    for flags in [&["-ngl", "999", "-ot", "exps=CPU"][..], &["-ngl", "999"]] {
        let out = dir.path().join("gpu.f32");
        let (got, err) = run(flags, out.to_str().unwrap());
        assert!(!err.contains("CUDA unavailable"), "{flags:?} fell back: {err}");
        assert!(err.lines().any(|l| l.starts_with("tandem: CUDA: CUDA0")), "{flags:?}: no upload line: {err}");
        match within_tolerance(&got, &want, 512) {
            Ok(d) => println!("tandem logits {flags:?}: {d}"),
            Err(d) => panic!("tandem logits {flags:?}: {d}"),
        }
    }
}
