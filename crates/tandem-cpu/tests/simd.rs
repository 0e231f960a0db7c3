//! Every SIMD kernel against the scalar reference (tandem-quant's `vec_dot`, bit-exact with ggml's
//! generic kernels), for every level this machine runs; the levels it cannot run are named in the
//! output (`cargo test -p tandem-cpu --test simd -- --nocapture`).

use tandem_cpu::testing::check_against_scalar;
use tandem_cpu::{kernel, quantize_activations, Isa, Kernel, MAX_NY};
use tandem_quant::{dequantize_row, quantize_row, row_size, vec_dot, vec_dot_type, GgmlType, VEC_DOT_TYPES};

/// [`data`] with some rows scaled, so that blocks span very different magnitudes.
fn data(seed: u64, n: usize) -> Vec<f32> {
    let scale = [1.0, 0.01, 30.0, 0.5];
    tandem_cpu::testing::data(seed, n).into_iter().enumerate().map(|(i, v)| v * scale[(i / 256) % 4]).collect()
}

fn weight_row(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
    let mut w = vec![0u8; row_size(ty, n).unwrap()];
    if tandem_quant::GRID_TYPES.contains(&ty) {
        grid_row(ty, seed, &mut w);
    } else {
        quantize_row(ty, &data(seed, n), &mut w).unwrap();
    }
    w
}

/// Random blocks of an IQ1/IQ2/IQ3 type (tandem cannot quantize them; every bit pattern is a
/// valid block), each block's fp16 scale set to a modest value of either sign.
fn grid_row(ty: GgmlType, seed: u64, w: &mut [u8]) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in w.iter_mut() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        *b = (s >> 32) as u8;
    }
    for (i, block) in w.chunks_exact_mut(ty.type_size()).enumerate() {
        let d = half::f16::from_f32((0.002 + 0.001 * (i % 7) as f32) * if i % 3 == 1 { -1.0 } else { 1.0 }).to_bits();
        if ty == GgmlType::IQ1_M {
            // The fp16 scale's four nibbles are the top nibbles of the four u16 scale words.
            for k in 0..4 {
                block[48 + 2 * k + 1] = (block[48 + 2 * k + 1] & 0x0F) | ((((d >> (4 * k)) & 0xF) as u8) << 4);
            }
        } else {
            block[..2].copy_from_slice(&d.to_le_bytes());
        }
    }
}

/// Every vec_dot type's kernel at every level this machine runs.
fn runnable_kernels() -> impl Iterator<Item = (GgmlType, Isa, Kernel)> {
    VEC_DOT_TYPES.iter().flat_map(|&ty| {
        Isa::ALL.into_iter().filter(|i| i.supported()).map(move |isa| (ty, isa, kernel(ty, isa).unwrap()))
    })
}

#[test]
fn every_simd_kernel_matches_the_scalar_reference() {
    let mut ran = Vec::new();
    let mut skipped = Vec::new();
    for &ty in VEC_DOT_TYPES.iter() {
        for isa in tandem_cpu::kernels::simd_levels(ty) {
            if !isa.supported() {
                skipped.push(format!("{ty}/{isa}"));
                continue;
            }
            let k = kernel(ty, isa).unwrap();
            assert_eq!(k.isa, isa, "{ty}: asked for {isa}");
            for (case, &n) in [32usize, 64, 96, 128, 160, 192, 256, 320, 512, 576, 2048, 7168].iter().enumerate() {
                if row_size(ty, n).is_err() {
                    continue;
                }
                let w = weight_row(ty, n, 1 + case as u64);
                let wf = {
                    let mut f = vec![0f32; n];
                    dequantize_row(ty, &w, &mut f).unwrap();
                    f
                };
                let x = data(100 + case as u64, n * MAX_NY);
                let acts = quantize_activations(ty, &x, n).unwrap();
                check_against_scalar(&k, n, &w, &wf, &x, &acts);
            }
            ran.push(format!("{ty}/{isa}"));
        }
    }
    println!("SIMD kernels checked against scalar on this machine: {}", ran.join(" "));
    println!(
        "SIMD kernels this machine cannot run (not checked here): {}",
        if skipped.is_empty() { "none".to_string() } else { skipped.join(" ") }
    );
    println!("detected level: {}", Isa::detected());
}

