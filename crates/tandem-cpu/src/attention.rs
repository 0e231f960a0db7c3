//! Attention of one token over an f16 KV cache, as ggml's non-flash path computes it
//! (`kq = mul_mat(k, q)` with q converted to f16, `soft_max_ext` with the scale, the probabilities
//! converted to f16 for `kqv = mul_mat(v, kq)`), but organized for speed: every cached row is read
//! once for all the heads that share it (all of them under MLA), the rows are split into chunks
//! that run in parallel (flash-decoding style for one token), and the inner loops are AVX-512 when
//! the machine has it.

use crate::kernels::Isa;
use half::f16;
use rayon::prelude::*;

/// Rows per chunk: the unit of parallel work and of the partial sums.
const CHUNK: usize = 256;

/// One token's attention over rows `0..n_kv` of an f16 cache.
pub struct AttnF16<'a> {
    /// `[n_head][dk]`
    pub q: &'a [f32],
    pub n_head: usize,
    pub n_head_kv: usize,
    pub dk: usize,
    pub dv: usize,
    /// K rows, `k_row` f16 values apart; head `kvh` starts at `kvh * dk` in a row.
    pub k: &'a [u8],
    pub k_row: usize,
    /// V rows, `v_row` f16 values apart, head `kvh` at `kvh * dv`; `None`: V is the first `dv`
    /// values of each K head (MLA).
    pub v: Option<&'a [u8]>,
    pub v_row: usize,
    pub n_kv: usize,
    pub scale: f32,
}

impl AttnF16<'_> {
    fn check(&self, out: &[f32]) -> bool {
        let k_need = self.n_kv.saturating_sub(1) * self.k_row + self.n_head_kv * self.dk;
        let (v_bytes, v_row, v_need_head) = match self.v {
            Some(v) => (v.len(), self.v_row, self.n_head_kv * self.dv),
            None => (self.k.len(), self.k_row, (self.n_head_kv - 1) * self.dk + self.dv),
        };
        let v_need = self.n_kv.saturating_sub(1) * v_row + v_need_head;
        self.n_head_kv > 0
            && self.n_head.is_multiple_of(self.n_head_kv)
            && self.q.len() == self.n_head * self.dk
            && out.len() == self.n_head * self.dv
            && (self.v.is_some() || self.dv <= self.dk)
            && (self.n_kv == 0 || (self.k.len() >= 2 * k_need && v_bytes >= 2 * v_need))
    }

    fn group(&self) -> usize {
        self.n_head / self.n_head_kv
    }
}

/// Computes `out` (`[n_head][dv]`) for one token, splitting its rows over `pool`.
pub fn attention_f16(pool: &rayon::ThreadPool, a: &AttnF16, out: &mut [f32]) -> crate::Result<()> {
    if !a.check(out) {
        return Err(crate::Error::Shape(format!(
            "attention of {} heads ({} kv heads, dk {}, dv {}) over {} rows: cache or output too short",
            a.n_head, a.n_head_kv, a.dk, a.dv, a.n_kv
        )));
    }
    let qr = round_q(a.q);
    let n_chunks = a.n_kv.div_ceil(CHUNK);
    if n_chunks <= 1 || pool.current_num_threads() <= 1 {
        one_token(a, &qr, out);
        return Ok(());
    }
    let nh = a.n_head;
    // Scores per chunk: [chunk][head][CHUNK].
    let mut s = vec![0f32; n_chunks * nh * CHUNK];
    pool.install(|| {
        s.par_chunks_mut(nh * CHUNK).enumerate().for_each(|(c, sc)| {
            let rows = c * CHUNK..(c * CHUNK + CHUNK).min(a.n_kv);
            scores(a, &qr, rows, sc, CHUNK);
        })
    });
    softmax_rows(a, &mut s, n_chunks);
    let mut part = vec![0f32; n_chunks * nh * a.dv];
    pool.install(|| {
        part.par_chunks_mut(nh * a.dv).enumerate().for_each(|(c, pc)| {
            let rows = c * CHUNK..(c * CHUNK + CHUNK).min(a.n_kv);
            weighted_values(a, &s[c * nh * CHUNK..(c + 1) * nh * CHUNK], CHUNK, rows, pc);
        })
    });
    out.copy_from_slice(&part[..nh * a.dv]);
    for pc in part.chunks_exact(nh * a.dv).skip(1) {
        for (o, p) in out.iter_mut().zip(pc) {
            *o += p;
        }
    }
    Ok(())
}

