//! Every CUDA kernel against the CPU reference, on the host emulator (kernels/*.cu compiled for
//! the CPU; on every machine, CI included) and on the first GPU when there is one: deterministic
//! random data, the worst error reported with where it is. Kimi K2's real shapes are among the
//! cases (hidden 7168, 64 heads, kv_lora 512, rope 64, 384 experts of 2048 rows, attention over
//! 32K cached rows). `TANDEM_REQUIRE_GPU=1` (scripts/gpu-check.sh) makes a missing GPU a failure.

use tandem_cpu::{Attn, KvType, RopeParams, RopeStyle};
use tandem_cuda::{
    AttnShape, Batched, CacheKind, CopyRows, DeviceBuffer, Gating, GemmPrecision, GgmlType, KvMeta, RouterParams,
    Runtime, MATVEC_TYPES,
};

/// The emulator (it must be built: CI has a C++ compiler), then the first GPU if there is one.
fn runtimes(test: &str) -> Vec<Runtime> {
    let emu = Runtime::emulated().unwrap_or_else(|e| panic!("{test}: {e}"));
    let mut v = vec![emu];
    match Runtime::open(tandem::kernels::images(), 0) {
        Ok(rt) => v.push(rt),
        Err(e) if std::env::var_os("TANDEM_REQUIRE_GPU").is_some_and(|v| v == "1") => {
            panic!("{test}: TANDEM_REQUIRE_GPU=1 but CUDA is unavailable: {e}")
        }
        Err(e) => println!("{test}: no GPU run ({e})"),
    }
    v
}

fn name(rt: &Runtime) -> &'static str {
    if rt.is_emulated() {
        "emulator"
    } else {
        "GPU"
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

/// [`check`] of the first `want.len()` values of `got` on the device, named after the runtime.
fn check_on(rt: &Runtime, what: &str, got: &DeviceBuffer<f32>, want: &[f32], tol: f32) {
    check(&format!("{} {what}", name(rt)), &down(rt, got, want.len()), want, tol);
}

fn up(rt: &Runtime, data: &[f32]) -> DeviceBuffer<f32> {
    rt.upload(data, "test input").unwrap()
}

fn down(rt: &Runtime, b: &DeviceBuffer<f32>, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    rt.read(b, 0, &mut v).unwrap();
    v
}

#[test]
fn rmsnorm_of_strided_rows_matches_cpu() {
    for rt in runtimes("rmsnorm") {
        // Whole rows, Kimi's hidden size, and the latent part of MLA's kv rows (512 of 576).
        for (rows, stride, off, dim) in [(3usize, 1000usize, 0usize, 1000usize), (2, 7168, 0, 7168), (5, 576, 0, 512)] {
            let x = random(rows * stride, 1 + dim as u64);
            let w: Vec<f32> = random(dim, 2).iter().map(|v| v + 1.0).collect();
            let mut want = x.clone();
            want.chunks_exact_mut(stride).for_each(|r| tandem_cpu::rmsnorm(&mut r[off..off + dim], Some(&w), 1e-6));
            let (xb, wb) = (up(&rt, &x), up(&rt, &w));
            rt.rmsnorm(xb.span(off), rows, stride, dim, Some(&wb), 1e-6).unwrap();
            check_on(&rt, &format!("rmsnorm {rows} rows of {dim} in {stride}"), &xb, &want, 1e-5);
        }
    }
}

#[test]
fn rope_matches_cpu_in_both_styles() {
    for rt in runtimes("rope") {
        // q heads of Kimi (64 heads of 192, the last 64 rotated) and a NeoX llama shape.
        for (rows, heads, head_stride, off, n_dims) in
            [(3usize, 64usize, 192usize, 128usize, 64usize), (3, 4, 80, 0, 64)]
        {
            let row_stride = heads * head_stride;
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
                        let at = t * row_stride + h * head_stride + off;
                        tandem_cpu::rope(&mut want[at..at + n_dims], &cs[t * n_dims..(t + 1) * n_dims], style);
                    }
                }
                let (xb, cb) = (up(&rt, &x), up(&rt, &cs));
                rt.rope(
                    xb.span(off),
                    cb.span(0),
                    rows,
                    heads,
                    head_stride,
                    row_stride,
                    n_dims,
                    style == RopeStyle::Neox,
                )
                .unwrap();
                check_on(&rt, &format!("rope {style:?} {heads}x{head_stride}"), &xb, &want, 1e-5);
            }
        }
    }
}