#[test]
fn kernels_never_exceed_the_level_asked_for() {
    for &ty in VEC_DOT_TYPES.iter() {
        for isa in Isa::ALL {
            let k = kernel(ty, isa).unwrap();
            assert!(k.isa <= isa && k.isa.supported(), "{ty}: asked {isa}, got {}", k.isa);
        }
        assert_eq!(kernel(ty, Isa::Scalar).unwrap().isa, Isa::Scalar);
        assert!(row_size(vec_dot_type(ty), 256).is_ok());
    }
}

/// A `TANDEM_CPU_ISA` cap gives the best level at or below it that runs here: AVX-VNNI is no part
/// of the AVX-512 levels, so a cap above it never lands on it unless the machine has it.
#[test]
fn a_cap_gives_the_best_level_at_or_below_it_that_runs() {
    for cap in Isa::ALL {
        let got = Isa::best_within(Some(cap));
        assert!(got <= cap && got.supported(), "cap {cap}: {got}");
        let better = Isa::ALL.into_iter().find(|l| *l > got && *l <= cap && l.supported());
        assert_eq!(better, None, "cap {cap}: {got}");
        assert_eq!(Isa::parse(cap.name()), Some(cap));
    }
    let best = Isa::ALL.into_iter().rev().find(|l| l.supported()).unwrap();
    assert_eq!(Isa::best_within(None), best);
    println!("levels this machine runs: {:?}", Isa::ALL.into_iter().filter(|l| l.supported()).collect::<Vec<_>>());
}

#[test]
#[should_panic(expected = "activation bytes")]
fn a_kernel_refuses_mismatched_lengths() {
    let k = kernel(GgmlType::Q8_0, Isa::detected()).unwrap();
    let w = weight_row(GgmlType::Q8_0, 64, 1);
    k.run(64, &w, &[0u8; 10], &mut [0f32; 1]);
}

/// A token's result must not depend on which other tokens share its kernel call: a sequence
/// decoded alone and inside a batch gives the same logits.
#[test]
fn results_do_not_depend_on_the_number_of_rows_per_call() {
    let mut bad = Vec::new();
    for (ty, _, k) in runnable_kernels() {
        let n = 2048;
        let w = weight_row(ty, n, 3);
        let x = data(9, n * MAX_NY);
        let acts = quantize_activations(ty, &x, n).unwrap();
        let mut alone = [0f32; MAX_NY];
        for j in 0..MAX_NY {
            k.run(n, &w, acts.row(j), &mut alone[j..j + 1]);
        }
        for ny in 2..=MAX_NY {
            for start in 0..=(MAX_NY - ny) {
                let mut out = vec![0f32; ny];
                k.run(n, &w, &acts.data[start * acts.row_bytes..(start + ny) * acts.row_bytes], &mut out);
                if out.iter().zip(&alone[start..start + ny]).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    bad.push(format!("{ty}/{} ny={ny}", k.isa));
                }
            }
        }
    }
    bad.dedup();
    assert!(bad.is_empty(), "results change with the rows per call: {bad:?}");
}

