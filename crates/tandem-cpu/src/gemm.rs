//! f32 matrix products `c += a b` (row-major, any strides) for the decompressed form of MLA
//! attention: each output element is one chain of fused multiply-adds over `k` in order, so the
//! AVX-512, AVX2 and scalar code give the same bits. Register tiles of up to 6 rows by 64 (AVX-512)
//! or 16 (AVX2) columns, `b` read in panels of [`KC`] rows so a panel stays in L2 while every
//! row tile of `a` passes over it.

use crate::vmath::Level;

/// Rows of `b` per panel (the chain of each element goes on across panels through `c`).
const KC: usize = 256;
/// Rows of `a` per register tile.
const MR: usize = 6;

/// Strided matrix operands: `b` and `c` row-major, `a` with any row and column strides.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Between rows of `a`.
    pub lda: usize,
    /// Between columns of `a` (1: row-major; `a` transposed has `lda` 1 and `ka` its row length).
    pub ka: usize,
    pub ldb: usize,
    pub ldc: usize,
}

impl Dims {
    /// Whether `a`, `b`, `c` hold every element the product reads and writes.
    fn fits(&self, a: usize, b: usize, c: usize) -> bool {
        // The last element's index + 1, for `rows` x `cols` with strides `ld` and `step`.
        let need = |rows: usize, ld: usize, cols: usize, step: usize| {
            if rows == 0 || cols == 0 {
                Some(0)
            } else {
                (rows - 1).checked_mul(ld).and_then(|x| x.checked_add((cols - 1).checked_mul(step)?.checked_add(1)?))
            }
        };
        let ok = |n: Option<usize>, have: usize| n.is_some_and(|n| n <= have);
        ok(need(self.m, self.lda, self.k, self.ka), a)
            && ok(need(self.k, self.ldb, self.n, 1), b)
            && ok(need(self.m, self.ldc, self.n, 1), c)
    }
}

