//! SIMD kernels of the non-k-quant weight types (see `lookup`): the 32-element block quants with
//! Q8_0 / Q8_1 activations and IQ4_XS with Q8_K activations on 256-bit vectors (`quant`), the
//! hottest of them again on 512-bit vectors (`zmm`), and the float types (`float`). Each kernel
//! unpacks a weight block once into registers and uses it for every one of the `ny` activation
//! rows, as ik_llama.cpp's iqk_mul_mat does, so batched prefill reads each weight byte once per
//! call rather than once per token. Levels without an entry fall back to the one below
//! (`kernels::kernel`): the floats at VNNI run the AVX-512 code.
//!
//! Code shared by the levels is written once as `#[inline(always)]` generic functions without
//! target features; the entry points (`#[target_feature]`) instantiate them per level and `ny`, so
//! the intrinsics inline into code compiled for that level.

use super::{Isa, KernelFn, TileFn};
use tandem_quant::GgmlType;

/// Defines a [`KernelFn`] for one level that runs `$body` with `ny` as a constant.
#[cfg(target_arch = "x86_64")]
macro_rules! block_entry {
    ($name:ident, $feat:literal, $body:ident::<$($g:ty),*>) => {
        /// # Safety
        /// The contract of `KernelFn`: lengths checked by `Kernel::run`; the machine has the
        /// target features enabled here.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
            // SAFETY: this function's contract, forwarded.
            unsafe { by_ny!(ny, $body[$($g),*](n, w.as_ptr(), ys.as_ptr(), out)) }
        }
    };
}

/// The [`KernelFn`]s of the block-quant types at one level (`$feat`, integer dot products `$d`),
/// named in the order Q8_0, Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1, IQ4_XS: one list for every level.
#[cfg(target_arch = "x86_64")]
macro_rules! block_entries {
    ($feat:literal $d:ident => $q8_0:ident $q4_0:ident $q5_0:ident $iq4_nl:ident $q4_1:ident $q5_1:ident $iq4_xs:ident) => {
        block_entry!($q8_0, $feat, q8_0_act::<Q8_0, $d>);
        block_entry!($q4_0, $feat, q8_0_act::<Q4_0, $d>);
        block_entry!($q5_0, $feat, q8_0_act::<Q5_0, $d>);
        block_entry!($iq4_nl, $feat, q8_0_act::<IQ4NL, $d>);
        block_entry!($q4_1, $feat, q8_1_act::<Q4_1, $d>);
        block_entry!($q5_1, $feat, q8_1_act::<Q5_1, $d>);
        block_entry!($iq4_xs, $feat, iq4_xs::<$d>);
    };
}

#[cfg(target_arch = "x86_64")]
mod float;
#[cfg(target_arch = "x86_64")]
mod quant;
#[cfg(target_arch = "x86_64")]
mod zmm;