#[test]
fn elementwise_ops_and_strided_copies_match_cpu() {
    for rt in runtimes("elementwise") {
        let n = 70_001;
        let (a, b) = (random(n, 4), random(n, 5));
        let mut want = a.clone();
        tandem_cpu::silu_mul(&mut want, &b);
        let (ab, bb) = (up(&rt, &a), up(&rt, &b));
        rt.swiglu(&ab, &bb, n).unwrap();
        check_on(&rt, "swiglu", &ab, &want, 1e-5);
        let ab = up(&rt, &a);
        rt.add(&ab, &bb, n).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        check_on(&rt, "add", &ab, &want, 1e-6);
        let ab = up(&rt, &a);
        rt.scale_add(&ab, &bb, 0.37, n).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + 0.37 * y).collect();
        check_on(&rt, "scale_add", &ab, &want, 1e-6);
        let ab = up(&rt, &a);
        let scales = [2.0f32, -0.5, 8.0];
        rt.scale_rows(&ab, &up(&rt, &scales), 30_000, n).unwrap();
        let want: Vec<f32> = a.iter().enumerate().map(|(i, x)| x * scales[i / 30_000]).collect();
        check_on(&rt, "scale_rows", &ab, &want, 0.0);
        // The legacy MLA key assembly: the shared rotary part repeated into every head.
        let (tokens, heads, row, width) = (3usize, 4usize, 192usize, 64usize);
        let src = random(tokens * 576, 6);
        let dst = rt.zeros::<f32>(tokens * heads * row, "dst").unwrap();
        let c = CopyRows { rows: tokens * heads, width, src_stride: 576, src_rep: heads, dst_stride: row };
        rt.copy_rows(dst.span(128), up(&rt, &src).span(512), c).unwrap();
        let mut want = vec![0f32; tokens * heads * row];
        for r in 0..tokens * heads {
            let s = (r / heads) * 576 + 512;
            want[r * row + 128..r * row + 128 + width].copy_from_slice(&src[s..s + width]);
        }
        check_on(&rt, "copy_rows", &dst, &want, 0.0);
        // Out of bounds is refused before the launch.
        assert!(rt.copy_rows(dst.span(129), up(&rt, &src).span(512), c).is_err());
    }
}

#[test]
fn router_and_packet_match_moe_route() {
    for rt in runtimes("router") {
        let n_tokens = 7;
        let cases = [
            // Kimi K2: 384 experts, sigmoid, selection bias, one group, 8 used, normalized, scaled.
            (
                RouterParams {
                    n_expert: 384,
                    n_used: 8,
                    gating: Gating::Sigmoid,
                    n_group: 1,
                    n_group_used: 1,
                    norm: true,
                    scale: 2.827,
                },
                true,
            ),
            // DeepSeek V3: 256 experts in 8 groups, the best 4 kept.
            (
                RouterParams {
                    n_expert: 256,
                    n_used: 8,
                    gating: Gating::Sigmoid,
                    n_group: 8,
                    n_group_used: 4,
                    norm: true,
                    scale: 2.5,
                },
                true,
            ),
            // Qwen3-MoE style: softmax, no groups, no bias.
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
        ];
        for (i, (p, with_bias)) in cases.iter().enumerate() {
            let logits: Vec<f32> = random(n_tokens * p.n_expert, 10 + i as u64).iter().map(|v| v * 4.0).collect();
            let bias: Vec<f32> = random(p.n_expert, 20 + i as u64).iter().map(|v| v * 0.1).collect();
            let bias = with_bias.then_some(&bias[..]);
            let lb = up(&rt, &logits);
            let bb = bias.map(|b| up(&rt, b));
            let ids = rt.alloc::<i32>(n_tokens * p.n_used, "ids").unwrap();
            let wb = rt.alloc::<f32>(n_tokens * p.n_used, "weights").unwrap();
            rt.router(&lb, bb.as_ref(), n_tokens, p, &ids, &wb).unwrap();
            let n_embd = 40;
            let shape = tandem_cuda::Packet { n_tokens, n_embd, n_used: p.n_used };
            let h = random(n_tokens * n_embd, 30 + i as u64);
            let packet = rt.alloc::<f32>(n_tokens * shape.row(), "packet").unwrap();
            rt.moe_pack(&up(&rt, &h), &ids, &wb, &packet, shape).unwrap();
            let got = down(&rt, &packet, n_tokens * (n_embd + 2 * p.n_used));
            for (t, row) in got.chunks_exact(n_embd + 2 * p.n_used).enumerate() {
                let want = tandem_model::route(&logits[t * p.n_expert..(t + 1) * p.n_expert], bias, p);
                assert_eq!(&row[..n_embd], &h[t * n_embd..(t + 1) * n_embd], "{} case {i} token {t}: h", name(&rt));
                let got_ids: Vec<usize> = row[n_embd..n_embd + p.n_used].iter().map(|&v| v as usize).collect();
                let want_ids: Vec<usize> = want.iter().map(|&(e, _)| e).collect();
                assert_eq!(got_ids, want_ids, "{} case {i} token {t}: expert ids", name(&rt));
                let want_w: Vec<f32> = want.iter().map(|&(_, w)| w).collect();
                check(&format!("{} router case {i} token {t}", name(&rt)), &row[n_embd + p.n_used..], &want_w, 1e-5);
            }
            // The weighted sum of the experts' outputs, in slot order.
            let y = random(n_tokens * p.n_used * n_embd, 40 + i as u64);
            let out = rt.alloc::<f32>(n_tokens * n_embd, "out").unwrap();
            rt.moe_sum(&up(&rt, &y), &packet, &out, shape).unwrap();
            let mut want = vec![0f32; n_tokens * n_embd];
            for t in 0..n_tokens {
                let w = &got[t * (n_embd + 2 * p.n_used) + n_embd + p.n_used..][..p.n_used];
                for k in 0..p.n_used {
                    for j in 0..n_embd {
                        want[t * n_embd + j] += w[k] * y[(t * p.n_used + k) * n_embd + j];
                    }
                }
            }
            check_on(&rt, &format!("moe_sum case {i}"), &out, &want, 1e-5);
        }
    }
}