/// Several tokens' attention (a micro-batch), one token per task when there are enough of them.
pub fn attention_f16_many(pool: &rayon::ThreadPool, items: &[AttnF16], outs: &mut [&mut [f32]]) -> crate::Result<()> {
    if items.len() < 2 * pool.current_num_threads() {
        for (a, o) in items.iter().zip(outs.iter_mut()) {
            attention_f16(pool, a, o)?;
        }
        return Ok(());
    }
    if let Some((a, _)) = items.iter().zip(outs.iter()).find(|(a, o)| !a.check(o)) {
        return Err(crate::Error::Shape(format!(
            "attention of {} heads over {} rows: cache or output too short",
            a.n_head, a.n_kv
        )));
    }
    pool.install(|| {
        items.par_iter().zip(outs.par_iter_mut()).with_max_len(1).for_each(|(a, o)| one_token(a, &round_q(a.q), o))
    });
    Ok(())
}

/// q rounded to f16, as ggml converts it to the cache's dot type.
fn round_q(q: &[f32]) -> Vec<f32> {
    q.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

/// The whole computation of one token on the calling thread.
fn one_token(a: &AttnF16, qr: &[f32], out: &mut [f32]) {
    let nh = a.n_head;
    let stride = a.n_kv.max(1);
    let mut s = vec![0f32; nh * stride];
    scores(a, qr, 0..a.n_kv, &mut s, stride);
    softmax_rows(a, &mut s, 1);
    weighted_values(a, &s, stride, 0..a.n_kv, out);
}

/// Softmax over each head's scores laid out as `[chunk][head][stride]` (`stride = len / (n_chunks *
/// n_head)`), then rounded to f16 as ggml converts the probabilities for the V product.
fn softmax_rows(a: &AttnF16, s: &mut [f32], n_chunks: usize) {
    let nh = a.n_head;
    let stride = s.len() / (n_chunks * nh).max(1);
    let len = |c: usize| (a.n_kv - c * stride).min(stride);
    #[cfg(target_arch = "x86_64")]
    let simd = Isa::detected() >= Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    for h in 0..nh {
        let mut max = f32::NEG_INFINITY;
        for c in 0..n_chunks {
            let r = &s[(c * nh + h) * stride..][..len(c)];
            max = r.iter().copied().fold(max, f32::max);
        }
        let mut sum = 0f64;
        for c in 0..n_chunks {
            let r = &mut s[(c * nh + h) * stride..][..len(c)];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: AVX-512 is present.
                sum += unsafe { x86::exp_sub(r, max) };
                continue;
            }
            for v in r.iter_mut() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
        }
        let inv = (1.0 / sum) as f32;
        for c in 0..n_chunks {
            let r = &mut s[(c * nh + h) * stride..][..len(c)];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: AVX-512 is present.
                unsafe { x86::scale_round_f16(r, inv) };
                continue;
            }
            for v in r.iter_mut() {
                *v = f16::from_f32(*v * inv).to_f32();
            }
        }
    }
}

/// `s[h * stride + (j - rows.start)] = scale * dot(q_h, k_j)` for the rows given.
fn scores(a: &AttnF16, qr: &[f32], rows: std::ops::Range<usize>, s: &mut [f32], stride: usize) {
    let g = a.group();
    for kvh in 0..a.n_head_kv {
        let q = &qr[kvh * g * a.dk..(kvh + 1) * g * a.dk];
        let out = &mut s[kvh * g * stride..(kvh + 1) * g * stride];
        #[cfg(target_arch = "x86_64")]
        if Isa::detected() >= Isa::Avx512 && a.dk.is_multiple_of(16) {
            // SAFETY: AVX-512 is present; `check` bounded every row read below.
            unsafe { x86::scores(a, kvh, q, g, rows.clone(), out, stride) };
            continue;
        }
        let mut kf = vec![0f32; a.dk];
        for j in rows.clone() {
            let at = 2 * (j * a.k_row + kvh * a.dk);
            f16_row(&a.k[at..at + 2 * a.dk], &mut kf);
            for (h, qh) in q.chunks_exact(a.dk).enumerate() {
                out[h * stride + j - rows.start] = dot(qh, &kf) * a.scale;
            }
        }
    }
}

