//! A block of heads of one token over a run of cached rows: the scores, their softmax (rounded
//! as V's dot type holds the probabilities) and the weighted values, each step by the scalar code
//! here or by the x86 kernels of the level; and cached rows read as f32.

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{Attn, KvType};
use crate::vmath::{exp_sub, max_of, Level};
use half::f16;

/// Heads `hs` (numbered within KV head `kvh`'s group) of one token over all rows; `out` holds
/// their `dv` values each. Each head's result depends on nothing but its own query and the cache.
pub(super) fn heads(a: &Attn, qr: &[f32], kvh: usize, hs: std::ops::Range<usize>, out: &mut [f32], level: Level) {
    let n = hs.len();
    let first = kvh * a.group() + hs.start;
    let q = &qr[first * a.dk..(first + n) * a.dk];
    let stride = a.n_kv.max(1);
    let mut s = vec![0f32; n * stride];
    scores(a, kvh, q, n, 0..a.n_kv, &mut s, stride, level);
    softmax_rows(a.n_kv, &mut s, stride, a.v_type, level);
    weighted_values(a, kvh, &s, n, stride, 0..a.n_kv, out, level);
}

/// Softmax over the first `n_kv` scores of each head's row of `stride` (`s` is `[head][stride]`),
/// then rounded to f16 or bf16 as ggml converts the probabilities for the V product (kept as they
/// are for f32 and q8_0 V rows).
fn softmax_rows(n_kv: usize, s: &mut [f32], stride: usize, v_type: KvType, level: Level) {
    for row in s.chunks_exact_mut(stride.max(1)) {
        let r = &mut row[..n_kv];
        let max = max_of(r, level);
        let inv = (1.0 / exp_sub(r, max, level)) as f32;
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512 {
            // SAFETY: AVX-512 is present.
            unsafe { x86::scale_round(r, inv, v_type) };
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx2 {
            // SAFETY: AVX2 and F16C are present.
            unsafe { x86::scale_round_avx2(r, inv, v_type) };
            continue;
        }
        for v in r.iter_mut() {
            *v = round_p(*v * inv, v_type);
        }
    }
}

/// A probability as V's dot type holds it.
pub(super) fn round_p(p: f32, v_type: KvType) -> f32 {
    match v_type {
        KvType::F16 => f16::from_f32(p).to_f32(),
        KvType::BF16 => tandem_quant::bf16_to_f32(tandem_quant::f32_to_bf16(p)),
        KvType::F32 | KvType::Q8_0 | KvType::Q4_0 => p,
    }
}

/// `s[h * stride + (j - rows.start)] = scale * dot(q_h, k_j)` for the `n` heads of `q` (all
/// sharing K head `kvh`) and the rows given.
#[allow(clippy::too_many_arguments)]
pub(super) fn scores(
    a: &Attn,
    kvh: usize,
    q: &[f32],
    n: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
    level: Level,
) {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar && a.dk.is_multiple_of(16) {
        // SAFETY: the level's instructions are present; `check` bounded every row read below.
        unsafe { x86::scores(a, kvh, q, n, rows, out, stride, level == Level::Avx2) };
        return;
    }
    let mut kf = vec![0f32; a.dk];
    for j in rows.clone() {
        let at = a.k_type.bytes(j * a.k_row + kvh * a.dk);
        row_f32(a.k_type, &a.k[at..at + a.k_type.bytes(a.dk)], &mut kf);
        for (h, qh) in q.chunks_exact(a.dk).take(n).enumerate() {
            out[h * stride + j - rows.start] = dot(qh, &kf) * a.scale;
        }
    }
}

/// `out[h] = sum_j p[h][j] * v_j` over the rows given for the `n` heads of `p` (`out` is
/// `[n][dv]`, overwritten), all reading V head `kvh`.
#[allow(clippy::too_many_arguments)]
pub(super) fn weighted_values(
    a: &Attn,
    kvh: usize,
    p: &[f32],
    n: usize,
    stride: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    level: Level,
) {
    let (v, v_row, v_head) = a.v_rows();
    out.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar && a.dv.is_multiple_of(32) {
        let avx2 = level == Level::Avx2;
        // SAFETY: the level's instructions are present; `check` bounded every row read below.
        unsafe { x86::weighted_values(v, a.v_type, v_row, kvh * v_head, a.dv, p, n, stride, rows, out, avx2) };
        return;
    }
    let mut vf = vec![0f32; a.dv];
    for j in rows.clone() {
        let at = a.v_type.bytes(j * v_row + kvh * v_head);
        row_f32(a.v_type, &v[at..at + a.v_type.bytes(a.dv)], &mut vf);
        for h in 0..n {
            let pj = p[h * stride + j - rows.start];
            for (o, v) in out[h * a.dv..(h + 1) * a.dv].iter_mut().zip(&vf) {
                *o += pj * v;
            }
        }
    }
}

/// Cached values as f32 (`out.len()` of them, whole blocks in `bytes`): ggml's dequantization.
pub(crate) fn row_f32(ty: KvType, bytes: &[u8], out: &mut [f32]) {
    tandem_quant::dequantize_row(ty.ggml(), bytes, out).expect("a cache row is whole blocks of its type");
}

/// f32 dot product in 8 lanes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}