/// The kernel for `ty` written for exactly `isa`, if any.
#[cfg(target_arch = "x86_64")]
pub(super) fn lookup(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
    use GgmlType as T;
    let f: KernelFn = match (isa, ty) {
        // 32-element blocks with Q8_0 / Q8_1 activations, IQ4_XS with Q8_K.
        (Isa::Avx2, T::Q8_0) => quant::q8_0_avx2,
        (Isa::Avx2, T::Q4_0) => quant::q4_0_avx2,
        (Isa::Avx2, T::Q5_0) => quant::q5_0_avx2,
        (Isa::Avx2, T::IQ4_NL) => quant::iq4_nl_avx2,
        (Isa::Avx2, T::Q4_1) => quant::q4_1_avx2,
        (Isa::Avx2, T::Q5_1) => quant::q5_1_avx2,
        (Isa::Avx2, T::IQ4_XS) => quant::iq4_xs_avx2,
        (Isa::Avx512, T::Q8_0) => zmm::q8_0_avx512,
        (Isa::Avx512, T::Q4_0) => zmm::q4_0_avx512,
        (Isa::Avx512, T::Q5_0) => zmm::q5_0_avx512,
        (Isa::Avx512, T::IQ4_NL) => zmm::iq4_nl_avx512,
        (Isa::Avx512, T::IQ4_XS) => zmm::iq4_xs_avx512,
        (Isa::Avx512, T::Q4_1) => zmm::q4_1_avx512,
        (Isa::Avx512, T::Q5_1) => zmm::q5_1_avx512,
        (Isa::Avx512Vnni, T::Q8_0) => zmm::q8_0_vnni512,
        (Isa::Avx512Vnni, T::Q4_0) => zmm::q4_0_vnni512,
        (Isa::Avx512Vnni, T::Q5_0) => zmm::q5_0_vnni512,
        (Isa::Avx512Vnni, T::IQ4_NL) => zmm::iq4_nl_vnni512,
        (Isa::Avx512Vnni, T::IQ4_XS) => zmm::iq4_xs_vnni512,
        (Isa::Avx512Vnni, T::Q4_1) => zmm::q4_1_vnni512,
        (Isa::Avx512Vnni, T::Q5_1) => zmm::q5_1_vnni512,
        // Floats against activations of their own type.
        (Isa::Avx2, T::F32) => float::f32_avx2,
        (Isa::Avx2, T::F16) => float::f16_avx2,
        (Isa::Avx2, T::BF16) => float::bf16_avx2,
        (Isa::Avx512, T::F32) => float::f32_avx512,
        (Isa::Avx512, T::F16) => float::f16_avx512,
        (Isa::Avx512, T::BF16) => float::bf16_avx512,
        (Isa::Avx512Bf16, T::BF16) => float::bf16_avx512bf16,
        _ => return None,
    };
    Some(f)
}

/// The kernel for `ty` written for exactly `isa`, if any (none off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn lookup(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
    let _ = (ty, isa);
    None
}

/// The multi-row kernel for `ty` at exactly `isa`, if any: the signed-weight types against Q8_0
/// activations at the VNNI level.
#[cfg(target_arch = "x86_64")]
pub(super) fn lookup_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
    use GgmlType as T;
    Some(match (isa, ty) {
        (Isa::Avx512Vnni, T::Q8_0) => zmm::q8_0_vnni512_tile,
        (Isa::Avx512Vnni, T::Q4_0) => zmm::q4_0_vnni512_tile,
        (Isa::Avx512Vnni, T::Q5_0) => zmm::q5_0_vnni512_tile,
        (Isa::Avx512Vnni, T::IQ4_NL) => zmm::iq4_nl_vnni512_tile,
        _ => return None,
    })
}

/// The multi-row kernel for `ty` at exactly `isa` (none off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn lookup_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
    let _ = (ty, isa);
    None
}

#[cfg(all(test, target_arch = "x86_64"))]
mod bench;

/// Lengths the shared test (multiples of 256) does not reach: partial groups of blocks, odd block
/// counts and float tails, each against the scalar reference.
#[cfg(test)]
mod tests {
    use crate::kernels::{kernel, simd_levels, MAX_NY};
    use tandem_quant::{dequantize_row, quantize_row, row_size, vec_dot, GgmlType};

    fn data(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let v = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                v * [1.0, 0.01, 30.0, 0.5][(i / 32) % 4]
            })
            .collect()
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
                    for ny in 1..=MAX_NY {
                        let mut out = vec![0f32; ny];
                        k.run(n, &w, &acts.data[..ny * acts.row_bytes], &mut out);
                        for (j, got) in out.iter().enumerate() {
                            let want = vec_dot(ty, n, &w, acts.row(j)).unwrap();
                            let mag: f32 = wf.iter().zip(&x[j * n..(j + 1) * n]).map(|(a, b)| (a * b).abs()).sum();
                            let tol = 2e-6 * mag + 1e-6;
                            assert!(
                                (got - want).abs() <= tol,
                                "{ty} {isa} n={n} ny={ny} row {j}: simd {got} scalar {want}"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
        println!("{checked} (type, level, n, ny) cases checked");
        assert!(checked > 0 || !crate::kernels::Isa::Avx2.supported());
    }
}