/// `out[h] += sum_j p[h][j] * v_j` over the rows given (`out` is `[n_head][dv]`, overwritten).
fn weighted_values(a: &AttnF16, p: &[f32], stride: usize, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let g = a.group();
    let (v, v_row, v_head) = match a.v {
        Some(v) => (v, a.v_row, a.dv),
        None => (a.k, a.k_row, a.dk),
    };
    out.fill(0.0);
    for kvh in 0..a.n_head_kv {
        let p = &p[kvh * g * stride..(kvh + 1) * g * stride];
        let o = &mut out[kvh * g * a.dv..(kvh + 1) * g * a.dv];
        #[cfg(target_arch = "x86_64")]
        if Isa::detected() >= Isa::Avx512 && a.dv.is_multiple_of(32) {
            // SAFETY: AVX-512 is present; `check` bounded every row read below.
            unsafe { x86::weighted_values(v, v_row, kvh * v_head, a.dv, p, g, stride, rows.clone(), o) };
            continue;
        }
        let mut vf = vec![0f32; a.dv];
        for j in rows.clone() {
            let at = 2 * (j * v_row + kvh * v_head);
            f16_row(&v[at..at + 2 * a.dv], &mut vf);
            for h in 0..g {
                let pj = p[h * stride + j - rows.start];
                for (o, v) in o[h * a.dv..(h + 1) * a.dv].iter_mut().zip(&vf) {
                    *o += pj * v;
                }
            }
        }
    }
}