/// Random weights of `ty` (quantized by tandem-quant's reference quantizer) and their f32 values.
fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let src = random(rows * cols, seed);
    let row_bytes = tandem_quant::row_size(ty, cols).unwrap();
    let mut q = vec![0u8; rows * row_bytes];
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        let qr = &mut q[r * row_bytes..(r + 1) * row_bytes];
        tandem_quant::quantize_row(ty, &src[r * cols..(r + 1) * cols], qr).unwrap();
        tandem_quant::dequantize_row(ty, qr, &mut deq[r * cols..(r + 1) * cols]).unwrap();
    }
    (q, deq)
}

/// `y[r] = sum_c W[r][c] x[c]` in f64.
fn dot_rows(w: &[f32], x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum::<f64>() as f32).collect()
}

/// The matvec kernels (up to 8 tokens) and the prefill gemms (more), f32 and f16, against the
/// product of the dequantized weight in f64: the matvecs and the f32 gemm to float order, the f16
/// gemm to its rounding.
#[test]
fn matvec_and_prefill_gemm_match_the_dequantized_reference_for_every_type() {
    for mut rt in runtimes("matvec") {
        let (rows, cols) = (67, 512);
        for (i, ty) in MATVEC_TYPES.into_iter().enumerate() {
            assert!(rt.supports(ty), "no matvec kernel for {ty}");
            let (q, deq) = weights(ty, rows + 5, cols, 100 + i as u64);
            let wb = rt.upload(&q, "weights").unwrap();
            // The last `rows` rows, as an expert slice of a 3-D tensor is addressed.
            let offset = 5 * tandem_quant::row_size(ty, cols).unwrap();
            for (n, precision) in
                [(1, GemmPrecision::F32), (3, GemmPrecision::F32), (8, GemmPrecision::F32), (20, GemmPrecision::F32)]
                    .into_iter()
                    .chain([(20, GemmPrecision::F16)])
            {
                rt.set_gemm_precision(precision);
                // Large values on the gemm path: f16 would overflow at 65504 without the scaling.
                let mag = if n > 8 { 3e5 } else { 1.0 };
                let x: Vec<f32> = random(n * cols, 200 + n as u64).iter().map(|v| v * mag).collect();
                let want: Vec<f32> =
                    (0..n).flat_map(|t| dot_rows(&deq[5 * cols..], &x[t * cols..(t + 1) * cols], rows, cols)).collect();
                let xb = up(&rt, &x);
                let yb = rt.alloc::<f32>(n * rows, "y").unwrap();
                rt.matmul(ty, wb.span(offset), &xb, &yb, rows, cols, n).unwrap();
                // The f16 gemm rounds weights and inputs to 11 bits (2-4e-4 here); the rest sums
                // exact products in f32 (1e-7 to 1e-6).
                let tol = if n > 8 && precision == GemmPrecision::F16 && ty != GgmlType::F32 { 1e-3 } else { 5e-6 };
                let what = format!("{} matmul {ty} x {n} tokens ({precision:?})", name(&rt));
                check(&what, &down(&rt, &yb, n * rows), &want, tol);
            }
        }
    }
}