/// `c[i * ldc + j] += sum_k a[i * lda + k * ka] * b[k * ldb + j]` for `i < m`, `j < n`, `k < kk`.
///
/// # Panics
/// When a slice is shorter than the dimensions need (the callers size them; a panic is a bug).
pub(crate) fn gemm(d: Dims, a: &[f32], b: &[f32], c: &mut [f32], level: Level) {
    assert!(d.fits(a.len(), b.len(), c.len()), "gemm operands shorter than {}x{}x{}", d.m, d.n, d.k);
    if d.m == 0 || d.n == 0 || d.k == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: the level's instructions are present (Level::detected or a test that checked);
        // `fits` bounded every access.
        unsafe { x86::gemm(d, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), level == Level::Avx2) };
        return;
    }
    let _ = level;
    for k0 in (0..d.k).step_by(KC) {
        let k1 = (k0 + KC).min(d.k);
        for i in 0..d.m {
            let crow = &mut c[i * d.ldc..i * d.ldc + d.n];
            for k in k0..k1 {
                let av = a[i * d.lda + k * d.ka];
                for (cv, bv) in crow.iter_mut().zip(&b[k * d.ldb..k * d.ldb + d.n]) {
                    *cv = av.mul_add(*bv, *cv);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Dims, KC, MR};
    use std::arch::x86_64::*;

    /// Panels of `KC` rows of `b`; within one, column blocks of `W` and row tiles of `MR`.
    ///
    /// # Safety
    /// AVX-512F (or AVX2 and FMA with `avx2`) is present; the pointers hold what `d` describes.
    pub(super) unsafe fn gemm(d: Dims, a: *const f32, b: *const f32, c: *mut f32, avx2: bool) {
        if avx2 {
            // SAFETY: forwarded from the caller.
            unsafe { gemm2(d, a, b, c) };
            return;
        }
        let w = if avx2 { 16 } else { 64 };
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
                    unsafe {
                        if avx2 {
                            by_rows!(rows, tile2(kk, cols, ap, d.lda, d.ka, bp, d.ldb, cp, d.ldc));
                        } else {
                            by_rows!(rows, tile512(kk, cols, ap, d.lda, d.ka, bp, d.ldb, cp, d.ldc));
                        }
                    }
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
                let (lda, ka) = (d.lda, d.ka);
                // SAFETY: tiles inside c and the packed copies (`fits`).
                unsafe {
                    let ct = c.add(i0 * d.ldc);
                    for jb in 0..nb {
                        by_rows!(
                            rows,
                            tile2_full(kk, ta, lda, ka, bp.as_ptr().add(jb * KC * W), W, ct.add(jb * W), d.ldc)
                        );
                    }
                    if nb * W < d.n {
                        let j0 = nb * W;
                        by_rows!(
                            rows,
                            tile2(kk, d.n - j0, ta, lda, ka, b.add(k0 * d.ldb + j0), d.ldb, ct.add(j0), d.ldc)
                        );
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
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_data as rand;

    /// Every level this machine runs gives the scalar code's bits, for tile edges in every
    /// direction, strided operands and several panels of `b`; the scalar code is an f64 product
    /// to rounding.
    #[test]
    fn simd_gemm_has_the_scalar_bits() {
        let mut levels = vec![Level::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let isa = crate::Isa::detected();
            if isa >= crate::Isa::Avx2 {
                levels.push(Level::Avx2);
            } else {
                println!("SKIPPED AVX2 gemm: this machine (or TANDEM_CPU_ISA) does not run it");
            }
            if isa >= crate::Isa::Avx512 {
                levels.push(Level::Avx512);
            } else {
                println!("SKIPPED AVX-512 gemm: this machine (or TANDEM_CPU_ISA) does not run it");
            }
        }
        for &(m, n, k) in
            &[(1, 1, 1), (6, 64, 8), (7, 65, 300), (13, 130, 513), (64, 37, 192), (2, 17, 1000), (5, 200, 3)]
        {
            // Row-major `a`, and `a` stored transposed.
            for (lda, ka) in [(k + 3, 1), (1, m + 2)] {
                let d = Dims { m, n, k, lda, ka, ldb: n + 5, ldc: n + 2 };
                let a = rand(1, (m + 2) * (k + 3));
                let b = rand(2, k * d.ldb);
                let c0 = rand(3, m * d.ldc);
                let mut want = c0.clone();
                gemm(d, &a, &b, &mut want, Level::Scalar);
                for i in 0..m {
                    for j in 0..n {
                        let exact: f64 = c0[i * d.ldc + j] as f64
                            + (0..k).map(|x| a[i * lda + x * ka] as f64 * b[x * d.ldb + j] as f64).sum::<f64>();
                        assert!(
                            (want[i * d.ldc + j] as f64 - exact).abs() < 1e-4 * (k as f64).sqrt(),
                            "{m}x{n}x{k} ({i},{j})"
                        );
                    }
                    // Padding between rows is left alone.
                    for j in n..d.ldc {
                        assert_eq!(want[i * d.ldc + j].to_bits(), c0[i * d.ldc + j].to_bits());
                    }
                }
                for &level in &levels[1..] {
                    let mut got = c0.clone();
                    gemm(d, &a, &b, &mut got, level);
                    assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{level:?} {m}x{n}x{k}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "gemm operands shorter")]
    fn short_operands_are_caught() {
        let d = Dims { m: 2, n: 2, k: 2, lda: 2, ka: 1, ldb: 2, ldc: 2 };
        gemm(d, &[0.0; 3], &[0.0; 4], &mut [0.0; 4], Level::Scalar);
    }

    /// Multiply-adds per second at the shapes of the decompressed MLA attention (keys rebuilt,
    /// scores, weighted values), one thread: `cargo test -p tandem-cpu --release --lib gemm_speed
    /// -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn gemm_speed() {
        let level = Level::detected();
        // The calls of one ubatch of 64 tokens at 3584 rows: the keys rebuilt (a block of 192
        // latent rows times one head's matrix), the scores from the rebuilt and the rotary keys,
        // the weighted values (the probabilities read transposed).
        let shapes = [
            (192, 128, 512, 512, 1, "rebuild"),
            (3584, 64, 128, 128, 1, "scores"),
            (3584, 64, 64, 576, 1, "rope"),
            (64, 128, 3584, 1, 64, "values"),
        ];
        for &(m, n, k, lda, ka, name) in &shapes {
            let d = Dims { m, n, k, lda, ka, ldb: n, ldc: n };
            let (a, b) = (rand(1, m * k.max(lda)), rand(2, k * n));
            let mut c = vec![0f32; m * n];
            let reps = 20;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                gemm(d, &a, &b, &mut c, level);
            }
            let s = t.elapsed().as_secs_f64();
            println!("{level:?} {name} {m}x{n}x{k}: {:.1} GFMA/s", (m * n * k * reps) as f64 / s / 1e9);
        }
    }
}
