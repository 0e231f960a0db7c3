//! The CUDA backend against the CPU reference (GPU machines only; built with `--features cuda`).
//! Each kernel on deterministic random data, the worst error reported with where it is; then whole
//! models: hybrid (`_exps` on the CPU) and all-GPU logits against the CPU's on every model fixture,
//! within the tolerances of tests/logits.rs. Without a usable GPU every test prints why and passes,
//! unless `TANDEM_REQUIRE_GPU=1` (scripts/gpu-check.sh sets it) makes that a failure.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use tandem_cpu::{RopeParams, RopeStyle};
use tandem_cuda::f16;
use tandem_cuda::{AttnShape, Gating, GgmlType, RouterParams, Runtime, MATVEC_TYPES};


/// The repository (for fixtures): `TANDEM_REPO` when the test binary runs away from its build tree
/// (scripts/gpu-check.sh), else where it was built.
fn repo() -> PathBuf {
    std::env::var_os("TANDEM_REPO").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The `tandem` binary: `TANDEM_BIN`, else the one cargo built with this test.
fn tandem_bin() -> PathBuf {
    std::env::var_os("TANDEM_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tandem")), PathBuf::from)
}

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

/// Deterministic values in [-1, 1) (a 64-bit LCG).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `max|got - want| / max|want|` and the index of the worst element.
fn rel_err(got: &[f32], want: &[f32]) -> (f32, usize) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let (mut worst, mut at) = (0f32, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        let d = if d.is_nan() { f32::INFINITY } else { d };
        if d > worst {
            (worst, at) = (d, i);
        }
    }
    (worst / scale, at)
}

fn check(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let (e, at) = rel_err(got, want);
    println!("{what}: worst relative error {e:.2e} at {at} (got {}, want {})", got[at], want[at]);
    assert!(e <= tol, "{what}: error {e:.2e} > {tol:.0e} at {at}: got {} want {}", got[at], want[at]);
}

fn run_f32(rt: &Runtime, data: &[f32]) -> tandem_cuda::DeviceBuffer<f32> {
    rt.upload(data, "test input").unwrap()
}

fn read_f32(rt: &Runtime, b: &tandem_cuda::DeviceBuffer<f32>, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    rt.read(b, 0, &mut v).unwrap();
    v
}

#[test]
fn rmsnorm_matches_cpu() {
    let Some(rt) = gpu("rmsnorm") else { return };
    let (rows, dim) = (3, 1000);
    let x = random(rows * dim, 1);
    let w: Vec<f32> = random(dim, 2).iter().map(|v| v + 1.0).collect();
    for weight in [Some(&w[..]), None] {
        let mut want = x.clone();
        want.chunks_exact_mut(dim).for_each(|r| tandem_cpu::rmsnorm(r, weight, 1e-6));
        let mut xb = run_f32(&rt, &x);
        let wb = weight.map(|w| run_f32(&rt, w));
        rt.rmsnorm(&mut xb, rows, wb.as_ref(), dim, 1e-6).unwrap();
        check(&format!("rmsnorm (weight: {})", weight.is_some()), &read_f32(&rt, &xb, rows * dim), &want, 1e-5);
    }
}

#[test]
fn rope_matches_cpu_in_both_styles() {
    let Some(rt) = gpu("rope") else { return };
    let (rows, heads, head_stride, n_dims) = (3, 4, 80, 64);
    let row_stride = heads * head_stride + 8;
    for style in [RopeStyle::Norm, RopeStyle::Neox] {
        let p = RopeParams {
            n_dims,
            style,
            freq_base: 10000.0,
            freq_scale: 0.25,
            ext_factor: 1.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            n_ctx_orig: 4096,
        };
        let x = random(rows * row_stride, 3);
        let cs: Vec<f32> = (0..rows).flat_map(|t| p.cache(7 + 13 * t as u32, None)).collect();
        let mut want = x.clone();
        for t in 0..rows {
            for h in 0..heads {
                let at = t * row_stride + h * head_stride;
                tandem_cpu::rope(&mut want[at..at + head_stride], &cs[t * n_dims..(t + 1) * n_dims], style);
            }
        }
        let mut xb = run_f32(&rt, &x);
        let cb = run_f32(&rt, &cs);
        rt.rope(&mut xb, &cb, rows, heads, head_stride, row_stride, n_dims, style == RopeStyle::Neox).unwrap();
        check(&format!("rope {style:?}"), &read_f32(&rt, &xb, x.len()), &want, 1e-5);
    }
}