#[test]
fn batched_matvec_runs_per_head_and_per_expert() {
    for rt in runtimes("batched matvec") {
        // MLA's attn_k_b with Kimi's shapes: 64 heads, each [kv_lora 512][nope 128] times its
        // query's first 128 values (heads of 192), out into rows of 576 per head (then q_pe).
        let (nh, kl, nope, dk, dq, n) = (64usize, 512usize, 128usize, 192usize, 576usize, 2usize);
        let (q8, deq) = weights(GgmlType::Q8_0, nh * kl, nope, 7);
        let q = random(n * nh * dk, 8);
        let w = rt.upload(&q8, "k_b").unwrap();
        let y = rt.zeros::<f32>(n * nh * dq, "qcur").unwrap();
        let b = Batched::per_head(n, nh, dk, dq, kl * tandem_quant::row_size(GgmlType::Q8_0, nope).unwrap());
        rt.matvec(GgmlType::Q8_0, w.span(0), up(&rt, &q).span(0), y.span(0), kl, nope, &b).unwrap();
        let got = down(&rt, &y, n * nh * dq);
        let mut want = vec![0f32; n * nh * dq];
        for t in 0..n {
            for h in 0..nh {
                let x = &q[(t * nh + h) * dk..(t * nh + h) * dk + nope];
                let r = dot_rows(&deq[h * kl * nope..(h + 1) * kl * nope], x, kl, nope);
                want[(t * nh + h) * dq..(t * nh + h) * dq + kl].copy_from_slice(&r);
            }
        }
        check(&format!("{} attn_k_b per head (64 x 512 x 128, 2 tokens)", name(&rt)), &got, &want, 2e-2);

        // Routed experts by id: 384 experts of [64][256] (every id reachable), 3 tokens x 8 slots
        // from a packet; an id out of range writes zeros.
        let (ne, rows, cols, nu, nt) = (384usize, 64usize, 256usize, 8usize, 3usize);
        let (qk, deq) = weights(GgmlType::Q4_K, ne * rows, cols, 9);
        let wb = rt.upload(&qk, "experts").unwrap();
        let row = cols + 2 * nu;
        let mut packet = random(nt * row, 10);
        let ids: Vec<usize> = (0..nt * nu).map(|p| (p * 53 + 383) % ne).collect();
        for t in 0..nt {
            for k in 0..nu {
                packet[t * row + cols + k] = ids[t * nu + k] as f32;
            }
        }
        packet[2 * row + cols + 7] = 384.0;
        let pb = up(&rt, &packet);
        let y = rt.alloc::<f32>(nt * nu * rows, "y").unwrap();
        let b = Batched {
            n_tokens: 1,
            n_groups: nt * nu,
            x_tok: 0,
            x_grp: row,
            x_grp_div: nu,
            y_tok: 0,
            y_grp: rows,
            w_grp_bytes: rows * tandem_quant::row_size(GgmlType::Q4_K, cols).unwrap(),
            n_mats: ne,
            ids: Some((pb.span(cols), nu, row)),
        };
        rt.matvec(GgmlType::Q4_K, wb.span(0), pb.span(0), y.span(0), rows, cols, &b).unwrap();
        let got = down(&rt, &y, nt * nu * rows);
        let mut want = vec![0f32; nt * nu * rows];
        for p in 0..nt * nu {
            if p == 2 * nu + 7 {
                continue;
            }
            let e = ids[p];
            let x = &packet[(p / nu) * row..(p / nu) * row + cols];
            want[p * rows..(p + 1) * rows].copy_from_slice(&dot_rows(
                &deq[e * rows * cols..(e + 1) * rows * cols],
                x,
                rows,
                cols,
            ));
        }
        check(&format!("{} 384 experts by id", name(&rt)), &got, &want, 2e-2);

        // One expert of Kimi's real size, [2048][7168] gate, then [7168][2048] down.
        for (rows, cols) in [(2048usize, 7168usize), (7168, 2048)] {
            let (qk, deq) = weights(GgmlType::Q4_K, rows, cols, 11);
            let x = random(cols, 12);
            let y = rt.alloc::<f32>(rows, "y").unwrap();
            rt.matmul(GgmlType::Q4_K, rt.upload(&qk, "w").unwrap().span(0), &up(&rt, &x), &y, rows, cols, 1).unwrap();
            check(
                &format!("{} q4_K {rows} x {cols}", name(&rt)),
                &down(&rt, &y, rows),
                &dot_rows(&deq, &x, rows, cols),
                2e-2,
            );
        }
    }
}

