//! What the unit tests and the integration tests (`tests/`) share: deterministic data and the
//! check of a dot-product kernel against tandem-quant's scalar reference. Not part of the API.
#![doc(hidden)]

use crate::{Kernel, QuantizedActs, MAX_NY};
use tandem_quant::vec_dot;

pub use tandem_quant::testing::Rng;

/// Deterministic values in [-1, 1) from an xorshift generator seeded with `seed`.
pub fn data(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n).map(|_| rng.uniform()).collect()
}

/// `k` on the weight row `w` (`wf` dequantized) against 1..=[`MAX_NY`] of the activation rows
/// `acts` (quantized from `x`), each result within `2e-6` of the products' magnitude (plus
/// `1e-6`) of tandem-quant's `vec_dot`: SIMD kernels add the same products in another order.
pub fn check_against_scalar(k: &Kernel, n: usize, w: &[u8], wf: &[f32], x: &[f32], acts: &QuantizedActs) {
    let (ty, isa) = (k.ty, k.isa);
    for ny in 1..=MAX_NY {
        let mut out = vec![0f32; ny];
        k.run(n, w, &acts.data[..ny * acts.row_bytes], &mut out);
        for (j, got) in out.iter().enumerate() {
            let want = vec_dot(ty, n, w, acts.row(j)).unwrap();
            let mag: f32 = wf.iter().zip(&x[j * n..(j + 1) * n]).map(|(a, b)| (a * b).abs()).sum();
            let tol = 2e-6 * mag + 1e-6;
            assert!(
                (got - want).abs() <= tol,
                "{ty} {isa} n={n} ny={ny} row {j}: simd {got} scalar {want} (tolerance {tol})"
            );
        }
    }
}