#[test]
fn swiglu_add_and_scale_match_cpu() {
    let Some(rt) = gpu("swiglu/add") else { return };
    let n = 70_001;
    let (a, b) = (random(n, 4), random(n, 5));
    let mut want = a.clone();
    tandem_cpu::silu_mul(&mut want, &b);
    let mut ab = run_f32(&rt, &a);
    let bb = run_f32(&rt, &b);
    rt.swiglu(&mut ab, &bb, n).unwrap();
    check("swiglu", &read_f32(&rt, &ab, n), &want, 1e-5);

    let mut ab = run_f32(&rt, &a);
    rt.add(&mut ab, &bb, n).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    check("add", &read_f32(&rt, &ab, n), &want, 1e-6);

    let mut ab = run_f32(&rt, &a);
    rt.scale_add(&mut ab, &bb, 0.37, n).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + 0.37 * y).collect();
    check("scale_add", &read_f32(&rt, &ab, n), &want, 1e-6);

    let mut ab = run_f32(&rt, &a);
    rt.scale(&mut ab, -2.5, n).unwrap();
    let want: Vec<f32> = a.iter().map(|x| x * -2.5).collect();
    check("scale", &read_f32(&rt, &ab, n), &want, 1e-6);
}

/// tandem-model's `Moe::route` (crates/tandem-model/src/moe.rs), for one token.
fn route_cpu(logits: &[f32], bias: Option<&[f32]>, p: &RouterParams) -> Vec<(usize, f32)> {
    let top_k = |v: &[f32], k: usize| {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        idx.truncate(k);
        idx
    };
    let probs: Vec<f32> = match p.gating {
        Gating::Softmax => {
            let mut v = logits.to_vec();
            tandem_cpu::softmax_in_place(&mut v);
            v
        }
        Gating::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
    };
    let mut sel: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    if p.n_group > 1 {
        let per = p.n_expert / p.n_group;
        let scores: Vec<f32> = sel.chunks(per).map(|g| top_k(g, 2.min(per)).iter().map(|&i| g[i]).sum()).collect();
        let keep = top_k(&scores, p.n_group_used);
        for (g, chunk) in sel.chunks_mut(per).enumerate() {
            if !keep.contains(&g) {
                chunk.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top_k(&sel, p.n_used);
    let mut w: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
    if p.norm {
        let sum = w.iter().sum::<f32>().max(6.103_515_6e-5);
        w.iter_mut().for_each(|x| *x /= sum);
    }
    if p.scale != 0.0 && p.scale != 1.0 {
        w.iter_mut().for_each(|x| *x *= p.scale);
    }
    chosen.into_iter().zip(w).collect()
}

#[test]
fn router_matches_moe_route() {
    let Some(rt) = gpu("router") else { return };
    let n_tokens = 7;
    let cases = [
        // DeepSeek V3 / Kimi K2: sigmoid, selection bias, groups, normalized and scaled.
        (
            RouterParams {
                n_expert: 64,
                n_used: 8,
                gating: Gating::Sigmoid,
                n_group: 8,
                n_group_used: 4,
                norm: true,
                scale: 2.827,
            },
            true,
        ),
        // Qwen3-MoE / Mixtral-style: softmax, no groups, no bias.
        (
            RouterParams {
                n_expert: 16,
                n_used: 4,
                gating: Gating::Softmax,
                n_group: 1,
                n_group_used: 1,
                norm: false,
                scale: 1.0,
            },
            false,
        ),
        (
            RouterParams {
                n_expert: 8,
                n_used: 2,
                gating: Gating::Sigmoid,
                n_group: 2,
                n_group_used: 1,
                norm: true,
                scale: 0.0,
            },
            true,
        ),
    ];
    for (i, (p, with_bias)) in cases.iter().enumerate() {
        let logits: Vec<f32> = random(n_tokens * p.n_expert, 10 + i as u64).iter().map(|v| v * 4.0).collect();
        let bias: Vec<f32> = random(p.n_expert, 20 + i as u64).iter().map(|v| v * 0.1).collect();
        let bias = with_bias.then_some(&bias[..]);
        let lb = run_f32(&rt, &logits);
        let bb = bias.map(|b| run_f32(&rt, b));
        let mut ids = rt.alloc::<i32>(n_tokens * p.n_used, "ids").unwrap();
        let mut wb = rt.alloc::<f32>(n_tokens * p.n_used, "weights").unwrap();
        rt.router(&lb, bb.as_ref(), n_tokens, p, &mut ids, &mut wb).unwrap();
        let mut got_ids = vec![0i32; n_tokens * p.n_used];
        rt.read(&ids, 0, &mut got_ids).unwrap();
        let got_w = read_f32(&rt, &wb, n_tokens * p.n_used);
        for t in 0..n_tokens {
            let want = route_cpu(&logits[t * p.n_expert..(t + 1) * p.n_expert], bias, p);
            let want_ids: Vec<i32> = want.iter().map(|&(e, _)| e as i32).collect();
            let want_w: Vec<f32> = want.iter().map(|&(_, w)| w).collect();
            assert_eq!(&got_ids[t * p.n_used..(t + 1) * p.n_used], &want_ids[..], "case {i} token {t}: expert ids");
            check(&format!("router case {i} token {t}"), &got_w[t * p.n_used..(t + 1) * p.n_used], &want_w, 1e-5);
        }
    }
}

/// Random weights of `ty` (quantized by tandem-quant's reference quantizer) and their f32 values.
fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let src = random(rows * cols, seed);
    let row_bytes = tandem_quant::row_size(ty, cols).unwrap();
    let mut q = vec![0u8; rows * row_bytes];
    for r in 0..rows {
        tandem_quant::quantize_row(ty, &src[r * cols..(r + 1) * cols], &mut q[r * row_bytes..(r + 1) * row_bytes])
            .unwrap();
    }
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        tandem_quant::dequantize_row(ty, &q[r * row_bytes..(r + 1) * row_bytes], &mut deq[r * cols..(r + 1) * cols])
            .unwrap();
    }
    (q, deq)
}

/// `y[t][r] = sum_c W[r][c] x[t][c]` in f64 over the dequantized weights.
fn matmul_ref(w: &[f32], x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let n = x.len() / cols;
    let mut y = vec![0f32; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let s: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[t * cols + c] as f64).sum();
            y[t * rows + r] = s as f32;
        }
    }
    y
}