fn cache_bytes(kind: CacheKind, x: &[f32]) -> Vec<u8> {
    let ty = match kind {
        CacheKind::F16 => GgmlType::F16,
        CacheKind::BF16 => GgmlType::BF16,
        CacheKind::Q8_0 => GgmlType::Q8_0,
    };
    let mut out = vec![0u8; tandem_quant::row_size(ty, x.len()).unwrap()];
    tandem_quant::quantize_row(ty, x, &mut out).unwrap();
    out
}

fn kv_type(kind: CacheKind) -> KvType {
    match kind {
        CacheKind::F16 => KvType::F16,
        CacheKind::BF16 => KvType::BF16,
        CacheKind::Q8_0 => KvType::Q8_0,
    }
}

#[test]
fn kv_store_writes_what_the_cpu_cache_holds() {
    for rt in runtimes("kv_store") {
        for kind in [CacheKind::F16, CacheKind::BF16, CacheKind::Q8_0] {
            // Two sequences, two layers of rows of K (576) and V (128), three tokens.
            let (k_w, v_w, cap, layers) = (576usize, 128usize, 10usize, 2usize);
            let (kb, vb) = (kind.bytes(k_w).unwrap(), kind.bytes(v_w).unwrap());
            let row = kb + vb;
            let seqs = [
                rt.zeros::<u8>(layers * cap * row, "seq a").unwrap(),
                rt.zeros::<u8>(layers * cap * row, "seq b").unwrap(),
            ];
            let toks = [(0usize, 3u32), (1, 0), (0, 4)];
            let meta: Vec<f32> = toks
                .iter()
                .flat_map(|&(s, pos)| KvMeta { base: seqs[s].device_ptr(), cap: cap as u32, pos }.to_f32s())
                .collect();
            let mb = rt.upload(&meta, "meta").unwrap();
            let k: Vec<f32> = random(3 * k_w, 20).iter().map(|v| v * 3.0).collect();
            let v = random(3 * v_w, 21);
            rt.kv_store(kind, up(&rt, &k).span(0), k_w, mb.span(0), 3, 1, row, 0, k_w).unwrap();
            rt.kv_store(kind, up(&rt, &v).span(0), v_w, mb.span(0), 3, 1, row, kb, v_w).unwrap();
            let mut got = [vec![0u8; layers * cap * row], vec![0u8; layers * cap * row]];
            for (s, g) in got.iter_mut().enumerate() {
                rt.read(&seqs[s], 0, g).unwrap();
            }
            for (t, &(s, pos)) in toks.iter().enumerate() {
                let at = (cap + pos as usize) * row;
                let want_k = cache_bytes(kind, &k[t * k_w..(t + 1) * k_w]);
                let want_v = cache_bytes(kind, &v[t * v_w..(t + 1) * v_w]);
                assert_eq!(&got[s][at..at + kb], &want_k[..], "{} {kind:?} token {t}: K bytes", name(&rt));
                assert_eq!(&got[s][at + kb..at + row], &want_v[..], "{} {kind:?} token {t}: V bytes", name(&rt));
            }
            // Layer 0 untouched.
            assert!(
                got.iter().all(|g| g[..cap * row].iter().all(|&b| b == 0)),
                "{} {kind:?}: layer 0 written",
                name(&rt)
            );
            println!("{} kv_store {kind:?}: bytes identical to tandem-quant's", name(&rt));
        }
    }
}