fn f16_row(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::AttnF16;
    use std::arch::x86_64::*;

    /// ggml's `ggml_v_expf` (ggml-cpu/vec.h, AVX-512): e^x to about 1 ulp, with the same
    /// polynomial llama.cpp's softmax uses.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn expf(x: __m512) -> __m512 {
        let r = _mm512_set1_ps(f32::from_bits(0x4B40_0000)); // 0x1.8p23
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(f32::from_bits(0x3FB8_AA3B)), r); // 0x1.715476p+0
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(
            n,
            _mm512_set1_ps(f32::from_bits(0x35BF_BE8E)), // 0x1.7f7d1cp-20
            _mm512_fnmadd_ps(n, _mm512_set1_ps(f32::from_bits(0x3F31_7200)), x), // 0x1.62e4p-1
        );
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3C07_2010)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3D2B_9F17)),
                ),
                u,
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3E2A_AF33)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3EFF_FEDB)),
                ),
            ),
            u,
            _mm512_fmadd_ps(_mm512_set1_ps(f32::from_bits(0x3F7F_FFF6)), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero), _mm512_set1_ps(f32::INFINITY), zero);
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// `x = e^(x - max)` in place; returns the sum, as `ggml_vec_soft_max_f32` (AVX-512).
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn exp_sub(x: &mut [f32], max: f32) -> f64 {
        let mut sum = 0f64;
        let m = _mm512_set1_ps(max);
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            let v = expf(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m));
            _mm512_storeu_ps(c.as_mut_ptr(), v);
            sum += _mm512_reduce_add_ps(v) as f64;
        }
        for v in chunks.into_remainder() {
            *v = (*v - max).exp();
            sum += *v as f64;
        }
        sum
    }

    /// `x = f16(x * s)` as f32, rounding to nearest even.
    #[target_feature(enable = "avx512f,avx512dq,f16c")]
    pub(super) unsafe fn scale_round_f16(x: &mut [f32], s: f32) {
        let sv = _mm512_set1_ps(s);
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            let v = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), sv);
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            _mm512_storeu_ps(c.as_mut_ptr(), _mm512_cvtph_ps(h));
        }
        for v in chunks.into_remainder() {
            *v = half::f16::from_f32(*v * s).to_f32();
        }
    }

    /// Scores of `g` heads (q rows of `a.dk`) against K head `kvh` of each row: two rows at a time
    /// against up to eight heads, every K chunk converted once for all of them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    pub(super) unsafe fn scores(
        a: &AttnF16,
        kvh: usize,
        q: &[f32],
        g: usize,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        let dk = a.dk;
        let kp = a.k.as_ptr();
        let row_ptr = |j: usize| unsafe { kp.add(2 * (j * a.k_row + kvh * dk)) };
        let mut h0 = 0;
        while h0 < g {
            let hb = (g - h0).min(8);
            let qb = q.as_ptr().add(h0 * dk);
            let mut j = rows.start;
            while j < rows.end {
                let two = j + 1 < rows.end;
                let (k0, k1) = (row_ptr(j), row_ptr(if two { j + 1 } else { j }));
                let mut acc0 = [_mm512_setzero_ps(); 8];
                let mut acc1 = [_mm512_setzero_ps(); 8];
                let mut d = 0;
                while d < dk {
                    let x0 = _mm512_cvtph_ps(_mm256_loadu_si256(k0.add(2 * d) as *const __m256i));
                    let x1 = _mm512_cvtph_ps(_mm256_loadu_si256(k1.add(2 * d) as *const __m256i));
                    for h in 0..hb {
                        let qv = _mm512_loadu_ps(qb.add(h * dk + d));
                        acc0[h] = _mm512_fmadd_ps(x0, qv, acc0[h]);
                        acc1[h] = _mm512_fmadd_ps(x1, qv, acc1[h]);
                    }
                    d += 16;
                }
                for h in 0..hb {
                    let o = (h0 + h) * stride + j - rows.start;
                    out[o] = _mm512_reduce_add_ps(acc0[h]) * a.scale;
                    if two {
                        out[o + 1] = _mm512_reduce_add_ps(acc1[h]) * a.scale;
                    }
                }
                j += 2;
            }
            h0 += hb;
        }
    }

    /// `o[h] += sum_j p[h][j] v_j` for `g` heads, 32 values of V at a time against up to eight
    /// heads, every V chunk converted once for all of them.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    pub(super) unsafe fn weighted_values(
        v: &[u8],
        v_row: usize,
        head_off: usize,
        dv: usize,
        p: &[f32],
        g: usize,
        stride: usize,
        rows: std::ops::Range<usize>,
        o: &mut [f32],
    ) {
        let vp = v.as_ptr();
        let mut h0 = 0;
        while h0 < g {
            let hb = (g - h0).min(8);
            let mut d = 0;
            while d < dv {
                let mut acc = [[_mm512_setzero_ps(); 2]; 8];
                for j in rows.clone() {
                    let r = vp.add(2 * (j * v_row + head_off + d));
                    let x0 = _mm512_cvtph_ps(_mm256_loadu_si256(r as *const __m256i));
                    let x1 = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32) as *const __m256i));
                    for h in 0..hb {
                        let pj = _mm512_set1_ps(*p.get_unchecked((h0 + h) * stride + j - rows.start));
                        acc[h][0] = _mm512_fmadd_ps(pj, x0, acc[h][0]);
                        acc[h][1] = _mm512_fmadd_ps(pj, x1, acc[h][1]);
                    }
                }
                for h in 0..hb {
                    let dst = o.as_mut_ptr().add((h0 + h) * dv + d);
                    _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[h][0]));
                    _mm512_storeu_ps(dst.add(16), _mm512_add_ps(_mm512_loadu_ps(dst.add(16)), acc[h][1]));
                }
                d += 32;
            }
            h0 += hb;
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_matches_libm_to_a_few_ulp() {
        if !super::Isa::Avx512.supported() {
            println!("AVX-512 not on this machine: vector exp not checked");
            return;
        }
        let xs: Vec<f32> =
            (0..40_000).map(|i| -150.0 + i as f32 * 0.00397).chain([0.0, -0.0, -1e-30, -200.0, -90.0]).collect();
        let mut got = xs.clone();
        // SAFETY: AVX-512 checked above.
        let sum = unsafe { super::x86::exp_sub(&mut got, 0.0) };
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        for ((x, g), w) in xs.iter().zip(&got).zip(&want) {
            assert!((g - w).abs() <= 4.0 * f32::EPSILON * w.abs() + f32::MIN_POSITIVE, "exp({x}) = {g}, libm {w}");
        }
        let want_sum: f64 = want.iter().map(|&v| v as f64).sum();
        assert!((sum - want_sum).abs() <= 1e-5 * want_sum);
    }
}
