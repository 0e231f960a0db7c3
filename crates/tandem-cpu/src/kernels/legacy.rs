//! The non-k-quant weight types (see `lookup`): the 32-element block quants with Q8_0 / Q8_1
//! activations, IQ4_XS with Q8_K activations, and the float types. Their SIMD kernels
//! (`x86/legacy/`; none on other architectures) unpack a weight block once into registers and use
//! it for every one of the `ny` activation rows, as ik_llama.cpp's iqk_mul_mat does, so batched
//! prefill reads each weight byte once per call rather than once per token. Levels without an
//! entry fall back to the one below (`kernels::kernel`): the floats at VNNI run the AVX-512 code.

/// This architecture's kernel tables, each for `ty` written for exactly `isa`, if any: `lookup`
/// (single-row) and `lookup_tile` (multi-row: the signed-weight types against Q8_0 activations at
/// the VNNI level).
pub(super) use super::arch::legacy::{lookup, lookup_tile};

#[cfg(all(test, target_arch = "x86_64"))]
mod bench;

/// Lengths the shared test (multiples of 256) does not reach: partial groups of blocks, odd block
/// counts and float tails, each against the scalar reference.
#[cfg(test)]
mod tests {
    use crate::kernels::{kernel, simd_levels, MAX_NY};
    use tandem_quant::{dequantize_row, quantize_row, row_size, GgmlType};

    /// [`crate::test_data`] with the magnitude changing every 32 elements.
    fn data(seed: u64, n: usize) -> Vec<f32> {
        let scale = [1.0, 0.01, 30.0, 0.5];
        crate::test_data(seed, n).into_iter().enumerate().map(|(i, v)| v * scale[(i / 32) % 4]).collect()
    }

    #[test]
    fn odd_lengths_match_the_scalar_reference() {
        use GgmlType as T;
        let types = [T::Q8_0, T::Q4_0, T::Q5_0, T::IQ4_NL, T::Q4_1, T::Q5_1, T::IQ4_XS, T::F32, T::F16, T::BF16];
        let mut checked = 0;
        for ty in types {
            let lens: &[usize] = match ty.block_size() {
                1 => &[1, 7, 15, 17, 100, 257, 300, 1000],
                32 => &[32, 64, 96, 160, 224, 288, 480, 1056],
                _ => &[256, 512, 768, 1280],
            };
            for isa in simd_levels(ty).into_iter().filter(|l| l.supported()) {
                let k = kernel(ty, isa).unwrap();
                for &n in lens {
                    let mut w = vec![0u8; row_size(ty, n).unwrap()];
                    quantize_row(ty, &data(n as u64, n), &mut w).unwrap();
                    let mut wf = vec![0f32; n];
                    dequantize_row(ty, &w, &mut wf).unwrap();
                    let x = data(3 + n as u64, n * MAX_NY);
                    let acts = crate::quantize_activations(ty, &x, n).unwrap();
                    crate::testing::check_against_scalar(&k, n, &w, &wf, &x, &acts);
                    checked += MAX_NY;
                }
            }
        }
        println!("{checked} (type, level, n, ny) cases checked");
        assert!(checked > 0 || !crate::kernels::Isa::Avx2.supported());
    }
}
