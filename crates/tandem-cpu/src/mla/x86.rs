//! The AVX-512 and AVX2 kernels of the decompressed MLA prefill: the softmax down the columns of
//! a block of scores, one token per lane.

use super::SUM_ROWS;
use crate::vmath::x86::{expf, expf8};
use std::arch::x86_64::*;

/// [`super::softmax_columns`] 16 tokens (AVX-512) or 8 (AVX2) at a time.
///
/// # Safety
/// AVX-512F and DQ (or AVX2 and FMA with `avx2`) are present; `s` is `[rows][n_kv.len()]`.
pub(super) unsafe fn softmax_columns(
    s: &mut [f32],
    n_kv: &[usize],
    scale: f32,
    max: &mut [f32],
    sum: &mut [f64],
    avx2: bool,
) {
    let w = if avx2 { 8 } else { 16 };
    for l0 in (0..n_kv.len()).step_by(w) {
        let l1 = (l0 + w).min(n_kv.len());
        // SAFETY: as the caller promised.
        unsafe {
            if avx2 && l1 - l0 == 8 {
                lanes8::<true>(s, n_kv, l0, l1, scale, &mut max[l0..l1], &mut sum[l0..l1]);
            } else if avx2 {
                lanes8::<false>(s, n_kv, l0, l1, scale, &mut max[l0..l1], &mut sum[l0..l1]);
            } else {
                lanes16(s, n_kv, l0, l1, scale, &mut max[l0..l1], &mut sum[l0..l1]);
            }
        }
    }
}

/// Tokens `l0..l1` (at most 16).
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn lanes16(s: &mut [f32], n_kv: &[usize], l0: usize, l1: usize, scale: f32, max: &mut [f32], sum: &mut [f64]) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let tb = n_kv.len();
        let rows = s.len() / tb;
        let mut lens = [0i32; 16];
        for (l, n) in lens.iter_mut().zip(&n_kv[l0..l1]) {
            *l = (*n).min(rows) as i32;
        }
        let lens = _mm512_loadu_si512(lens.as_ptr().cast());
        let lanes: __mmask16 = ((1u32 << (l1 - l0)) - 1) as u16;
        let sc = _mm512_set1_ps(scale);
        let rows_of = |r: usize| _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(r as i32)) & lanes;
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for r in 0..rows {
            let k = rows_of(r);
            // SAFETY: lanes below l1 of row r.
            let v = _mm512_maskz_loadu_ps(lanes, s.as_ptr().add(r * tb + l0));
            m = _mm512_mask_max_ps(m, k, m, _mm512_mul_ps(v, sc));
        }
        let mut part = _mm512_setzero_ps();
        let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        for r in 0..rows {
            let k = rows_of(r);
            // SAFETY: lanes below l1 of row r.
            {
                let p = s.as_mut_ptr().add(r * tb + l0);
                let v = _mm512_maskz_loadu_ps(lanes, p);
                let e = _mm512_maskz_mov_ps(k, expf(_mm512_sub_ps(_mm512_mul_ps(v, sc), m)));
                _mm512_mask_storeu_ps(p, lanes, e);
                part = _mm512_add_ps(part, e);
            }
            if (r + 1) % SUM_ROWS == 0 || r + 1 == rows {
                lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(part)));
                hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(part)));
                part = _mm512_setzero_ps();
            }
        }
        let (mut mx, mut sl, mut sh) = ([0f32; 16], [0f64; 8], [0f64; 8]);
        _mm512_storeu_ps(mx.as_mut_ptr(), m);
        _mm512_storeu_pd(sl.as_mut_ptr(), lo);
        _mm512_storeu_pd(sh.as_mut_ptr(), hi);
        for (i, (mo, so)) in max.iter_mut().zip(sum.iter_mut()).enumerate() {
            *mo = mx[i];
            *so = if i < 8 { sl[i] } else { sh[i - 8] };
        }
    }
}

/// Tokens `l0..l1` (at most 8): [`lanes16`]'s operations on 8 lanes. With `FULL` (8 tokens) the
/// rows move by plain loads and stores: AMD's masked ones are slow (Zen 3, prefill of 512 tokens
/// at depth 3072: this function 6.3% of the time with them).
#[target_feature(enable = "avx2,fma")]
unsafe fn lanes8<const FULL: bool>(
    s: &mut [f32],
    n_kv: &[usize],
    l0: usize,
    l1: usize,
    scale: f32,
    max: &mut [f32],
    sum: &mut [f64],
) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let tb = n_kv.len();
        let rows = s.len() / tb;
        let mut lens = [0i32; 8];
        for (l, n) in lens.iter_mut().zip(&n_kv[l0..l1]) {
            *l = (*n).min(rows) as i32;
        }
        let lens = _mm256_loadu_si256(lens.as_ptr().cast());
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((l1 - l0) as i32), idx);
        let sc = _mm256_set1_ps(scale);
        let rows_of = |r: usize| _mm256_castsi256_ps(_mm256_cmpgt_epi32(lens, _mm256_set1_epi32(r as i32)));
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for r in 0..rows {
            let k = rows_of(r);
            // SAFETY: lanes below l1 of row r.
            let p = s.as_ptr().add(r * tb + l0);
            let v = if FULL { _mm256_loadu_ps(p) } else { _mm256_maskload_ps(p, lanes) };
            // max(m, x) where the row is attended, as the AVX-512 masked max.
            m = _mm256_blendv_ps(m, _mm256_max_ps(m, _mm256_mul_ps(v, sc)), k);
        }
        let mut part = _mm256_setzero_ps();
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for r in 0..rows {
            let k = rows_of(r);
            // SAFETY: lanes below l1 of row r.
            {
                let p = s.as_mut_ptr().add(r * tb + l0);
                let v = if FULL { _mm256_loadu_ps(p) } else { _mm256_maskload_ps(p, lanes) };
                let e = _mm256_and_ps(k, expf8(_mm256_sub_ps(_mm256_mul_ps(v, sc), m)));
                if FULL {
                    _mm256_storeu_ps(p, e);
                } else {
                    _mm256_maskstore_ps(p, lanes, e);
                }
                part = _mm256_add_ps(part, e);
            }
            if (r + 1) % SUM_ROWS == 0 || r + 1 == rows {
                lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(part)));
                hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(part)));
                part = _mm256_setzero_ps();
            }
        }
        let (mut mx, mut sl, mut sh) = ([0f32; 8], [0f64; 4], [0f64; 4]);
        _mm256_storeu_ps(mx.as_mut_ptr(), m);
        _mm256_storeu_pd(sl.as_mut_ptr(), lo);
        _mm256_storeu_pd(sh.as_mut_ptr(), hi);
        for (i, (mo, so)) in max.iter_mut().zip(sum.iter_mut()).enumerate() {
            *mo = mx[i];
            *so = if i < 4 { sl[i] } else { sh[i - 4] };
        }
    }
}
