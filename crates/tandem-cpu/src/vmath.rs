//! f32 vector math shared by the attention ([`mod@crate::attention`]), the decompressed MLA prefill
//! ([`crate::mla`]), the f32 matrix product ([`crate::gemm`]) and the element-wise ops
//! ([`crate::ops`]): the [`Level`] of vector kernels the machine runs, the softmax's maximum and
//! exponentials ([`max_of`], [`exp_sub`]), and in [`x86`] ggml's vector exp (`ggml_v_expf`, on
//! 16 lanes with AVX-512 and with the same bits on 8 with AVX2) and SwiGLU.

use crate::kernels::Isa;

/// Which kernels run: AVX-512, AVX2 (with FMA and F16C) or the scalar code. Each level has its
/// own arithmetic (lane counts); within a level a head's result depends only on its query and the
/// cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Scalar,
    Avx2,
    Avx512,
}

impl Level {
    pub(crate) fn detected() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            let isa = Isa::detected();
            if isa >= Isa::Avx512 {
                return Level::Avx512;
            }
            if isa >= Isa::Avx2 {
                return Level::Avx2;
            }
        }
        Level::Scalar
    }
}

/// The largest of `r` (`f32::max`'s: NaN ignored), in sixteen lanes: the same value as a fold
/// in order (the lanes can differ from it only by the sign of a zero maximum, which no
/// `exp(s - max)` sees), without its chain of one dependent comparison per score.
pub(crate) fn max_of(r: &[f32], level: Level) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 {
        // SAFETY: AVX-512 is present.
        return unsafe { x86::max_of(r) };
    }
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        // SAFETY: AVX2 is present.
        return unsafe { x86::max_of_avx2(r) };
    }
    max_lanes(r)
}