/// Kernels read only their own rows: garbage right after a weight row or an activation row must
/// not change the result (rows of a matrix are adjacent in memory).
#[test]
fn kernels_never_read_past_their_rows() {
    let mut bad = Vec::new();
    for (ty, _, k) in runnable_kernels() {
        for n in (1..=24).map(|i| i * 32).chain([1024, 2048]) {
            let (Ok(wb), Ok(yb)) = (row_size(ty, n), row_size(vec_dot_type(ty), n)) else { continue };
            let w = weight_row(ty, n, 5);
            let x = data(11, n * 2);
            let acts = quantize_activations(ty, &x, n).unwrap();
            let mut clean = [0f32; 2];
            k.run(n, &w, &acts.data, &mut clean);
            // The same bytes followed by garbage.
            let mut wg = w.clone();
            wg.extend(std::iter::repeat_n(0x7Bu8, 256));
            let mut yg = acts.data.clone();
            yg.extend(std::iter::repeat_n(0x7Bu8, 256));
            let mut dirty = [0f32; 2];
            k.run(n, &wg[..wb], &yg[..2 * yb], &mut dirty);
            if clean.iter().zip(&dirty).any(|(a, b)| a.to_bits() != b.to_bits()) {
                bad.push(format!("{ty}/{} n={n}", k.isa));
            }
            let want = vec_dot(ty, n, &w, acts.row(0)).unwrap();
            let mag: f32 = want.abs().max(1.0);
            if (clean[0] - want).abs() > 1e-3 * mag {
                bad.push(format!("{ty}/{} n={n}: {} vs scalar {want}", k.isa, clean[0]));
            }
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}

/// Multi-row (tile) kernels give every (weight row, token) exactly the single-row kernel's result,
/// whatever the tokens per call, and so stay within the scalar reference's tolerance.
#[test]
fn tile_kernels_equal_single_row_kernels_bit_for_bit() {
    let mut ran = Vec::new();
    let mut bad = Vec::new();
    for (ty, isa, k) in runnable_kernels() {
        // Levels without code of their own run the level below, checked there; kernels
        // without a tile kernel check `run_tile`'s single-row fallback.
        if k.isa != isa {
            continue;
        }
        let has_tile = k.has_tile();
        for (case, (n, nr)) in [256usize, 512, 2048, 7168]
            .into_iter()
            .flat_map(|n| tandem_cpu::kernels::TILE_ROWS.map(|nr| (n, nr)))
            .enumerate()
        {
            let Ok(wb) = row_size(ty, n) else { continue };
            let rows: Vec<Vec<u8>> = (0..nr).map(|r| weight_row(ty, n, 40 + (case * 8 + r) as u64)).collect();
            let wfs: Vec<Vec<f32>> = rows
                .iter()
                .map(|row| {
                    let mut f = vec![0f32; n];
                    dequantize_row(ty, row, &mut f).unwrap();
                    f
                })
                .collect();
            let w: Vec<u8> = rows.concat();
            let x = data(200 + case as u64, n * MAX_NY);
            let acts = quantize_activations(ty, &x, n).unwrap();
            let yb = acts.row_bytes;
            for ny in 1..=MAX_NY {
                for start in [0, MAX_NY - ny] {
                    let ys = &acts.data[start * yb..(start + ny) * yb];
                    let mut tile = vec![f32::NAN; nr * ny];
                    k.run_tile(n, &w, ys, &mut tile);
                    for (r, row) in rows.iter().enumerate() {
                        assert_eq!(&w[r * wb..(r + 1) * wb], &row[..]);
                        let mut single = vec![f32::NAN; ny];
                        k.run(n, row, ys, &mut single);
                        for j in 0..ny {
                            let got = tile[r * ny + j];
                            let mut alone = [f32::NAN];
                            k.run(n, row, acts.row(start + j), &mut alone);
                            if got.to_bits() != single[j].to_bits() || got.to_bits() != alone[0].to_bits() {
                                bad.push(format!(
                                    "{ty}/{} n={n} ny={ny} row {r} token {j}: tile {got} single {} alone {}",
                                    k.isa, single[j], alone[0]
                                ));
                            }
                            let want = vec_dot(ty, n, row, acts.row(start + j)).unwrap();
                            let wf = &wfs[r];
                            let xj = &x[(start + j) * n..(start + j + 1) * n];
                            let mag: f32 = wf.iter().zip(xj).map(|(a, b)| (a * b).abs()).sum();
                            let tol = 2e-6 * mag + 1e-6;
                            if (got - want).abs() > tol {
                                bad.push(format!(
                                        "{ty}/{} n={n} ny={ny} row {r} token {j}: tile {got} scalar {want} (tolerance {tol})",
                                        k.isa
                                    ));
                            }
                        }
                    }
                }
            }
        }
        if has_tile {
            ran.push(format!("{ty}/{}", k.isa));
        }
    }
    println!("tile kernels checked on this machine: {}", ran.join(" "));
    assert!(bad.is_empty(), "{} mismatches, first: {:?}", bad.len(), &bad[..bad.len().min(5)]);
}

/// The k-quants have tile kernels at every x86 level (where this machine runs them). The
/// IQ1/IQ2/IQ3 types have none for up to 8 tokens: their unpacking needs the registers, and one
/// row at a time with 8 tokens was faster (prefill of 256 tokens on their bench models, Zen 5);
/// their multi-row kernels are wide ones (more than 8 tokens).
#[test]
fn k_quants_have_tile_kernels() {
    for ty in tandem_quant::GRID_TYPES {
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            assert!(!kernel(ty, isa).unwrap().has_tile(), "{ty}/{isa} has a tile kernel");
        }
    }
    for ty in [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        for isa in [Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|i| i.supported()) {
            let k = kernel(ty, isa).unwrap();
            assert!(k.has_tile(), "{ty}/{isa} has no tile kernel");
            assert!(k.tile_rows(MAX_NY - 1).is_some(), "{ty}/{isa}: prefill does not use the tile kernel");
            assert_eq!(k.tile_rows(1), None, "{ty}/{isa}: decode keeps the single-row kernel");
        }
    }
}

/// A tile kernel refuses a weight buffer that is not a whole number of its rows.
#[test]
#[should_panic(expected = "tile kernel")]
fn a_tile_kernel_refuses_mismatched_lengths() {
    let k = kernel(GgmlType::Q4_K, Isa::detected()).unwrap();
    let w = [weight_row(GgmlType::Q4_K, 256, 1), weight_row(GgmlType::Q4_K, 256, 2)].concat();
    let acts = quantize_activations(GgmlType::Q4_K, &data(1, 256), 256).unwrap();
    k.run_tile(256, &w[..w.len() - 1], &acts.data, &mut [0f32; 2]);
}

/// A batched product (tile kernels over row tiles, single-row kernels for the remaining rows and
/// tokens, wide kernels for the grid types) gives every (row, token) exactly what one single-row
/// call on that token gives.
#[test]
fn batched_matmul_equals_one_token_at_a_time_bit_for_bit() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    // IQ1_S and IQ2_XXS: wide kernels (more than 8 tokens per call), with two rows per call at the
    // `avx512vbmi` level.
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::IQ1_S, GgmlType::IQ2_XXS] {
        let k = tandem_cpu::best_kernel(ty).unwrap();
        // Row counts with tails after tiles of 4 and 2; token counts with tails after groups of 8.
        for (rows, tokens) in [(37usize, 13usize), (16, 8), (6, 3), (5, 17)] {
            let n = 512;
            let rb = row_size(ty, n).unwrap();
            let w: Vec<u8> = (0..rows).flat_map(|r| weight_row(ty, n, 300 + r as u64)).collect();
            let x = data(77, n * tokens);
            let wr = tandem_cpu::WeightRef::new(ty, rows, n, &w).unwrap();
            let mut y = vec![f32::NAN; tokens * rows];
            tandem_cpu::matmul(&pool, &wr, &x, &mut y).unwrap();
            let acts = quantize_activations(ty, &x, n).unwrap();
            for t in 0..tokens {
                for r in 0..rows {
                    let mut one = [f32::NAN];
                    k.run(n, &w[r * rb..(r + 1) * rb], acts.row(t), &mut one);
                    assert_eq!(
                        y[t * rows + r].to_bits(),
                        one[0].to_bits(),
                        "{ty}/{} {rows} rows x {tokens} tokens: row {r} token {t}: {} vs {}",
                        k.isa,
                        y[t * rows + r],
                        one[0]
                    );
                }
            }
        }
    }
}

