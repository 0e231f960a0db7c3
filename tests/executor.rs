//! The executor with two devices, on a machine without a GPU, in the placement the planner makes
//! for `-ngl 999 -ot exps=CPU` and for `-ngl 999`, with the CPU and either
//!
//! * a host-memory device standing in for CUDA0 (its own memory, its copies and the host's waits
//!   for it counted): its logits must be the CPU's alone, bit for bit (both run the CPU's
//!   arithmetic; only where the tensors live differs); or
//! * the CUDA device on the kernel emulator (kernels/*.cu compiled for the host, device memory in
//!   host memory): the GPU's arithmetic, so its logits must match the CPU's within the tolerances
//!   tests/logits.rs holds tandem to against llama.cpp (tests/gpu.rs runs the same checks on a
//!   real GPU).
//!
//! Either way a decode step must cross between the devices exactly where DESIGN.md says: the
//! hidden state in, once down and once up per MoE layer, the logits out, no cache row moved.

mod exec_util;

use exec_util::*;
use std::collections::HashMap;
use tandem_gguf::GgufModel;
use tandem_model::{Context, Exec, MlaMode};

/// The CPU and the CUDA device on the kernel emulator, holding `names`.
fn emulated(gguf: &GgufModel, names: &[String]) -> Exec {
    let rt = tandem_cuda::Runtime::emulated().expect("the kernel emulator (tandem-cuda's `emulate` feature)");
    let placement: HashMap<String, usize> = names.iter().map(|n| (n.clone(), 0)).collect();
    Exec::with_cuda(threads(), vec![rt], gguf, &placement).unwrap()
}

fn stand_in(_: &GgufModel, names: &[String]) -> Exec {
    Exec::with_stand_in(threads(), names.to_vec())
}

/// Hybrid and all-on-the-stand-in placements against the CPU alone, on every fixture, with the
/// MLA forms (absorbed, decompressed where it pays, always decompressed), several sequences per
/// micro-batch and micro-batches that cut through a sequence: the same bits.
#[test]
fn stand_in_logits_equal_the_cpu_path_on_every_fixture() {
    let mut checked = Vec::new();
    for path in fixtures() {
        let (gguf, model) = open(&path);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mla_files = gguf.tensor_index("blk.0.attn_k_b.weight").is_some();
        let modes: &[MlaMode] =
            if mla_files { &[MlaMode::Absorbed, MlaMode::Auto, MlaMode::Decompressed] } else { &[MlaMode::Absorbed] };
        let cpu = |mla| {
            two_sequences(
                &mut Context::new(model.clone(), Exec::cpu(threads()), params(mla, 9)).unwrap(),
                model.n_vocab(),
            )
        };
        for &mla in modes {
            let want = cpu(mla);
            for ot in [&["exps=CPU"][..], &[]] {
                let names = on_gpu(&gguf, &path, ot);
                assert!(!names.is_empty(), "{name}: nothing planned on CUDA0");
                // The decompressed form runs where the cache and both attn_k_b and attn_v_b are;
                // a type without a CUDA kernel keeps some of them on the CPU, and then the layer
                // attends absorbed, as the CPU does under the absorbed form.
                let on = |t: &str| names.iter().any(|n| n == &format!("blk.0.{t}.weight"));
                let split =
                    mla_files && (on("attn_kv_a_mqa") != on("attn_k_b") || on("attn_kv_a_mqa") != on("attn_v_b"));
                let want = if split && mla != MlaMode::Absorbed { cpu(MlaMode::Absorbed) } else { want.clone() };
                let exec = Exec::with_stand_in(threads(), names);
                let mut ctx = Context::new(model.clone(), exec, params(mla, 9)).unwrap();
                let got = two_sequences(&mut ctx, model.n_vocab());
                assert_eq!(got.len(), want.len());
                let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
                let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
                assert!(same, "{name} {mla:?} -ot {ot:?}: stand-in logits differ from the CPU's (worst {worst:e})");
                let moved: u64 = ctx.exec().ledgers().iter().map(|(_, c)| c.copies()).sum();
                assert!(moved > 0, "{name} {ot:?}: nothing crossed to the stand-in");
            }
        }
        checked.push(name);
    }
    println!("stand-in = CPU bit for bit: {}", checked.join(", "));
}

#[test]
fn emulated_cuda_logits_match_the_cpu_on_every_fixture() {
    cuda_logits_match_the_cpu(&emulated);
}

#[test]
fn emulated_cuda_prefill_matches_llama_cpp() {
    cuda_prefill_matches_llama_cpp(&emulated);
}

#[test]
fn a_decode_step_crosses_twice_per_moe_layer() {
    decode_step_crossings(&[("stand-in", &stand_in), ("emulated CUDA", &emulated)]);
}

#[test]
fn emulated_zero_rows_read_as_the_cpu_reads_them() {
    zero_rows_read_alike(&emulated);
}

