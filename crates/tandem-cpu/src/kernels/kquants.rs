//! The k-quants (Q2_K..Q6_K) and the IQ1/IQ2/IQ3 grid types against Q8_K activations: the
//! dispatch to their SIMD kernels (`x86/kquants/`; none on other architectures, where the scalar
//! reference of tandem-quant runs) and the tests and benchmarks of those kernels.

/// Most tokens a wide kernel takes.
pub(super) const MAX_WIDE: usize = 64;

/// This architecture's kernel tables, each for `ty` written for exactly `isa`, if any: `lookup`
/// (single-row), `lookup_tile` (multi-row, each of `super::TILE_ROWS`), `lookup_wide` (up to
/// [`MAX_WIDE`] tokens) and `lookup_wide_tile` (more than `MAX_NY`, up to [`MAX_WIDE`] tokens, each
/// of `super::WIDE_TILE_ROWS` rows).
pub(super) use super::arch::kquants::{lookup, lookup_tile, lookup_wide, lookup_wide_tile};

#[cfg(test)]
mod tests {
    use crate::kernels::{kernel, simd_levels, Isa, MAX_NY};
    use tandem_quant::{row_size, vec_dot, GgmlType};

    const TYPES: [GgmlType; 5] = [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

    use crate::testing::Rng;

    /// Offsets of the fp16 factors (d, and dmin where present) in each block.
    fn f16_offsets(ty: GgmlType) -> Vec<usize> {
        use std::mem::offset_of;
        use tandem_quant::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K};
        match ty {
            GgmlType::Q2_K => vec![offset_of!(BlockQ2K, d), offset_of!(BlockQ2K, dmin)],
            GgmlType::Q3_K => vec![offset_of!(BlockQ3K, d)],
            GgmlType::Q4_K => vec![offset_of!(BlockQ4K, d), offset_of!(BlockQ4K, dmin)],
            GgmlType::Q5_K => vec![offset_of!(BlockQ5K, d), offset_of!(BlockQ5K, dmin)],
            _ => vec![offset_of!(BlockQ6K, d)],
        }
    }

