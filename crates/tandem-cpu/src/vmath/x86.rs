//! The AVX-512 and AVX2 kernels of the f32 vector math: ggml's vector exp, maxima, the
//! softmax's exponentials and sums, SwiGLU.

use std::arch::x86_64::*;

/// ggml's `ggml_v_expf` up to the scaling, on registers of either width (the intrinsics given):
/// `(n, j)` with e^x = j * 2^n, `n` the rounded x / ln 2 and `j` the polynomial of the rest.
macro_rules! exp_poly {
    ($x:expr, $set1:ident, $fmadd:ident, $fnmadd:ident, $sub:ident, $mul:ident) => {{
        let x = $x;
        let r = $set1(f32::from_bits(0x4B40_0000)); // 0x1.8p23
        let z = $fmadd(x, $set1(f32::from_bits(0x3FB8_AA3B)), r); // 0x1.715476p+0
        let n = $sub(z, r);
        let b = $fnmadd(
            n,
            $set1(f32::from_bits(0x35BF_BE8E)),                // 0x1.7f7d1cp-20
            $fnmadd(n, $set1(f32::from_bits(0x3F31_7200)), x), // 0x1.62e4p-1
        );
        let u = $mul(b, b);
        let j = $fmadd(
            $fmadd(
                $fmadd($set1(f32::from_bits(0x3C07_2010)), b, $set1(f32::from_bits(0x3D2B_9F17))),
                u,
                $fmadd($set1(f32::from_bits(0x3E2A_AF33)), b, $set1(f32::from_bits(0x3EFF_FEDB))),
            ),
            u,
            $fmadd($set1(f32::from_bits(0x3F7F_FFF6)), b, $set1(1.0)),
        );
        (n, j)
    }};
}

/// ggml's `ggml_v_expf` (ggml-cpu/vec.h, AVX-512): e^x to about 1 ulp, with the same
/// polynomial llama.cpp's softmax uses.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(crate) unsafe fn expf(x: __m512) -> __m512 {
    let (n, j) = exp_poly!(x, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_sub_ps, _mm512_mul_ps);
    let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
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
    let (n, j) = exp_poly!(x, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_sub_ps, _mm256_mul_ps);
    let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs, _mm256_set1_ps(192.0));
    // 2^n for |n| <= 192 as 2^n1 * 2^(n - n1), n1 = trunc(n / 2): both factors are normal.
    let ni = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-192.0)), _mm256_set1_ps(192.0)));
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let pow2 = |k: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127))));
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
