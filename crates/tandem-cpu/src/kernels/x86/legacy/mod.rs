//! The x86 kernels of the non-k-quant weight types: the 32-element block quants with Q8_0 / Q8_1
//! activations and IQ4_XS with Q8_K activations on 256-bit vectors (`quant.rs`), the hottest of
//! them again on 512-bit vectors (`zmm.rs`), and the float types (`float.rs`); below, the entry
//! points' macros and the tables `kernels/legacy.rs` dispatches from.
//!
//! Code shared by the levels is written once as `#[inline(always)]` generic functions without
//! target features; the entry points (`#[target_feature]`) instantiate them per level and `ny`, so
//! the intrinsics inline into code compiled for that level.

use crate::kernels::{Isa, KernelFn, TileFn};
use tandem_quant::GgmlType;

/// Defines a [`KernelFn`] for one level that runs `$body` with `ny` as a constant.
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
macro_rules! block_entries {
    ($feat:literal $d:ident => $q8_0:ident $q4_0:ident $q5_0:ident $iq4_nl:ident $q4_1:ident $q5_1:ident $iq4_xs:ident) => {
        block_entry!($q8_0, $feat, q8_act::<Q8_0, $d>);
        block_entry!($q4_0, $feat, q8_act::<Q4_0, $d>);
        block_entry!($q5_0, $feat, q8_act::<Q5_0, $d>);
        block_entry!($iq4_nl, $feat, q8_act::<IQ4NL, $d>);
        block_entry!($q4_1, $feat, q8_act::<Q4_1, $d>);
        block_entry!($q5_1, $feat, q8_act::<Q5_1, $d>);
        block_entry!($iq4_xs, $feat, iq4_xs::<$d>);
    };
}

mod float;
mod quant;
mod zmm;

/// The kernel for `ty` written for exactly `isa`, if any.
pub(crate) fn lookup(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
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

/// The multi-row kernel for `ty` at exactly `isa`, if any: the signed-weight types against Q8_0
/// activations at the VNNI level.
pub(crate) fn lookup_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
    use GgmlType as T;
    Some(match (isa, ty) {
        (Isa::Avx512Vnni, T::Q8_0) => zmm::q8_0_vnni512_tile,
        (Isa::Avx512Vnni, T::Q4_0) => zmm::q4_0_vnni512_tile,
        (Isa::Avx512Vnni, T::Q5_0) => zmm::q5_0_vnni512_tile,
        (Isa::Avx512Vnni, T::IQ4_NL) => zmm::iq4_nl_vnni512_tile,
        _ => return None,
    })
}
