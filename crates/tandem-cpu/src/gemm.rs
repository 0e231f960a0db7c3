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
mod x86;

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