#[inline(always)]
fn max_lanes(r: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let mut c = r.chunks_exact(16);
    for ch in &mut c {
        for (m, v) in m.iter_mut().zip(ch) {
            *m = m.max(*v);
        }
    }
    for (m, v) in m.iter_mut().zip(c.remainder()) {
        *m = m.max(*v);
    }
    m.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `r[i] = exp(r[i] - max)`, returning their sum.
pub(crate) fn exp_sub(r: &mut [f32], max: f32, level: Level) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 {
        // SAFETY: AVX-512 is present.
        return unsafe { x86::exp_sub(r, max) };
    }
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { x86::exp_sub_avx2(r, max) };
    }
    let mut sum = 0f64;
    for v in r.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// ggml's `ggml_v_expf` (ggml-cpu/vec.h, AVX-512): e^x to about 1 ulp, with the same
    /// polynomial llama.cpp's softmax uses.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn expf(x: __m512) -> __m512 {
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

    /// [`super::max_lanes`] compiled for AVX-512.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max_of(r: &[f32]) -> f32 {
        super::max_lanes(r)
    }

    /// [`super::max_lanes`] compiled for AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max_of_avx2(r: &[f32]) -> f32 {
        super::max_lanes(r)
    }

    /// The sum of 16 lanes (`lo` then `hi`) in one fixed order, shared by the AVX-512 and AVX2
    /// softmax so that both give the same bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sum16(lo: __m256, hi: __m256) -> f32 {
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
    }

    /// [`expf`] on 8 lanes with AVX2 and FMA: the same operations, and `scalef` (absent before
    /// AVX-512) as two exact multiplications by powers of two, so every lane gets the bits
    /// [`expf`] gives it (a result below the normal range is rounded once, by the second factor).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn expf8(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(f32::from_bits(0x4B40_0000)); // 0x1.8p23
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3FB8_AA3B)), r); // 0x1.715476p+0
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(f32::from_bits(0x35BF_BE8E)), // 0x1.7f7d1cp-20
            _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3F31_7200)), x), // 0x1.62e4p-1
        );
        let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs, _mm256_set1_ps(192.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(
                    _mm256_set1_ps(f32::from_bits(0x3C07_2010)),
                    b,
                    _mm256_set1_ps(f32::from_bits(0x3D2B_9F17)),
                ),
                u,
                _mm256_fmadd_ps(
                    _mm256_set1_ps(f32::from_bits(0x3E2A_AF33)),
                    b,
                    _mm256_set1_ps(f32::from_bits(0x3EFF_FEDB)),
                ),
            ),
            u,
            _mm256_fmadd_ps(_mm256_set1_ps(f32::from_bits(0x3F7F_FFF6)), b, _mm256_set1_ps(1.0)),
        );
        // 2^n for |n| <= 192 as 2^n1 * 2^(n - n1), n1 = trunc(n / 2): both factors are normal.
        let ni = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-192.0)), _mm256_set1_ps(192.0)));
        let n1 = _mm256_srai_epi32::<1>(ni);
        let n2 = _mm256_sub_epi32(ni, n1);
        let pow2 =
            |k: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127))));
        let res = _mm256_mul_ps(_mm256_mul_ps(j, pow2(n1)), pow2(n2));
        if _mm256_movemask_ps(d) == 0 {
            return res;
        }
        let le0 = _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps());
        let alt = _mm256_blendv_ps(_mm256_set1_ps(f32::INFINITY), _mm256_setzero_ps(), le0);
        _mm256_blendv_ps(res, alt, d)
    }

    /// [`exp_sub`] with AVX2: the same bits.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_sub_avx2(x: &mut [f32], max: f32) -> f64 {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let mut sum = 0f64;
            let m = _mm256_set1_ps(max);
            let mut chunks = x.chunks_exact_mut(16);
            for c in &mut chunks {
                let p = c.as_mut_ptr();
                let lo = expf8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                let hi = expf8(_mm256_sub_ps(_mm256_loadu_ps(p.add(8)), m));
                _mm256_storeu_ps(p, lo);
                _mm256_storeu_ps(p.add(8), hi);
                sum += sum16(lo, hi) as f64;
            }
            for v in chunks.into_remainder() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
            sum
        }
    }

    /// [`swiglu`] with AVX2 and FMA: the same bits (the vector exp of [`expf8`], the tail through
    /// masked loads as well).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let left = (n - i).min(8) as i32;
            let m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            // SAFETY: the mask covers only elements below `n` of both slices.
            unsafe {
                let x = _mm256_maskload_ps(gate.as_ptr().add(i), m);
                let g = _mm256_maskload_ps(up.as_ptr().add(i), m);
                let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
                _mm256_maskstore_ps(gate.as_mut_ptr().add(i), m, _mm256_mul_ps(silu, g));
            }
            i += 8;
        }
    }

    /// `x = e^(x - max)` in place; returns the sum, as `ggml_vec_soft_max_f32` (AVX-512).
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn exp_sub(x: &mut [f32], max: f32) -> f64 {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let mut sum = 0f64;
            let m = _mm512_set1_ps(max);
            let mut chunks = x.chunks_exact_mut(16);
            for c in &mut chunks {
                let v = expf(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m));
                _mm512_storeu_ps(c.as_mut_ptr(), v);
                sum += sum16(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v)) as f64;
            }
            for v in chunks.into_remainder() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
            sum
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uniform;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_swiglu_is_close_to_libm_and_independent_of_position() {
        if !Isa::Avx512.supported() {
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
            assert!(
                (g - want).abs() <= 4.0 * f32::EPSILON * want.abs() + f32::MIN_POSITIVE,
                "silu({x}) * {u} = {g}, libm {want}"
            );
        }
        if Isa::Avx2.supported() {
            let mut got2 = x.clone();
            // SAFETY: AVX2 and FMA checked.
            unsafe { super::x86::swiglu_avx2(&mut got2, &up) };
            assert!(got2.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "AVX2 differs from AVX-512");
        }
        // The same element at another offset (in the masked tail or not) gets the same bits.
        for start in [1usize, 5, 17, 990] {
            let mut part = x[start..].to_vec();
            // SAFETY: as above.
            unsafe { super::x86::swiglu(&mut part, &up[start..]) };
            assert!(part.iter().zip(&got[start..]).all(|(a, b)| a.to_bits() == b.to_bits()), "offset {start}");
        }
    }

    /// The softmax's maximum in lanes, at every level the machine has, is the ordered fold's
    /// value, with NaNs among the scores and at every length of the tail.
    #[test]
    fn the_lane_maximum_is_the_ordered_fold() {
        let mut u = uniform(77);
        for len in (0..70).chain([255, 256, 257, 3072]) {
            for nans in [0, 1, 3] {
                let mut r: Vec<f32> = (0..len).map(|_| u() * 50.0).collect();
                for k in 0..nans.min(len) {
                    r[(k * 7919) % len] = f32::NAN;
                }
                let want = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for level in [Level::Scalar, Level::Avx2, Level::Avx512] {
                    if level > Level::detected() {
                        println!("SKIPPED the {level:?} maximum: this machine lacks it");
                        continue;
                    }
                    let got = max_of(&r, level);
                    assert_eq!(got.to_bits(), want.to_bits(), "len {len}, {nans} NaN, {level:?}: {got} != {want}");
                }
            }
        }
        // All NaN or none: minus infinity, as the fold gives.
        assert_eq!(max_of(&[f32::NAN; 20], Level::detected()), f32::NEG_INFINITY);
        assert_eq!(max_of(&[], Level::detected()), f32::NEG_INFINITY);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_matches_libm_to_a_few_ulp() {
        if !Isa::Avx512.supported() {
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