/// One attention case: `n_head` query heads over `n_head_kv` KV heads, rows of K (`dk` per head)
/// then V (`dv` per head, or none: V is K's first `dv`), tokens at `positions` of two sequences.
struct Case {
    n_head: usize,
    n_head_kv: usize,
    dk: usize,
    dv: usize,
    separate_v: bool,
    /// (sequence, position) per token.
    tokens: Vec<(usize, usize)>,
    n_split: usize,
}

fn attention_case(rt: &Runtime, kind: CacheKind, c: &Case, tol: f32) {
    let (nh, nkv, dk, dv) = (c.n_head, c.n_head_kv, c.dk, c.dv);
    let k_vals = nkv * dk;
    let v_vals = if c.separate_v { nkv * dv } else { 0 };
    let (kb, vb) = (kind.bytes(k_vals).unwrap(), if c.separate_v { kind.bytes(v_vals).unwrap() } else { 0 });
    let row = kb + vb;
    let rows_of = |s: usize| c.tokens.iter().filter(|t| t.0 == s).map(|t| t.1 + 1).max().unwrap_or(0);
    let layer = 1usize;
    // Host rows per sequence (K rows then V rows), and the device buffers in the [layer][cap] layout.
    let mut host_k = Vec::new();
    let mut host_v = Vec::new();
    let mut bufs = Vec::new();
    for s in 0..2 {
        let n = rows_of(s).max(1);
        let k: Vec<u8> = (0..n).flat_map(|j| cache_bytes(kind, &random(k_vals, 1000 * s as u64 + j as u64))).collect();
        let v: Vec<u8> = match c.separate_v {
            true => {
                (0..n).flat_map(|j| cache_bytes(kind, &random(v_vals, 5000 + 1000 * s as u64 + j as u64))).collect()
            }
            false => Vec::new(),
        };
        let mut dev = vec![0u8; 2 * n * row];
        for j in 0..n {
            let at = (layer * n + j) * row;
            dev[at..at + kb].copy_from_slice(&k[j * kb..(j + 1) * kb]);
            dev[at + kb..at + row].copy_from_slice(&v[j * vb..(j + 1) * vb]);
        }
        bufs.push((rt.upload(&dev, "cache").unwrap(), n));
        host_k.push(k);
        host_v.push(v);
    }
    let meta: Vec<f32> = c
        .tokens
        .iter()
        .flat_map(|&(s, pos)| KvMeta { base: bufs[s].0.device_ptr(), cap: bufs[s].1 as u32, pos: pos as u32 }.to_f32s())
        .collect();
    let n = c.tokens.len();
    // q as the device hands it to the kernels: rounded to the cache's dot type (as the CPU does).
    let q_ty = match kind {
        CacheKind::F16 => GgmlType::F16,
        CacheKind::BF16 => GgmlType::BF16,
        CacheKind::Q8_0 => GgmlType::Q8_0,
    };
    let q = random(n * nh * dk, 77);
    let mut q8 = vec![0u8; tandem_quant::row_size(tandem_quant::vec_dot_type(q_ty), dk).unwrap()];
    let q: Vec<f32> = q
        .chunks_exact(dk)
        .flat_map(|h| {
            let acts = tandem_cpu::quantize_activations(q_ty, h, dk).unwrap();
            q8.copy_from_slice(acts.row(0));
            let mut r = vec![0f32; dk];
            tandem_quant::dequantize_row(acts.ty, &q8, &mut r).unwrap();
            r
        })
        .collect();
    let scale = 1.0 / (dk as f32).sqrt();
    let s = AttnShape { n_tokens: n, n_head: nh, n_head_kv: nkv, dk, dv, scale, n_split: c.n_split };
    let part = rt.alloc::<f32>(n * nh * c.n_split * (dv + 2), "parts").unwrap();
    let out = rt.alloc::<f32>(n * nh * dv, "out").unwrap();
    let max_pos = c.tokens.iter().map(|t| t.1).max().unwrap();
    let v_off = c.separate_v.then_some(kb);
    rt.attention(
        kind,
        &up(rt, &q),
        rt.upload(&meta, "meta").unwrap().span(0),
        max_pos,
        layer,
        row,
        v_off,
        &s,
        &part,
        &out,
    )
    .unwrap();
    let got = down(rt, &out, n * nh * dv);
    let cpu = tandem_cpu::CpuBackend::new(tandem_cpu::Threads::new(2, 2).unwrap());
    let items: Vec<Attn> = c
        .tokens
        .iter()
        .enumerate()
        .map(|(i, &(sq, pos))| Attn {
            q: &q[i * nh * dk..(i + 1) * nh * dk],
            n_head: nh,
            n_head_kv: nkv,
            dk,
            dv,
            k: &host_k[sq],
            k_type: kv_type(kind),
            k_row: k_vals,
            v: c.separate_v.then_some(&host_v[sq][..]),
            v_type: kv_type(kind),
            v_row: if c.separate_v { v_vals } else { k_vals },
            n_kv: pos + 1,
            scale,
        })
        .collect();
    let mut want = vec![0f32; n * nh * dv];
    cpu.attention(&items, &mut want).unwrap();
    let rows: Vec<usize> = c.tokens.iter().map(|t| t.1 + 1).collect();
    check(
        &format!(
            "{} attention {kind:?} {nh}/{nkv} heads dk {dk} dv {dv}, rows {rows:?}, {} splits",
            name(rt),
            c.n_split
        ),
        &got,
        &want,
        tol,
    );
}