    /// Random bit patterns for every level, scale and mask bit; finite fp16 factors in [2^-10, 2^-9).
    fn random_weights(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
        let bytes = row_size(ty, n).unwrap();
        let mut w: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
        let block = bytes / (n / 256);
        for b in w.chunks_exact_mut(block) {
            for o in f16_offsets(ty) {
                let bits = 0x1400u16 | (rng.next_u64() as u16 & 0x03FF) | (rng.next_u64() as u16 & 0x8000);
                b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        w
    }

    /// Q8_K rows with every quant value including -128 (extremes of `vpmaddubsw`), consistent bsums.
    fn random_q8k(n: usize, rows: usize, rng: &mut Rng) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * (n / 256) {
            let d = 0.001 + (rng.next_u64() % 1000) as f32 * 1e-5;
            let qs: Vec<i8> =
                (0..256).map(|_| if rng.next_u64().is_multiple_of(5) { -128 } else { rng.next_u64() as i8 }).collect();
            out.extend_from_slice(&d.to_le_bytes());
            out.extend(qs.iter().map(|&q| q as u8));
            for g in qs.chunks_exact(16) {
                out.extend_from_slice(&g.iter().map(|&q| q as i16).sum::<i16>().to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn random_bit_patterns_match_the_scalar_reference() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        for ty in TYPES {
            for isa in simd_levels(ty).into_iter().filter(|l| l.supported()) {
                let k = kernel(ty, isa).unwrap();
                assert_eq!(k.isa, isa);
                for n in [256, 1024] {
                    let w = random_weights(ty, n, &mut rng);
                    let ys = random_q8k(n, MAX_NY, &mut rng);
                    let yb = ys.len() / MAX_NY;
                    for ny in 1..=MAX_NY {
                        let mut out = vec![0f32; ny];
                        k.run(n, &w, &ys[..ny * yb], &mut out);
                        for (j, got) in out.iter().enumerate() {
                            let want = vec_dot(ty, n, &w, &ys[j * yb..(j + 1) * yb]).unwrap();
                            // Integer sums are exact; only the float combination of blocks differs.
                            let tol = 1e-5 * want.abs().max(1.0);
                            assert!((got - want).abs() <= tol, "{ty} {isa} n={n} ny={ny} row {j}: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn empty_rows_give_zero() {
        for ty in TYPES {
            for isa in simd_levels(ty).into_iter().filter(|l| l.supported()) {
                let mut out = [f32::NAN; 3];
                kernel(ty, isa).unwrap().run(0, &[], &[], &mut out);
                assert_eq!(out, [0.0; 3], "{ty} {isa}");
            }
        }
    }

    #[test]
    fn every_k_quant_has_all_x86_levels() {
        for ty in TYPES {
            let want: Vec<Isa> =
                if cfg!(target_arch = "x86_64") { vec![Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni] } else { vec![] };
            assert_eq!(simd_levels(ty), want, "{ty}");
        }
    }

    /// Single-row against tile kernels on the same rows, weight bytes from L2 (`cargo test -p
    /// tandem-cpu --release tile_throughput -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn tile_throughput() {
        let mut rng = Rng(7);
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
            let n = 7168;
            let rb = row_size(ty, n).unwrap();
            let rows = (512 * 1024 / rb) & !3; // a whole number of tiles of 2 and 4 rows
            let w: Vec<u8> = (0..rows).flat_map(|_| random_weights(ty, n, &mut rng)).collect();
            let ys = if ty == GgmlType::Q8_0 {
                let x: Vec<f32> = (0..n * MAX_NY).map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0).collect();
                crate::quantize_activations(ty, &x, n).unwrap().data
            } else {
                random_q8k(n, MAX_NY, &mut rng)
            };
            let yb = ys.len() / MAX_NY;
            let mut line = format!("{ty} n={n}:");
            for isa in [Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|l| l.supported()) {
                let k = kernel(ty, isa).unwrap();
                if !k.has_tile() {
                    continue;
                }
                for (ny, nr) in [(2usize, 2usize), (2, 4), (4, 2), (4, 4), (6, 2), (6, 4), (8, 2), (8, 4)] {
                    let mut out = vec![0f32; nr * ny];
                    let (mut single, mut tile) = (f64::MAX, f64::MAX);
                    for _ in 0..20 {
                        let t = std::time::Instant::now();
                        for r in w.chunks_exact(rb) {
                            k.run(n, r, &ys[..ny * yb], &mut out[..ny]);
                        }
                        single = single.min(t.elapsed().as_secs_f64());
                        let t = std::time::Instant::now();
                        for r in w.chunks_exact(nr * rb) {
                            k.run_tile(n, r, &ys[..ny * yb], &mut out);
                        }
                        tile = tile.min(t.elapsed().as_secs_f64());
                        std::hint::black_box(&out);
                    }
                    let gb = w.len() as f64 / 1e9;
                    line += &format!("\n  {isa} ny={ny} single {:.2} tile{nr} {:.2} GB/s", gb / single, gb / tile);
                }
            }
            println!("{line}");
        }
    }

    /// A whole Q4_K product on one thread (`matmul`, with tile kernels) against the same row tiles
    /// and token groups with single-row calls only (`cargo test -p tandem-cpu --release
    /// matmul_tile_speedup -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn matmul_tile_speedup() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let mut rng = Rng(9);
        for (rows, n, tokens) in [(512usize, 2048usize, 32usize), (2048, 2048, 256)] {
            let ty = GgmlType::Q4_K;
            let rb = row_size(ty, n).unwrap();
            let w: Vec<u8> = (0..rows).flat_map(|_| random_weights(ty, n, &mut rng)).collect();
            let x: Vec<f32> = (0..n * tokens).map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0).collect();
            let acts = crate::quantize_activations(ty, &x, n).unwrap();
            let wr = crate::WeightRef::new(ty, rows, n, &w).unwrap();
            let k = crate::best_kernel(ty).unwrap();
            let mut y = vec![0f32; rows * tokens];
            let tiled_run = |y: &mut Vec<f32>| crate::matmul_quantized(&pool, &wr, &acts, y).unwrap();
            let single_run = |y: &mut Vec<f32>| {
                let mut tmp = [0f32; MAX_NY];
                for tile in (0..rows).step_by(16) {
                    for t0 in (0..tokens).step_by(MAX_NY) {
                        let nt = MAX_NY.min(tokens - t0);
                        for r in tile..tile + 16 {
                            k.run(
                                n,
                                &w[r * rb..(r + 1) * rb],
                                &acts.data[t0 * acts.row_bytes..(t0 + nt) * acts.row_bytes],
                                &mut tmp[..nt],
                            );
                            for i in 0..nt {
                                y[(t0 + i) * rows + r] = tmp[i];
                            }
                        }
                    }
                }
            };
            let (tiled, single) = crate::fastest_of_two(5, &mut y, tiled_run, single_run);
            let gb = (w.len() * tokens) as f64 / 1e9;
            println!(
                "{ty} {rows}x{n}, {tokens} tokens, {}: single-row {:.1} ms ({:.1} token-GB/s), tiled {:.1} ms ({:.1} token-GB/s)",
                k.isa,
                single * 1e3,
                gb / single,
                tiled * 1e3,
                gb / tiled
            );
        }
    }

    /// Throughput of weight bytes from L2 (`cargo test -p tandem-cpu --release kquant_throughput -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn kquant_throughput() {
        let mut rng = Rng(42);
        for ty in TYPES {
            for n in [2048usize, 7168] {
                let rows = (512 * 1024 / row_size(ty, n).unwrap()).max(1);
                let ws: Vec<Vec<u8>> = (0..rows).map(|_| random_weights(ty, n, &mut rng)).collect();
                let ys = random_q8k(n, MAX_NY, &mut rng);
                let yb = ys.len() / MAX_NY;
                let bytes = (rows * row_size(ty, n).unwrap()) as f64;
                let mut line = format!("{ty} n={n:5}:");
                for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|l| l.supported())
                {
                    let k = kernel(ty, isa).unwrap();
                    for ny in [1usize, 2, 4, 8] {
                        let mut out = vec![0f32; ny];
                        let reps = if isa == Isa::Scalar { 5 } else { 40 };
                        let mut best = f64::MAX;
                        for _ in 0..reps {
                            let t = std::time::Instant::now();
                            for w in &ws {
                                k.run(n, w, &ys[..ny * yb], &mut out);
                            }
                            best = best.min(t.elapsed().as_secs_f64());
                            std::hint::black_box(&out);
                        }
                        line += &format!(" {isa} ny={ny} {:6.2} GB/s", bytes / best / 1e9);
                    }
                }
                println!("{line}");
            }
        }
    }
}