/// The IQ1/IQ2/IQ3 kernels at the extremes of their levels: blocks of all-ones, all-zero and
/// random bytes against activations all at +127, all at -127 and alternating, where a kernel
/// that summed four products of levels above 63 in an i16 would saturate.
#[test]
fn grid_type_kernels_do_not_saturate_at_the_extreme_levels() {
    let n = 512;
    let acts_f32: Vec<f32> = (0..n * 3)
        .map(|i| match i / n {
            0 => 1.0,
            1 => -1.0,
            _ => {
                if (i / 3) % 2 == 0 {
                    1.0
                } else {
                    -1.0
                }
            }
        })
        .collect();
    for ty in tandem_quant::GRID_TYPES {
        let acts = quantize_activations(ty, &acts_f32, n).unwrap();
        for fill in [Some(0xFFu8), Some(0x00), None] {
            let mut w = vec![fill.unwrap_or(0); row_size(ty, n).unwrap()];
            if fill.is_none() {
                grid_row(ty, 77, &mut w);
            }
            for block in w.chunks_exact_mut(ty.type_size()) {
                if ty == GgmlType::IQ1_M {
                    // d = 1.0 (0x3c00) in the top nibbles of the scale words.
                    for (k, nib) in [0x0u8, 0x0, 0xc, 0x3].into_iter().enumerate() {
                        block[48 + 2 * k + 1] = (block[48 + 2 * k + 1] & 0x0F) | (nib << 4);
                    }
                } else {
                    block[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
                }
            }
            for isa in tandem_cpu::kernels::simd_levels(ty).into_iter().filter(|l| l.supported()) {
                let k = kernel(ty, isa).unwrap();
                for j in 0..3 {
                    let a = &acts.data[j * acts.row_bytes..(j + 1) * acts.row_bytes];
                    let want = vec_dot(ty, n, &w, a).unwrap();
                    let mut got = [0f32];
                    k.run(n, &w, a, &mut got);
                    let tol = 1e-5 * want.abs().max(1.0);
                    assert!((got[0] - want).abs() <= tol, "{ty}/{isa} fill {fill:?} row {j}: {} vs {want}", got[0]);
                }
            }
        }
    }
}

/// The wide kernels (up to MAX_WIDE tokens per call: the IQ1/IQ2/IQ3 types) give each token the
/// bits of the single-row kernel called 8 tokens at a time, and their multi-row versions (two or
/// four weight rows per call, at the `avx512vbmi` level) give each row the bits of the single-row
/// wide kernel.
#[test]
fn wide_kernels_equal_eight_tokens_at_a_time_bit_for_bit() {
    let n = 512;
    let mut ran = Vec::new();
    let mut tiled = Vec::new();
    for ty in tandem_quant::GRID_TYPES {
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            let k = kernel(ty, isa).unwrap();
            if k.max_tokens() == MAX_NY || k.isa != isa {
                continue;
            }
            assert_eq!(k.max_tokens(), tandem_cpu::MAX_WIDE);
            ran.push(format!("{ty}/{}", k.isa));
            let w = weight_row(ty, n, 9);
            let x = data(200, n * tandem_cpu::MAX_WIDE);
            let acts = quantize_activations(ty, &x, n).unwrap();
            for ny in [9, 24, tandem_cpu::MAX_WIDE] {
                let mut wide = vec![0f32; ny];
                k.run(n, &w, &acts.data[..ny * acts.row_bytes], &mut wide);
                for t0 in (0..ny).step_by(MAX_NY) {
                    let nt = MAX_NY.min(ny - t0);
                    let mut narrow = vec![0f32; nt];
                    k.run(n, &w, &acts.data[t0 * acts.row_bytes..(t0 + nt) * acts.row_bytes], &mut narrow);
                    for (i, v) in narrow.iter().enumerate() {
                        assert_eq!(v.to_bits(), wide[t0 + i].to_bits(), "{ty}/{isa}: {ny} tokens, token {}", t0 + i);
                    }
                }
            }
            if k.tile_rows(MAX_NY + 1).is_none() {
                continue;
            }
            assert_eq!(k.tile_rows(MAX_NY + 1), Some(tandem_cpu::kernels::WIDE_TILE_ROWS));
            tiled.push(format!("{ty}/{}", k.isa));
            for nr in [2, 4] {
                let rows: Vec<Vec<u8>> = (0..nr).map(|r| weight_row(ty, n, 30 + r as u64)).collect();
                let wt = rows.concat();
                for ny in [9, 24, tandem_cpu::MAX_WIDE] {
                    let ys = &acts.data[..ny * acts.row_bytes];
                    let mut tile = vec![f32::NAN; nr * ny];
                    k.run_tile(n, &wt, ys, &mut tile);
                    for (r, row) in rows.iter().enumerate() {
                        let mut one = vec![f32::NAN; ny];
                        k.run(n, row, ys, &mut one);
                        for (j, v) in one.iter().enumerate() {
                            let got = tile[r * ny + j];
                            assert_eq!(
                                got.to_bits(),
                                v.to_bits(),
                                "{ty}/{isa}: {nr} rows, {ny} tokens, row {r} token {j}"
                            );
                        }
                    }
                }
            }
        }
    }
    println!("wide kernels checked on this machine: {}", if ran.is_empty() { "none".into() } else { ran.join(" ") });
    println!(
        "multi-row wide kernels checked on this machine: {}",
        if tiled.is_empty() { "none".into() } else { tiled.join(" ") }
    );
}