#[test]
fn attention_matches_the_cpu_for_every_cache_type_and_shape() {
    for rt in runtimes("attention") {
        for kind in [CacheKind::F16, CacheKind::BF16, CacheKind::Q8_0] {
            // GQA with separate V, a prefill of several tokens of two sequences (causal).
            let gqa = Case {
                n_head: 8,
                n_head_kv: 2,
                dk: 64,
                dv: 64,
                separate_v: true,
                tokens: vec![(0, 0), (0, 1), (0, 299), (1, 5), (1, 130)],
                n_split: 3,
            };
            attention_case(&rt, kind, &gqa, 1e-5);
            // MLA (absorbed): one latent head, V = K's first 512 values; 16 heads in groups of 4.
            let mla = Case {
                n_head: 16,
                n_head_kv: 1,
                dk: 576,
                dv: 512,
                separate_v: false,
                tokens: vec![(0, 0), (0, 17), (1, 700), (0, 40)],
                n_split: 4,
            };
            attention_case(&rt, kind, &mla, 1e-5);
            // MLA with heads the group kernel does not take (not a multiple of 4): the generic one.
            let odd = Case { n_head: 6, ..mla };
            attention_case(&rt, kind, &odd, 1e-5);
        }
    }
}

/// Kimi K2's decode attention: 64 heads over 32K cached f16 latent rows, one token.
#[test]
fn kimi_attention_over_32k_rows() {
    for rt in runtimes("attention 32K") {
        let c = Case {
            n_head: 64,
            n_head_kv: 1,
            dk: 576,
            dv: 512,
            separate_v: false,
            tokens: vec![(0, 32_767)],
            n_split: 32,
        };
        let t = std::time::Instant::now();
        attention_case(&rt, CacheKind::F16, &c, 1e-5);
        println!("{}: {:.1} s", name(&rt), t.elapsed().as_secs_f64());
    }
}

/// Kimi K2's attention output (8192 columns into 7168 rows, Q8_0) with the activations rounded on
/// the device as the CPU rounds them: the product of the rounded values, as tandem-cpu computes it.
#[test]
fn rounded_matvec_at_kimi_attention_output_shape() {
    for rt in runtimes("rounded matvec") {
        let (rows, cols, ty, n) = (7168, 8192, GgmlType::Q8_0, 3);
        let (q, deq) = weights(ty, rows, cols, 41);
        let x: Vec<f32> = random(n * cols, 42).iter().map(|v| v * 3.0).collect();
        let acts = tandem_cpu::quantize_activations(ty, &x, cols).unwrap();
        let mut want = Vec::new();
        for t in 0..n {
            let mut xq = vec![0f32; cols];
            tandem_quant::dequantize_row(acts.ty, acts.row(t), &mut xq).unwrap();
            want.extend(dot_rows(&deq, &xq, rows, cols));
        }
        let (wb, xb) = (rt.upload(&q, "weights").unwrap(), up(&rt, &x));
        let xr = rt.alloc::<f32>(n * cols, "rounded").unwrap();
        assert!(rt.round_acts(ty, xb.span(0), xr.span(0), n, cols, cols, cols).unwrap());
        let yb = rt.alloc::<f32>(n * rows, "y").unwrap();
        rt.matmul(ty, wb.span(0), &xr, &yb, rows, cols, n).unwrap();
        check_on(&rt, &format!("rounded Q8_0 matvec 8192 -> 7168 x {n}"), &yb, &want, 1e-5);
    }
}