#[test]
fn matvec_and_prefill_gemm_match_the_dequantized_reference_for_every_type() {
    let Some(rt) = gpu("matvec") else { return };
    println!("cuBLAS: {}", if rt.has_cublas() { "loaded" } else { "missing (prefill uses the matvec kernel)" });
    let (rows, cols) = (67, 512);
    for (i, ty) in MATVEC_TYPES.into_iter().enumerate() {
        assert!(rt.supports(ty), "no matvec kernel for {ty}");
        let (q, deq) = weights(ty, rows + 5, cols, 100 + i as u64);
        let wb = rt.upload(&q, "weights").unwrap();
        // The last `rows` rows, as an expert slice of a 3-D tensor is addressed.
        let offset = 5 * tandem_quant::row_size(ty, cols).unwrap();
        let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        for n in [1, 3, 8, 20] {
            let x = random(n * cols, 200 + n as u64);
            let want = matmul_ref(&deq[5 * cols..], &x, rows, cols);
            let xb = run_f32(&rt, &x);
            let mut yb = rt.alloc::<f32>(n * rows, "y").unwrap();
            if n <= tandem_cuda::MAX_MATVEC_TOKENS {
                rt.matvec(ty, &wb, offset, &xb, &mut yb, rows, cols, n).unwrap();
            } else {
                rt.matmul(ty, &wb, offset, &xb, &mut yb, rows, cols, n).unwrap();
            }
            // Quantized kernels may round the activations (to q8_1, as ggml's mmvq does); the
            // gemm path rounds weights and activations to f16.
            let tol = match (float, n > 8) {
                (true, false) => 1e-4,
                (_, true) if ty == GgmlType::F32 => 1e-4,
                _ => 2e-2,
            };
            check(&format!("matmul {ty} x {n} tokens"), &read_f32(&rt, &yb, n * rows), &want, tol);
        }
        // Dequantization to f16 alone.
        let mut hb = rt.alloc::<f16>(rows * cols, "f16 weights").unwrap();
        rt.dequant_f16(ty, &wb, offset, &mut hb, rows * cols).unwrap();
        let mut h = vec![f16::ZERO; rows * cols];
        rt.read(&hb, 0, &mut h).unwrap();
        let got: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let want: Vec<f32> = deq[5 * cols..].iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        check(&format!("dequant {ty} -> f16"), &got, &want, 1e-3);
    }
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect()
}

fn cpu() -> tandem_cpu::CpuBackend {
    tandem_cpu::CpuBackend::new(tandem_cpu::Threads::new(2, 2).unwrap())
}

/// One token's CPU attention over an f16 cache (`v`: separate V rows, else MLA).
fn cpu_attention(q: &[f32], k: &[u8], v: Option<&[u8]>, s: (usize, usize, usize, usize), n_kv: usize, scale: f32) -> Vec<f32> {
    let (n_head, n_head_kv, dk, dv) = s;
    let a = tandem_cpu::Attn {
        q,
        n_head,
        n_head_kv,
        dk,
        dv,
        k,
        k_type: tandem_cpu::KvType::F16,
        k_row: n_head_kv * dk,
        v,
        v_type: tandem_cpu::KvType::F16,
        v_row: if v.is_some() { n_head_kv * dv } else { n_head_kv * dk },
        n_kv,
        scale,
    };
    let mut want = vec![0f32; n_head * dv];
    cpu().attention(&[a], &mut want).unwrap();
    want
}

