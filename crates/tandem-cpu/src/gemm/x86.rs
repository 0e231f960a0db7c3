//! The AVX-512 and AVX2 register tiles of [`super::gemm`]: each output element one chain of
//! fused multiply-adds over `k` in order, as the scalar code adds it.

use super::{Dims, KC, MR};
use std::arch::x86_64::*;

/// With AVX-512, panels of `KC` rows of `b`; within one, column blocks of 64 and row tiles of
/// `MR`. With AVX2 ([`gemm2`]), its own order.
///
/// # Safety
/// AVX-512F (or AVX2 and FMA with `avx2`) is present; the pointers hold what `d` describes.
pub(super) unsafe fn gemm(d: Dims, a: *const f32, b: *const f32, c: *mut f32, avx2: bool) {
    if avx2 {
        // SAFETY: forwarded from the caller.
        unsafe { gemm2(d, a, b, c) };
        return;
    }
    let w = 64;
    for k0 in (0..d.k).step_by(KC) {
        let kk = (k0 + KC).min(d.k) - k0;
        for j0 in (0..d.n).step_by(w) {
            let cols = (d.n - j0).min(w);
            for i0 in (0..d.m).step_by(MR) {
                let rows = (d.m - i0).min(MR);
                // SAFETY: inside the operands (`fits`), as the caller promised.
                let (ap, bp, cp) =
                    unsafe { (a.add(i0 * d.lda + k0 * d.ka), b.add(k0 * d.ldb + j0), c.add(i0 * d.ldc + j0)) };
                // SAFETY: as above; the tile reads `rows` x `kk` of a, `kk` x `cols` of b.
                unsafe { by_rows!(rows, tile512(kk, cols, ap, d.lda, d.ka, bp, d.ldb, cp, d.ldc)) };
            }
        }
    }
}

/// The AVX2 product: per panel of `KC` rows of `b`, its full blocks of 16 columns copied into
/// consecutive rows (its rows are often a page or more apart, one TLB entry each); then each
/// tile of `MR` rows of `a` multiplied by every block while it is in the first-level cache.
/// (Copying the tiles of `a` k-major too was slower: 47 against 54 GFMA/s at the rebuild's
/// shape on Zen 4.)
///
/// # Safety
/// AVX2 and FMA are present; the pointers hold what `d` describes.
unsafe fn gemm2(d: Dims, a: *const f32, b: *const f32, c: *mut f32) {
    const W: usize = 16;
    let nb = d.n / W;
    let mut bp = vec![0f32; KC * nb * W];
    for k0 in (0..d.k).step_by(KC) {
        let kk = (k0 + KC).min(d.k) - k0;
        for jb in 0..nb {
            for k in 0..kk {
                // SAFETY: row k0 + k of b, columns of block jb, inside it (`fits`).
                let src = unsafe { std::slice::from_raw_parts(b.add((k0 + k) * d.ldb + jb * W), W) };
                bp[(jb * KC + k) * W..][..W].copy_from_slice(src);
            }
        }
        for i0 in (0..d.m).step_by(MR) {
            let rows = (d.m - i0).min(MR);
            // SAFETY: inside a (`fits`).
            let ta = unsafe { a.add(i0 * d.lda + k0 * d.ka) };
            let (lda, ka) = (d.lda, d.ka); // the macro's arguments, kept short
                                           // SAFETY: tiles inside c and the packed copies (`fits`).
            unsafe {
                let ct = c.add(i0 * d.ldc);
                for jb in 0..nb {
                    by_rows!(rows, tile2_full(kk, ta, lda, ka, bp.as_ptr().add(jb * KC * W), W, ct.add(jb * W), d.ldc));
                }
                if nb * W < d.n {
                    let j0 = nb * W;
                    by_rows!(rows, tile2(kk, d.n - j0, ta, lda, ka, b.add(k0 * d.ldb + j0), d.ldb, ct.add(j0), d.ldc));
                }
            }
        }
    }
}

