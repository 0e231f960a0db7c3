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
                    by_rows!(
                        rows,
                        tile2_full(kk, W, ta, lda, ka, bp.as_ptr().add(jb * KC * W), W, ct.add(jb * W), d.ldc)
                    );
                }
                if nb * W < d.n {
                    let j0 = nb * W;
                    by_rows!(rows, tile2(kk, d.n - j0, ta, lda, ka, b.add(k0 * d.ldb + j0), d.ldb, ct.add(j0), d.ldc));
                }
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

/// Defines `$name::<R>`: `R` rows by `cols` (<= `$v` x `$lanes`) columns, `$v` vectors of `$lanes`
/// lanes per row, masked past `cols` (masked-out lanes are neither read nor written). `mask(n)`
/// gives the mask of a vector's first `n` lanes, `load(p, m)` and `store(p, m, x)` move one
/// vector. Constant indices only, so the accumulators stay in registers.
macro_rules! masked_tile {
    (
        $(#[$doc:meta])* $name:ident($feat:literal, $v:literal x $lanes:literal, $zero:ident, $set1:ident, $fmadd:ident)
        mask($n:ident) $mask:expr,
        load($lp:ident, $lm:ident) $load:expr,
        store($sp:ident, $sm:ident, $sx:ident) $store:expr
    ) => {
        $(#[$doc])*
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name<const R: usize>(
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
            let m = std::array::from_fn::<_, $v, _>(|v| {
                let $n = cols.saturating_sub($lanes * v).min($lanes);
                $mask
            });
            let mut acc = [[$zero(); $v]; R];
            for (r, acc) in acc.iter_mut().enumerate() {
                for v in 0..$v {
                    let ($lp, $lm) = (c.wrapping_add(r * ldc + $lanes * v), m[v]);
                    // SAFETY: masked to the tile's columns of row r.
                    acc[v] = unsafe { $load };
                }
            }
            for k in 0..kk {
                let bv = std::array::from_fn::<_, $v, _>(|v| {
                    let ($lp, $lm) = (b.wrapping_add(k * ldb + $lanes * v), m[v]);
                    // SAFETY: masked to the tile's columns of row k of the panel.
                    unsafe { $load }
                });
                for (r, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: element (r, k) of a.
                    let av = $set1(unsafe { *a.wrapping_add(r * lda + k * ka) });
                    for v in 0..$v {
                        acc[v] = $fmadd(av, bv[v], acc[v]);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for v in 0..$v {
                    let ($sp, $sm, $sx) = (c.wrapping_add(r * ldc + $lanes * v), m[v], acc[v]);
                    // SAFETY: masked to the tile's columns of row r.
                    unsafe { $store };
                }
            }
        }
    };
}

masked_tile! {
    /// Four 16-lane vectors per row (`cols` <= 64); AVX-512's mask registers.
    tile512("avx512f", 4 x 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_fmadd_ps)
    mask(n) ((1u32 << n) - 1) as u16,
    load(p, m) _mm512_maskz_loadu_ps(m, p),
    store(p, m, x) _mm512_mask_storeu_ps(p, m, x)
}

masked_tile! {
    /// Two 8-lane vectors per row (`cols` <= 16); AVX2's masked moves, a lane mask per vector.
    tile2("avx2,fma", 2 x 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_fmadd_ps)
    mask(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
    load(p, m) _mm256_maskload_ps(p, m),
    store(p, m, x) _mm256_maskstore_ps(p, m, x)
}

masked_tile! {
    /// [`tile2`] for a tile of the full 16 columns (`cols` is 16): plain loads and stores (AMD's
    /// masked moves are slow).
    tile2_full("avx2,fma", 2 x 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_fmadd_ps)
    mask(_n) (),
    load(p, _m) _mm256_loadu_ps(p),
    store(p, _m, x) _mm256_storeu_ps(p, x)
}
