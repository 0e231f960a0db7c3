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

/// Tests that run `check` when the first GPU opens (else print why and pass, or fail under
/// `TANDEM_REQUIRE_GPU=1`).
macro_rules! on_the_gpu {
    ($($test:ident ($label:literal): $check:expr;)*) => {$(
        #[test]
        fn $test() {
            if gpu($label).is_some() {
                $check;
            }
        }
    )*};
}

on_the_gpu! {
    hybrid_and_all_gpu_logits_match_the_cpu_on_every_fixture("logits"): cuda_logits_match_the_cpu(&on_cuda0);
    gpu_prefill_matches_llama_cpp("prefill"): cuda_prefill_matches_llama_cpp(&on_cuda0);
    a_gpu_decode_step_crosses_twice_per_moe_layer("ledger"): decode_step_crossings(&[("CUDA0", &on_cuda0)]);
    gpu_zero_rows_read_as_the_cpu_reads_them("zero rows"): zero_rows_read_alike(&on_cuda0);
    the_binary_uses_the_gpu_for_gpu_flags("binary"): binary_uses_the_device(&[]);
    bench_reports_what_the_gpu_did_per_token("bench"): bench_reports_the_device(&[]);
}