/// [`tile2`] for a tile of the full 16 columns: plain loads and stores (AMD's masked moves
/// are slow).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile2_full<const R: usize>(
    kk: usize,
    a: *const f32,
    lda: usize,
    ka: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: the caller upholds this function's `# Safety` contract: R rows of 16 columns.
    unsafe {
        let mut acc: [[__m256; 2]; R] =
            std::array::from_fn(|r| [0, 1].map(|v| _mm256_loadu_ps(c.add(r * ldc + 8 * v))));
        for k in 0..kk {
            let bv = [0, 1].map(|v| _mm256_loadu_ps(b.add(k * ldb + 8 * v)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*a.add(r * lda + k * ka));
                for v in 0..2 {
                    acc[v] = _mm256_fmadd_ps(av, bv[v], acc[v]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, x) in acc.iter().enumerate() {
                _mm256_storeu_ps(c.add(r * ldc + 8 * v), *x);
            }
        }
    }
}

/// Calls `$f::<R>(..)` with the tile's row count `R` (1..=MR) as a constant.
macro_rules! by_rows {
    ($r:expr, $f:ident($($a:expr),*)) => {
        match $r {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            4 => $f::<4>($($a),*),
            5 => $f::<5>($($a),*),
            _ => $f::<6>($($a),*),
        }
    };
}
use by_rows;

/// `R` rows by `cols` (<= 64) columns: four 16-lane vectors per row, masked past `cols`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile512<const R: usize>(
    kk: usize,
    cols: usize,
    a: *const f32,
    lda: usize,
    ka: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let mask = |v: usize| -> u16 {
        let n = cols.saturating_sub(16 * v).min(16);
        ((1u32 << n) - 1) as u16
    };
    let m = [mask(0), mask(1), mask(2), mask(3)];
    // Constant indices only, so the accumulators stay in registers; a narrow tile's unused
    // vectors are masked to nothing (masked-out lanes are neither read nor written).
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for (r, acc) in acc.iter_mut().enumerate() {
        for v in 0..4 {
            // SAFETY: masked to the tile's columns of row r.
            acc[v] = unsafe { _mm512_maskz_loadu_ps(m[v], c.wrapping_add(r * ldc + 16 * v)) };
        }
    }
    for k in 0..kk {
        // SAFETY: masked to the tile's columns of row k of the panel.
        let bv = unsafe { [0, 1, 2, 3].map(|v| _mm512_maskz_loadu_ps(m[v], b.wrapping_add(k * ldb + 16 * v))) };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: element (r, k) of a.
            let av = _mm512_set1_ps(unsafe { *a.wrapping_add(r * lda + k * ka) });
            for v in 0..4 {
                acc[v] = _mm512_fmadd_ps(av, bv[v], acc[v]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for v in 0..4 {
            // SAFETY: masked to the tile's columns of row r.
            unsafe { _mm512_mask_storeu_ps(c.wrapping_add(r * ldc + 16 * v), m[v], acc[v]) };
        }
    }
}

/// `R` rows by `cols` (<= 16) columns: two 8-lane vectors per row, masked past `cols`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile2<const R: usize>(
    kk: usize,
    cols: usize,
    a: *const f32,
    lda: usize,
    ka: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let mask = |v: usize| -> __m256i {
        let n = cols.saturating_sub(8 * v).min(8) as i32;
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane)
    };
    let m = [mask(0), mask(1)];
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for (r, acc) in acc.iter_mut().enumerate() {
        for v in 0..2 {
            // SAFETY: masked to the tile's columns of row r.
            acc[v] = unsafe { _mm256_maskload_ps(c.wrapping_add(r * ldc + 8 * v), m[v]) };
        }
    }
    for k in 0..kk {
        // SAFETY: masked to the tile's columns of row k.
        let bv = unsafe { [0, 1].map(|v| _mm256_maskload_ps(b.wrapping_add(k * ldb + 8 * v), m[v])) };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: element (r, k) of a.
            let av = _mm256_set1_ps(unsafe { *a.wrapping_add(r * lda + k * ka) });
            for v in 0..2 {
                acc[v] = _mm256_fmadd_ps(av, bv[v], acc[v]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for v in 0..2 {
            // SAFETY: masked to the tile's columns of row r.
            unsafe { _mm256_maskstore_ps(c.wrapping_add(r * ldc + 8 * v), m[v], acc[v]) };
        }
    }
}