/// A slot file holds the same bytes whichever device kept the cache: saved from the CPU, restored
/// into the emulated GPU's cache (every layer there, K and V interleaved in its rows) and saved
/// again, byte for byte; and a sequence restored on the device gives the logits of the one it was
/// saved from there, bit for bit.
#[test]
fn slot_files_move_between_the_cpu_and_the_emulated_gpu() {
    let dir = tempfile::tempdir().unwrap();
    for path in fixtures() {
        let (gguf, model) = open(&path);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let names = on_gpu(&gguf, &path, &[]);
        let prompt: Vec<u32> = (0..19).map(|i| (5 + 13 * i) % model.n_vocab() as u32).collect();
        let gpu = || Context::new(model.clone(), emulated(&gguf, &names), params(MlaMode::Absorbed, 8)).unwrap();
        let (from_cpu, again, from_gpu) = (dir.path().join("cpu"), dir.path().join("again"), dir.path().join("gpu"));
        let mut cpu = Context::new(model.clone(), Exec::cpu(threads()), params(MlaMode::Absorbed, 8)).unwrap();
        cpu.decode(&tandem_model::Batch::sequence(&prompt, 0, 0, false)).unwrap();
        cpu.save_sequence(0, &prompt, &from_cpu).unwrap();
        let mut on_device = gpu();
        assert_eq!(on_device.restore_sequence(1, &from_cpu).unwrap().0, prompt, "{name}");
        on_device.save_sequence(1, &prompt, &again).unwrap();
        assert!(std::fs::read(&from_cpu).unwrap() == std::fs::read(&again).unwrap(), "{name}: other bytes back");

        let mut a = gpu();
        a.decode(&tandem_model::Batch::sequence(&prompt, 0, 0, false)).unwrap();
        a.save_sequence(0, &prompt, &from_gpu).unwrap();
        let mut b = gpu();
        b.restore_sequence(2, &from_gpu).unwrap();
        let n = prompt.len() as u32;
        let la = a.decode(&tandem_model::Batch::sequence(&[3], n, 0, true)).unwrap();
        let lb = b.decode(&tandem_model::Batch::sequence(&[3], n, 2, true)).unwrap();
        assert!(la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: other logits after a restore");
    }
}

/// The binary's GPU path (placement flags, upload, fallback rules) with one emulated GPU.
#[test]
fn the_binary_uses_the_emulated_gpu_for_gpu_flags() {
    binary_uses_the_device(&[(tandem::load::EMULATOR_ENV, "1")]);
}

#[test]
fn bench_reports_what_the_emulated_gpu_did_per_token() {
    bench_reports_the_device(&[(tandem::load::EMULATOR_ENV, "1")]);
}

/// Kimi K2.5's real shapes through the emulated CUDA device, hybrid: a model written by `tandem
/// synth kimi-k2.5 --layers 2` (12 GiB, so not in CI: set TANDEM_SYNTH_KIMI to its path), a short
/// prompt and a decode step against the CPU alone, and the step's ledger. TANDEM_SYNTH_OT (one
/// `-ot` rule list, e.g. `attn_output=CUDA0,blk=CPU`) narrows what the device holds. The logits
/// differ from the CPU's by ~1e-2 of max|logit| here, not 1e-7 as on the fixtures: layer 0's
/// attention output meets the CPU's to 7e-7, but one Q8_0 activation that this moves across a
/// rounding step in the 18432-wide dense FFN changes its output by ~5e-4, and the random weights
/// carry that on (the expert choices stay the same).
#[test]
#[ignore]
fn kimi_shape_through_the_emulated_device() {
    let Some(path) = std::env::var_os("TANDEM_SYNTH_KIMI") else {
        println!("set TANDEM_SYNTH_KIMI to a `tandem synth kimi-k2.5` file");
        return;
    };
    let path = std::path::PathBuf::from(path);
    let (gguf, model) = open(&path);
    let ot = std::env::var("TANDEM_SYNTH_OT").unwrap_or_else(|_| "exps=CPU".into());
    let names = on_gpu(&gguf, &path, &[ot.as_str()]);
    let run = |exec: Exec| {
        let mut ctx = Context::new(model.clone(), exec, params(MlaMode::Absorbed, 8)).unwrap();
        let mut logits = ctx.decode(&tandem_model::Batch::sequence(&[1, 2, 3], 0, 0, true)).unwrap();
        let before = ctx.exec().ledgers();
        logits.extend(ctx.decode(&tandem_model::Batch::sequence(&[4], 3, 0, true)).unwrap());
        let after = ctx.exec().ledgers();
        (logits, after.iter().zip(&before).map(|((n, a), (_, b))| (n.clone(), *a - *b)).collect::<Vec<_>>())
    };
    let (want, _) = run(Exec::cpu(threads()));
    let t = std::time::Instant::now();
    let (got, ledger) = run(emulated(&gguf, &names));
    println!("emulated hybrid: {:.1} s; decode step: {ledger:?}", t.elapsed().as_secs_f64());
    for (i, (g, w)) in got.chunks(model.n_vocab()).zip(want.chunks(model.n_vocab())).enumerate() {
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("position {i}: max |logit| {scale:.3}, max |difference| {e:.3e}");
    }
    match within_tolerance(&got, &want, model.n_vocab()) {
        Ok(d) => println!("Kimi shape, emulated CUDA vs CPU: {d}"),
        Err(d) => panic!("Kimi shape, emulated CUDA vs CPU: {d}"),
    }
}
