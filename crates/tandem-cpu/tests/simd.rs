//! Every SIMD kernel against the scalar reference (tandem-quant's `vec_dot`, bit-exact with ggml's
//! generic kernels), for every level this machine runs; the levels it cannot run are named in the
//! output (`cargo test -p tandem-cpu --test simd -- --nocapture`).

use tandem_cpu::{kernel, quantize_activations, Isa, MAX_NY};
use tandem_quant::{dequantize_row, quantize_row, row_size, vec_dot, vec_dot_type, GgmlType, VEC_DOT_TYPES};

/// xorshift floats in [-1, 1), some rows scaled so blocks span very different magnitudes.
fn data(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            let scale = match (i / 256) % 4 {
                0 => 1.0,
                1 => 0.01,
                2 => 30.0,
                _ => 0.5,
            };
            v * scale
        })
        .collect()
}

fn weight_row(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
    let mut w = vec![0u8; row_size(ty, n).unwrap()];
    quantize_row(ty, &data(seed, n), &mut w).unwrap();
    w
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
                for ny in 1..=MAX_NY {
                    let mut out = vec![0f32; ny];
                    k.run(n, &w, &acts.data[..ny * acts.row_bytes], &mut out);
                    for (j, got) in out.iter().enumerate() {
                        let want = vec_dot(ty, n, &w, acts.row(j)).unwrap();
                        let mag: f32 = wf.iter().zip(&x[j * n..(j + 1) * n]).map(|(a, b)| (a * b).abs()).sum();
                        let tol = 2e-6 * mag + 1e-6;
                        assert!(
                            (got - want).abs() <= tol,
                            "{ty} {isa} n={n} ny={ny} row {j}: simd {got} scalar {want} (tolerance {tol})"
                        );
                    }
                }
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
    for &ty in VEC_DOT_TYPES.iter() {
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            let k = kernel(ty, isa).unwrap();
            let n = 2048;
            let w = weight_row(ty, n, 3);
            let x = data(9, n * MAX_NY);
            let acts = quantize_activations(ty, &x, n).unwrap();
            let mut alone = vec![0f32; MAX_NY];
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
    }
    bad.dedup();
    assert!(bad.is_empty(), "results change with the rows per call: {bad:?}");
}

/// Kernels read only their own rows: garbage right after a weight row or an activation row must
/// not change the result (rows of a matrix are adjacent in memory).
#[test]
fn kernels_never_read_past_their_rows() {
    let mut bad = Vec::new();
    for &ty in VEC_DOT_TYPES.iter() {
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            let k = kernel(ty, isa).unwrap();
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
    }
    assert!(bad.is_empty(), "{bad:?}");
}