#[test]
fn attention_matches_the_cpu_attention() {
    let Some(rt) = gpu("attention") else { return };
    // (n_head, n_head_kv, dk, dv, separate V, n_kv): GQA over 300 rows (two splits), and MLA
    // (one latent KV head, V = the first dv values of K).
    for (n_head, n_head_kv, dk, dv, with_v, n_kv) in [
        (8, 2, 64, 64, true, 300),
        (4, 1, 96, 64, false, 33),
        (16, 16, 128, 128, true, 1),
        (4, 1, 576, 512, false, 700),
    ] {
        let q = random(n_head * dk, 300 + n_kv as u64);
        let kf = random(n_kv * n_head_kv * dk, 400 + n_kv as u64);
        let vf = random(n_kv * n_head_kv * dv, 500 + n_kv as u64);
        let (k, v) = (f16_bytes(&kf), f16_bytes(&vf));
        let scale = 1.0 / (dk as f32).sqrt();
        let want = cpu_attention(&q, &k, with_v.then_some(&v[..]), (n_head, n_head_kv, dk, dv), n_kv, scale);
        let n_split = n_kv.div_ceil(256).clamp(1, 32);
        let s = AttnShape {
            n_tokens: 1,
            n_head,
            n_head_kv,
            dk,
            dv,
            k_stride: n_head_kv * dk,
            v_stride: n_head_kv * dv,
            scale,
            n_split,
        };
        let qb = run_f32(&rt, &q);
        let mut kb = rt.alloc::<f16>(kf.len(), "k").unwrap();
        rt.write_bytes(&mut kb, 0, &k).unwrap();
        let mut vb = rt.alloc::<f16>(vf.len(), "v").unwrap();
        rt.write_bytes(&mut vb, 0, &v).unwrap();
        let nb = rt.upload(&[n_kv as i32], "n_kv").unwrap();
        let mut pb = rt.alloc::<f32>(n_head * n_split * (dv + 2), "parts").unwrap();
        let mut ob = rt.alloc::<f32>(n_head * dv, "out").unwrap();
        rt.attention(&qb, &kb, with_v.then_some(&vb), &nb, n_kv, &s, &mut pb, &mut ob).unwrap();
        let got = read_f32(&rt, &ob, n_head * dv);
        check(&format!("attention {n_head}/{n_head_kv} heads dk {dk} dv {dv} over {n_kv} rows"), &got, &want, 5e-3);
    }
}

fn models() -> PathBuf {
    repo().join("tests/fixtures/models")
}

/// tests/logits.rs's rule for f16/quantized weights or an f16 cache: the median position within
/// 2e-2 of max|logit|, the argmax equal wherever the reference's top-2 margin exceeds 4e-2, and
/// equal at >= 95% of positions. Returns a description, or the failure.
fn within_tolerance(got: &[f32], want: &[f32], n_vocab: usize) -> Result<String, String> {
    let tol = 2e-2f32;
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    let mut errs = Vec::new();
    let (mut agree, mut clear, mut clear_agree) = (0, 0, 0);
    let (mut worst, mut at) = (0f32, 0);
    for (i, (g, w)) in got.chunks_exact(n_vocab).zip(want.chunks_exact(n_vocab)).enumerate() {
        let (e, _) = rel_err(g, w);
        if e > worst {
            (worst, at) = (e, i);
        }
        errs.push(e);
        let same = argmax(g) == argmax(w);
        agree += same as usize;
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut s = w.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        if (s[0] - s[1]) / scale > 2.0 * tol {
            clear += 1;
            clear_agree += same as usize;
        }
    }
    errs.sort_by(f32::total_cmp);
    let median = errs[errs.len() / 2];
    let share = agree as f32 / errs.len() as f32;
    let desc = format!(
        "worst {worst:.2e} at position {at}, median {median:.2e}, argmax agrees at {:.1}% ({clear_agree}/{clear} clear)",
        share * 100.0
    );
    if median <= tol && clear_agree == clear && share >= 0.95 && worst.is_finite() {
        Ok(desc)
    } else {
        Err(desc)
    }
}

#[test]
fn the_binary_uses_the_gpu_for_gpu_flags() {
    let Some(_) = gpu("binary") else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = models().join("deepseek2-mla-tiny-Q4_K_M.gguf");
    let m = m.to_str().unwrap();
    let tokens = "1,17,42,99,100,200,300,301,302,7,8,9";
    let run = |flags: &[&str], out: &str| {
        let mut args = vec!["logits", "-m", m, "--tokens", tokens, "--out", out, "-c", "64"];
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
