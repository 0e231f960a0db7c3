//! vec_dot bit-exact with ggml's scalar kernels (fixtures of scripts/gen_quant_fixtures.py),
//! within a tolerance of ggml's SIMD kernels, and against dequantize(weights) .
//! dequantize(activations) computed in f64.
//!
//! Tolerance: |vec_dot - exact| <= 1e-5 * sum_i |w_i * a_i|, where w and a are the dequantized
//! rows. ggml accumulates per-block terms in f32 (n/32 or n/256 terms, each a product of two or
//! three rounded f32 factors), so its error is a few f32 ulps of that magnitude — far below 1e-5.
//! Q4_1 and Q5_1 get one more term: their kernel uses the activation's stored fp16 block sum
//! `s = fp16(d * sum q)` rather than the exact sum; the test allows one fp16 ulp of s per block,
//! 2^-10 |m_b * s_b| (rounding costs at most half of that).

mod common;

use common::Rng;
use tandem_quant::{dequantize_row, quantize_row, row_size, vec_dot, vec_dot_type, GgmlType, VEC_DOT_TYPES};

const REL_TOL: f64 = 1e-5;

/// fp16 at byte `at` of `b`, as f64.
fn f16_at(b: &[u8], at: usize) -> f64 {
    tandem_quant::fp16_to_f32(half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))) as f64
}

/// Weights of one trial: Gaussian rows with a per-trial scale, outliers or per-block scales.
fn weights(rng: &mut Rng, n: usize, trial: usize) -> Vec<f32> {
    let scale = 10f32.powi(trial as i32 % 5 - 3);
    (0..n)
        .map(|i| match trial % 3 {
            0 => rng.normal(scale),
            1 => rng.normal(scale) * if i % 97 == 0 { 40.0 } else { 1.0 },
            _ => rng.normal(scale) * 10f32.powi(((i / 32) % 4) as i32 - 2),
        })
        .collect()
}

/// Worst |error| / tolerance of `ty` over several trials (must stay <= 1).
fn worst_error_ratio(ty: GgmlType, n: usize, trials: usize) -> f64 {
    let act_ty = vec_dot_type(ty);
    let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ ty.id() as u64);
    let mut worst = 0f64;
    for trial in 0..trials {
        let x = weights(&mut rng, n, trial);
        let a: Vec<f32> = (0..n).map(|i| rng.normal(if i % 61 == 0 { 8.0 } else { 1.0 })).collect();
        let mut wq = vec![0u8; row_size(ty, n).unwrap()];
        let mut aq = vec![0u8; row_size(act_ty, n).unwrap()];
        if tandem_quant::GRID_TYPES.contains(&ty) {
            // Not quantizable here: random blocks, a different stretch of them per trial.
            let blocks = n / ty.block_size();
            let all = common::fixture_blocks(ty, (blocks + trials) * ty.block_size());
            wq.copy_from_slice(&all[trial * ty.type_size()..(trial + blocks) * ty.type_size()]);
        } else {
            quantize_row(ty, &x, &mut wq).unwrap();
        }
        quantize_row(act_ty, &a, &mut aq).unwrap();
        let got = vec_dot(ty, n, &wq, &aq).unwrap() as f64;

        let (mut wd, mut ad) = (vec![0f32; n], vec![0f32; n]);
        dequantize_row(ty, &wq, &mut wd).unwrap();
        dequantize_row(act_ty, &aq, &mut ad).unwrap();
        let exact: f64 = wd.iter().zip(&ad).map(|(&w, &a)| w as f64 * a as f64).sum();
        let magnitude: f64 = wd.iter().zip(&ad).map(|(&w, &a)| (w as f64 * a as f64).abs()).sum();
        let mut tol = REL_TOL * magnitude;
        if act_ty == GgmlType::Q8_1 {
            let (wts, ats) = (ty.type_size(), act_ty.type_size());
            for b in 0..n / 32 {
                let (m, s) = (f16_at(&wq, b * wts + 2), f16_at(&aq, b * ats + 2));
                tol += (m * s).abs() * 2f64.powi(-10) + m.abs() * 2f64.powi(-24);
            }
        }
        let err = (got - exact).abs();
        assert!(
            err <= tol,
            "{ty} x {act_ty}, n {n}, trial {trial}: vec_dot {got} vs exact {exact}: error {err:e} > tolerance {tol:e}"
        );
        worst = worst.max(err / tol.max(f64::MIN_POSITIVE));
    }
    worst
}

#[test]
fn vec_dot_matches_f64_dot_of_dequantized_rows() {
    for ty in VEC_DOT_TYPES {
        for n in [256, 4096] {
            let worst = worst_error_ratio(ty, n, 12);
            println!("{ty:>6} n {n:>4}: worst error = {:.3} of the tolerance", worst);
        }
    }
}

/// f64 dot product and magnitude (sum of |w_i a_i|) of the dequantized rows.
fn exact_dot(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> (f64, f64) {
    let (mut wd, mut ad) = (vec![0f32; n], vec![0f32; n]);
    dequantize_row(ty, w, &mut wd).unwrap();
    dequantize_row(vec_dot_type(ty), a, &mut ad).unwrap();
    let exact = wd.iter().zip(&ad).map(|(&w, &a)| w as f64 * a as f64).sum();
    let magnitude = wd.iter().zip(&ad).map(|(&w, &a)| (w as f64 * a as f64).abs()).sum();
    (exact, magnitude)
}

/// Every weight type: bit-exact with ggml's `*_generic` kernel (compiled without SIMD or FMA),
/// and within REL_TOL of the magnitude of ggml's AVX-512 kernel, which sums in another order.
#[test]
fn vec_dot_matches_ggml_scalar_kernels_bit_for_bit() {
    let mut failures = Vec::new();
    for ty in VEC_DOT_TYPES {
        let common::VecDotFixture { cases, weight_rows: weights, act_rows: acts, n } =
            common::vec_dot_fixture(ty, vec_dot_type(ty));
        let (mut simd_equal, mut worst_simd) = (0, 0f64);
        for (k, c) in cases.iter().enumerate() {
            let (w, a) = (&weights[c.weight_row], &acts[c.act_row]);
            let got = vec_dot(ty, n, w, a).unwrap();
            if got.to_bits() != c.scalar.to_bits() {
                failures.push(format!(
                    "{ty} case {k} (weight row {}, act row {}): got {got}, ggml scalar {}",
                    c.weight_row, c.act_row, c.scalar
                ));
            }
            let (_, magnitude) = exact_dot(ty, n, w, a);
            let simd_err = (c.simd as f64 - got as f64).abs();
            assert!(simd_err <= REL_TOL * magnitude, "{ty} case {k}: SIMD {} vs scalar {got}", c.simd);
            worst_simd = worst_simd.max(simd_err / (REL_TOL * magnitude).max(f64::MIN_POSITIVE));
            simd_equal += (c.simd.to_bits() == got.to_bits()) as usize;
        }
        println!("{ty:>6}: {} dots bit-exact with ggml scalar; SIMD identical in {simd_equal}, worst SIMD difference {worst_simd:.3} of the tolerance", cases.len());
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn vec_dot_of_float_rows_sums_f32_products_in_f64() {
    // ggml_vec_dot_f32 without SIMD: each product rounded to f32, the sum kept in f64.
    let x = [1e8f32, 1.0, -1e8, 1.0];
    let y = [1.0f32, 1.0, 1.0, 1.0];
    let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    assert_eq!(vec_dot(GgmlType::F32, 4, &bytes(&x), &bytes(&y)).unwrap(), 2.0);
}
