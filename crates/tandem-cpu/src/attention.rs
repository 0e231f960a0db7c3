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

/// Computes `out` (`[n_head][dv]`) for one token on `pool`.
///
/// The heads are split over the threads when there are enough of them (every head's arithmetic is
/// then exactly what [`one_token`] does, so a token gets the same bits alone or in a batch, on any
/// number of threads); with fewer heads than threads the rows are split instead, flash-decoding
/// style, with partial sums per chunk of rows.
pub fn attention_f16(pool: &rayon::ThreadPool, a: &AttnF16, out: &mut [f32]) -> crate::Result<()> {
    if !a.check(out) {
        return Err(crate::Error::Shape(format!(
            "attention of {} heads ({} kv heads, dk {}, dv {}) over {} rows: cache or output too short",
            a.n_head, a.n_head_kv, a.dk, a.dv, a.n_kv
        )));
    }
    let qr = round_q(a.q);
    let threads = pool.current_num_threads();
    if threads <= 1 || a.n_kv < 2 * CHUNK {
        one_token(a, &qr, out);
        return Ok(());
    }
    let g = a.group();
    // Heads per unit of work: at most eight (one register block), fewer until every thread has one.
    let mut hb = g.min(8);
    while hb > 1 && a.n_head_kv * g.div_ceil(hb) < threads {
        hb = hb.div_ceil(2);
    }
    if a.n_head_kv * g.div_ceil(hb) >= threads {
        let mut units = Vec::with_capacity(a.n_head_kv * g.div_ceil(hb));
        let mut rest = out;
        for kvh in 0..a.n_head_kv {
            for h0 in (0..g).step_by(hb) {
                let hs = h0..(h0 + hb).min(g);
                let (o, r) = rest.split_at_mut(hs.len() * a.dv);
                units.push((kvh, hs, o));
                rest = r;
            }
        }
        pool.install(|| units.into_par_iter().with_max_len(1).for_each(|(kvh, hs, o)| heads(a, &qr, kvh, hs, o)));
        return Ok(());
    }
    let n_chunks = a.n_kv.div_ceil(CHUNK);
    let nh = a.n_head;
    // Scores per chunk: [chunk][head][CHUNK].
    let mut s = vec![0f32; n_chunks * nh * CHUNK];
    pool.install(|| {
        s.par_chunks_mut(nh * CHUNK).enumerate().for_each(|(c, sc)| {
            let rows = c * CHUNK..(c * CHUNK + CHUNK).min(a.n_kv);
            for kvh in 0..a.n_head_kv {
                let q = &qr[kvh * g * a.dk..(kvh + 1) * g * a.dk];
                scores(a, kvh, q, g, rows.clone(), &mut sc[kvh * g * CHUNK..(kvh + 1) * g * CHUNK], CHUNK);
            }
        })
    });
    softmax_rows(a.n_kv, nh, &mut s, n_chunks);
    let mut part = vec![0f32; n_chunks * nh * a.dv];
    pool.install(|| {
        part.par_chunks_mut(nh * a.dv).enumerate().for_each(|(c, pc)| {
            let rows = c * CHUNK..(c * CHUNK + CHUNK).min(a.n_kv);
            let sc = &s[c * nh * CHUNK..(c + 1) * nh * CHUNK];
            for kvh in 0..a.n_head_kv {
                let p = &sc[kvh * g * CHUNK..(kvh + 1) * g * CHUNK];
                weighted_values(a, kvh, p, g, CHUNK, rows.clone(), &mut pc[kvh * g * a.dv..(kvh + 1) * g * a.dv]);
            }
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
    use half::slice::HalfFloatSliceExt;
    let mut h = vec![f16::ZERO; q.len()];
    h.convert_from_f32_slice(q);
    let mut r = vec![0f32; q.len()];
    h.convert_to_f32_slice(&mut r);
    r
}

/// The whole computation of one token on the calling thread.
fn one_token(a: &AttnF16, qr: &[f32], out: &mut [f32]) {
    let g = a.group();
    for (kvh, o) in out.chunks_exact_mut(g * a.dv).enumerate() {
        heads(a, qr, kvh, 0..g, o);
    }
}

/// Heads `hs` (numbered within KV head `kvh`'s group) of one token over all rows; `out` holds
/// their `dv` values each. Each head's result depends on nothing but its own query and the cache.
fn heads(a: &AttnF16, qr: &[f32], kvh: usize, hs: std::ops::Range<usize>, out: &mut [f32]) {
    let n = hs.len();
    let first = kvh * a.group() + hs.start;
    let q = &qr[first * a.dk..(first + n) * a.dk];
    let stride = a.n_kv.max(1);
    let mut s = vec![0f32; n * stride];
    scores(a, kvh, q, n, 0..a.n_kv, &mut s, stride);
    softmax_rows(a.n_kv, n, &mut s, 1);
    weighted_values(a, kvh, &s, n, stride, 0..a.n_kv, out);
}

/// Softmax over each head's scores laid out as `[chunk][head][stride]` (`stride = len / (n_chunks *
/// n_head)`), then rounded to f16 as ggml converts the probabilities for the V product.
fn softmax_rows(n_kv: usize, nh: usize, s: &mut [f32], n_chunks: usize) {
    let stride = s.len() / (n_chunks * nh).max(1);
    let len = |c: usize| (n_kv - c * stride).min(stride);
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

/// `s[h * stride + (j - rows.start)] = scale * dot(q_h, k_j)` for the `n` heads of `q` (all
/// sharing K head `kvh`) and the rows given.
fn scores(
    a: &AttnF16,
    kvh: usize,
    q: &[f32],
    n: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if Isa::detected() >= Isa::Avx512 && a.dk.is_multiple_of(16) {
        // SAFETY: AVX-512 is present; `check` bounded every row read below.
        unsafe { x86::scores(a, kvh, q, n, rows, out, stride) };
        return;
    }
    let mut kf = vec![0f32; a.dk];
    for j in rows.clone() {
        let at = 2 * (j * a.k_row + kvh * a.dk);
        f16_row(&a.k[at..at + 2 * a.dk], &mut kf);
        for (h, qh) in q.chunks_exact(a.dk).take(n).enumerate() {
            out[h * stride + j - rows.start] = dot(qh, &kf) * a.scale;
        }
    }
}

/// `out[h] = sum_j p[h][j] * v_j` over the rows given for the `n` heads of `p` (`out` is
/// `[n][dv]`, overwritten), all reading V head `kvh`.
fn weighted_values(
    a: &AttnF16,
    kvh: usize,
    p: &[f32],
    n: usize,
    stride: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (v, v_row, v_head) = match a.v {
        Some(v) => (v, a.v_row, a.dv),
        None => (a.k, a.k_row, a.dk),
    };
    out.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if Isa::detected() >= Isa::Avx512 && a.dv.is_multiple_of(32) {
        // SAFETY: AVX-512 is present; `check` bounded every row read below.
        unsafe { x86::weighted_values(v, v_row, kvh * v_head, a.dv, p, n, stride, rows, out) };
        return;
    }
    let mut vf = vec![0f32; a.dv];
    for j in rows.clone() {
        let at = 2 * (j * v_row + kvh * v_head);
        f16_row(&v[at..at + 2 * a.dv], &mut vf);
        for h in 0..n {
            let pj = p[h * stride + j - rows.start];
            for (o, v) in out[h * a.dv..(h + 1) * a.dv].iter_mut().zip(&vf) {
                *o += pj * v;
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
pub(crate) mod x86 {
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

    /// `gate = silu(gate) * up` as `ggml_vec_swiglu_f32` computes it with AVX-512 (`ggml_v_silu`:
    /// `x / (1 + e^-x)` with the vector exp above). The last partial vector goes through the same
    /// vector code (masked), so every element gets the same bits wherever it sits in the buffer.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let m: __mmask16 = if n - i >= 16 { 0xFFFF } else { (1u16 << (n - i)) - 1 };
            // SAFETY: the mask covers only elements below `n` of both slices.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(i));
                let g = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
                let e = expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
                _mm512_mask_storeu_ps(gate.as_mut_ptr().add(i), m, _mm512_mul_ps(silu, g));
            }
            i += 16;
        }
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

    /// Calls `$f::<HB>(...)` with the head count `$hb` (1..=8) as the constant `HB`.
    macro_rules! by_heads {
        ($hb:expr, $f:ident($($a:expr),*)) => {
            match $hb {
                8 => $f::<8>($($a),*),
                7 => $f::<7>($($a),*),
                6 => $f::<6>($($a),*),
                5 => $f::<5>($($a),*),
                4 => $f::<4>($($a),*),
                3 => $f::<3>($($a),*),
                2 => $f::<2>($($a),*),
                _ => $f::<1>($($a),*),
            }
        };
    }

    /// Sums of sixteen vectors: lane `i` of the result is the sum of the lanes of `v[i]`
    /// (15 pairwise steps, each two permutes and an add, instead of sixteen full reductions).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        // Lanes 2i and 2i+1 of every step's inputs always belong to the same original vector, so
        // adding the even lanes to the odd ones halves each vector's partial sums while keeping
        // them together, in order.
        let pair = |a: __m512, b: __m512| {
            _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b))
        };
        let l1: [__m512; 8] = std::array::from_fn(|i| pair(v[2 * i], v[2 * i + 1]));
        let l2: [__m512; 4] = std::array::from_fn(|i| pair(l1[2 * i], l1[2 * i + 1]));
        let l3: [__m512; 2] = std::array::from_fn(|i| pair(l2[2 * i], l2[2 * i + 1]));
        pair(l3[0], l3[1])
    }

    /// The sum of one vector's lanes added in the same order as [`reduce16`] adds them, so that a
    /// score has the same bits whichever way its heads and rows were blocked.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn hsum(v: __m512) -> f32 {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let mut x = v;
        for _ in 0..4 {
            x = _mm512_add_ps(_mm512_permutexvar_ps(even, x), _mm512_permutexvar_ps(odd, x));
        }
        _mm512_cvtss_f32(x)
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
        let mut h0 = 0;
        while h0 < g {
            let hb = (g - h0).min(8);
            let (q, o) = (&q[h0 * a.dk..], &mut out[h0 * stride..]);
            by_heads!(hb, scores_heads(a, kvh, q, rows.clone(), o, stride));
            h0 += hb;
        }
    }

    /// [`scores`] for `HB` heads: the accumulators stay in registers (a loop bound known at
    /// compile time), and with eight heads the sixteen sums of two rows are reduced together.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    unsafe fn scores_heads<const HB: usize>(
        a: &AttnF16,
        kvh: usize,
        q: &[f32],
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        let dk = a.dk;
        let kp = a.k.as_ptr();
        let row_ptr = |j: usize| unsafe { kp.add(2 * (j * a.k_row + kvh * dk)) };
        let qb = q.as_ptr();
        let op = out.as_mut_ptr();
        let mut j = rows.start;
        while j < rows.end {
            let two = j + 1 < rows.end;
            let (k0, k1) = (row_ptr(j), row_ptr(if two { j + 1 } else { j }));
            let mut acc0 = [_mm512_setzero_ps(); HB];
            let mut acc1 = [_mm512_setzero_ps(); HB];
            // The rows stream from memory: ask for the pair eight rows ahead, a cache line per
            // two steps of 16 values (the hardware prefetchers stop at every 4 KiB page).
            let ahead = (j + 8).min(rows.end - 1);
            let (p0, p1) = (row_ptr(ahead), row_ptr((ahead + 1).min(rows.end - 1)));
            let mut d = 0;
            while d < dk {
                if d % 32 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(p0.add(2 * d) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(p1.add(2 * d) as *const i8);
                }
                let x0 = _mm512_cvtph_ps(_mm256_loadu_si256(k0.add(2 * d) as *const __m256i));
                let x1 = _mm512_cvtph_ps(_mm256_loadu_si256(k1.add(2 * d) as *const __m256i));
                for h in 0..HB {
                    let qv = _mm512_loadu_ps(qb.add(h * dk + d));
                    acc0[h] = _mm512_fmadd_ps(x0, qv, acc0[h]);
                    acc1[h] = _mm512_fmadd_ps(x1, qv, acc1[h]);
                }
                d += 16;
            }
            let at = j - rows.start;
            if HB == 8 && two {
                let v: [__m512; 16] = std::array::from_fn(|i| if i < 8 { acc0[i % HB] } else { acc1[i % HB] });
                let mut sums = [0f32; 16];
                _mm512_storeu_ps(sums.as_mut_ptr(), _mm512_mul_ps(reduce16(&v), _mm512_set1_ps(a.scale)));
                for h in 0..8 {
                    *op.add(h * stride + at) = sums[h];
                    *op.add(h * stride + at + 1) = sums[8 + h];
                }
            } else {
                for h in 0..HB {
                    *op.add(h * stride + at) = hsum(acc0[h]) * a.scale;
                    if two {
                        *op.add(h * stride + at + 1) = hsum(acc1[h]) * a.scale;
                    }
                }
            }
            j += 2;
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
        let mut h0 = 0;
        while h0 < g {
            let hb = (g - h0).min(8);
            let (p, o) = (&p[h0 * stride..], &mut o[h0 * dv..]);
            let r = rows.clone();
            by_heads!(hb, values_heads(v, v_row, head_off, dv, p, stride, r, o));
            h0 += hb;
        }
    }

    /// [`weighted_values`] for `HB` heads, accumulators in registers.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    unsafe fn values_heads<const HB: usize>(
        v: &[u8],
        v_row: usize,
        head_off: usize,
        dv: usize,
        p: &[f32],
        stride: usize,
        rows: std::ops::Range<usize>,
        o: &mut [f32],
    ) {
        let vp = v.as_ptr();
        let pp: [*const f32; HB] = std::array::from_fn(|h| p.as_ptr().wrapping_add(h * stride));
        // Blocks of rows small enough to stay in the first-level cache while every 32 values of
        // them are added into the output; the next block is fetched meanwhile.
        const BLOCK: usize = 16;
        let mut b0 = rows.start;
        while b0 < rows.end {
            let b1 = (b0 + BLOCK).min(rows.end);
            let next = b1.min(rows.end - 1)..(b1 + BLOCK).min(rows.end);
            let mut d = 0;
            while d < dv {
                for j in next.clone() {
                    _mm_prefetch::<_MM_HINT_T0>(vp.add(2 * (j * v_row + head_off + d)) as *const i8);
                }
                let mut acc = [[_mm512_setzero_ps(); 2]; HB];
                for j in b0..b1 {
                    let i = j - rows.start;
                    let r = vp.add(2 * (j * v_row + head_off + d));
                    let x0 = _mm512_cvtph_ps(_mm256_loadu_si256(r as *const __m256i));
                    let x1 = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32) as *const __m256i));
                    for h in 0..HB {
                        let pj = _mm512_set1_ps(*pp[h].add(i));
                        acc[h][0] = _mm512_fmadd_ps(pj, x0, acc[h][0]);
                        acc[h][1] = _mm512_fmadd_ps(pj, x1, acc[h][1]);
                    }
                }
                for (h, acc) in acc.iter().enumerate() {
                    let dst = o.as_mut_ptr().add(h * dv + d);
                    _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[0]));
                    _mm512_storeu_ps(dst.add(16), _mm512_add_ps(_mm512_loadu_ps(dst.add(16)), acc[1]));
                }
                d += 32;
            }
            b0 = b1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefill's tokens (each seeing one more row of the same cache, as a causal batch does),
    /// and tokens of another sequence, give in a batch exactly the bits they give one at a time.
    #[test]
    fn a_batch_of_tokens_equals_each_token_alone_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let mut seed = 11u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        // (n_head, n_head_kv, dk, dv, separate V)
        for &(nh, nkv, dk, dv, sep) in &[(16, 1, 576, 512, false), (12, 4, 64, 64, true), (6, 2, 48, 32, true)] {
            let rows = 300;
            let k: Vec<u8> = (0..rows * nkv * dk).flat_map(|_| f16::from_f32(rnd()).to_le_bytes()).collect();
            let v: Vec<u8> = (0..rows * nkv * dv).flat_map(|_| f16::from_f32(rnd()).to_le_bytes()).collect();
            let k2: Vec<u8> = (0..rows * nkv * dk).flat_map(|_| f16::from_f32(rnd()).to_le_bytes()).collect();
            let n_tok = 37;
            let qs: Vec<Vec<f32>> = (0..n_tok).map(|_| (0..nh * dk).map(|_| rnd()).collect()).collect();
            let items: Vec<AttnF16> = (0..n_tok)
                .map(|t| AttnF16 {
                    q: &qs[t],
                    n_head: nh,
                    n_head_kv: nkv,
                    dk,
                    dv,
                    // The last tokens read another cache (another sequence).
                    k: if t < 30 { &k } else { &k2 },
                    k_row: nkv * dk,
                    v: sep.then_some(&v[..]),
                    v_row: nkv * dv,
                    n_kv: if t < 30 { 200 + t } else { 1 + 17 * (t - 30) },
                    scale: 0.125,
                })
                .collect();
            let mut batch = vec![vec![f32::NAN; nh * dv]; n_tok];
            let mut outs: Vec<&mut [f32]> = batch.iter_mut().map(|o| &mut o[..]).collect();
            attention_f16_many(&pool, &items, &mut outs).unwrap();
            for (t, a) in items.iter().enumerate() {
                let mut alone = vec![f32::NAN; nh * dv];
                attention_f16(&one, a, &mut alone).unwrap();
                assert!(
                    batch[t].iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{nh}/{nkv}/{dk}/{dv} token {t}: batch differs from alone"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_swiglu_is_close_to_libm_and_independent_of_position() {
        if !super::Isa::Avx512.supported() {
            println!("AVX-512 not on this machine: vector SwiGLU not checked");
            return;
        }
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).chain([0.0, -90.0, 90.0, -0.0]).collect();
        let up: Vec<f32> = (0..x.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut got = x.clone();
        // SAFETY: AVX-512 checked above.
        unsafe { super::x86::swiglu(&mut got, &up) };
        for ((x, u), g) in x.iter().zip(&up).zip(&got) {
            let want = x / (1.0 + (-x).exp()) * u;
            assert!((g - want).abs() <= 4.0 * f32::EPSILON * want.abs() + f32::MIN_POSITIVE, "silu({x}) * {u} = {g}, libm {want}");
        }
        // The same element at another offset (in the masked tail or not) gets the same bits.
        for start in [1usize, 5, 17, 990] {
            let mut part = x[start..].to_vec();
            // SAFETY: as above.
            unsafe { super::x86::swiglu(&mut part, &up[start..]) };
            assert!(part.iter().zip(&got[start..]).all(|(a, b)| a.to_bits() == b.to_bits()), "offset {start}");
        }
    }

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
