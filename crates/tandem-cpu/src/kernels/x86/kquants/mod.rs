//! The x86 kernels of the k-quants and the IQ1/IQ2/IQ3 grid types (against Q8_K activations): AVX2,
//! AVX-512, AVX-512 VNNI and VBMI. Each weight block is unpacked once into registers (levels, group
//! scales, min terms; `unpack.rs`, the grid types `iq.rs` and `iq_vbmi.rs`) and dotted with all
//! `ny` activation rows (`dot.rs`), as ik_llama.cpp's iqk_mul_mat does for batched prefill. Integer
//! sums are exact; per-block float terms are combined with FMA. Below, the entry points and the
//! tables `kernels/kquants.rs` dispatches from.

mod dot;
mod iq;
mod iq_vbmi;
mod unpack;

use crate::kernels::{Isa, KernelFn, TileFn};
use dot::{
    dot_avx2, dot_avx512, dot_avx512vbmi, dot_avx512vbmi_vnni, dot_avx512vnni, dot_wide_avx2, tile_avx2, tile_avx512,
    tile_avx512vnni, wide_avx512, wide_avx512vbmi, wide_avx512vbmi_vnni, wide_avx512vnni,
};
use iq::{IQ1M, IQ1S, IQ2S, IQ2XS, IQ2XXS, IQ3S, IQ3XXS};
use tandem_quant::GgmlType;
use unpack::{KQuant, Q2K, Q3K, Q4K, Q5K, Q6K};

/// `$f::<T>($isa)` with `T` the unpacking of `$ty`: a grid type, or one of the k-quants listed
/// (`GgmlType` variant `=>` unpacking); None for any other type.
macro_rules! by_type {
    ($ty:expr, $f:ident($isa:expr) $(, $t:ident => $u:ty)*) => {
        match $ty {
            $(GgmlType::$t => $f::<$u>($isa),)*
            GgmlType::IQ2_XXS => $f::<IQ2XXS>($isa),
            GgmlType::IQ2_XS => $f::<IQ2XS>($isa),
            GgmlType::IQ2_S => $f::<IQ2S>($isa),
            GgmlType::IQ3_XXS => $f::<IQ3XXS>($isa),
            GgmlType::IQ3_S => $f::<IQ3S>($isa),
            GgmlType::IQ1_S => $f::<IQ1S>($isa),
            GgmlType::IQ1_M => $f::<IQ1M>($isa),
            _ => None,
        }
    };
}

/// A `KernelFn` from a dot loop generic over `NY`: picks the instance for `ny`.
macro_rules! entry {
    ($name:ident, $dot:ident) => {
        /// # Safety
        /// As [`KernelFn`]: lengths checked by `Kernel::run` (`ny` in 1..=8), the machine runs
        /// this level.
        unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
            // SAFETY: forwarded from the caller.
            unsafe { by_ny!(ny, $dot[T](n, w.as_ptr(), ys.as_ptr(), out.as_mut_ptr())) }
        }
    };
}
entry!(avx2, dot_avx2);
entry!(avx512, dot_avx512);
entry!(avx512vnni, dot_avx512vnni);
entry!(avx512vbmi, dot_avx512vbmi);
entry!(avx512vbmi_vnni, dot_avx512vbmi_vnni);

/// A `KernelFn` for up to `MAX_WIDE` rows from a wide dot loop (the zmm ones with one weight
/// row: `(n, w, wstride, ys, ny, out)`).
macro_rules! wide_entry {
    ($name:ident, $dot:ident::<T>) => {
        /// # Safety
        /// As [`KernelFn`] with up to `MAX_WIDE` rows: lengths checked by the caller.
        unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
            // SAFETY: forwarded from the caller.
            unsafe { $dot::<T>(n, w.as_ptr(), ys.as_ptr(), ny.min(out.len()), out.as_mut_ptr()) }
        }
    };
    ($name:ident, $dot:ident::<T, 1>) => {
        /// # Safety
        /// As [`KernelFn`] with up to `MAX_WIDE` rows: lengths checked by the caller.
        unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
            // SAFETY: forwarded from the caller (one weight row).
            unsafe { $dot::<T, 1>(n, w.as_ptr(), 0, ys.as_ptr(), ny.min(out.len()), out.as_mut_ptr()) }
        }
    };
}
wide_entry!(wide256, dot_wide_avx2::<T>);
wide_entry!(wide512, wide_avx512::<T, 1>);
wide_entry!(wide512vnni, wide_avx512vnni::<T, 1>);
wide_entry!(wide_vbmi, wide_avx512vbmi::<T, 1>);
wide_entry!(wide_vbmi_vnni, wide_avx512vbmi_vnni::<T, 1>);

/// The wide kernel of a grid type at `isa`.
fn wide_for_type<T: KQuant>(isa: Isa) -> Option<KernelFn> {
    match isa {
        Isa::Avx2 => Some(wide256::<T>),
        Isa::Avx512 => Some(wide512::<T>),
        Isa::Avx512Vnni if T::VNNI => Some(wide512vnni::<T>),
        Isa::Avx512Vbmi if T::VNNI => Some(wide_vbmi_vnni::<T>),
        Isa::Avx512Vbmi => Some(wide_vbmi::<T>),
        _ => None,
    }
}

/// The grid types' wide kernels, at every level: their unpacking (table loads, 29-50 ns per
/// block below the `avx512vbmi` level, 9-31 ns at it) costs more than the activations of more
/// than 8 tokens falling out of L1. At the `avx512vbmi` level IQ2_XXS, IQ2_XS and IQ3_XXS,
/// whose blocks unpack fastest, took calls of 8 tokens until the two-row wide kernels below
/// (single-row wide, IQ2_XXS prefilled 256 tokens at 180-219 against 191-251 t/s).
pub(crate) fn lookup_wide(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
    by_type!(ty, wide_for_type(isa))
}

/// A `TileFn` from a tile loop generic over the weight rows `NR` (2 or 4, from `out.len() / ny`)
/// and `NY`; with `, wide`, from a wide tile loop generic over `NR` alone, for up to `MAX_WIDE`
/// tokens.
macro_rules! tile_entry {
    ($name:ident, $tile:ident $(, $wide:ident)?) => {
        /// # Safety
        /// As [`TileFn`] (a wide one with up to `MAX_WIDE` tokens): lengths checked by
        /// `Kernel::run_tile`, the machine runs this level.
        unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
            tile_entry!(@body $($wide)? $tile, n, w, ys, ny, out)
        }
    };
    (@body $tile:ident, $n:ident, $w:ident, $ys:ident, $ny:ident, $out:ident) => {
        tile_body!($tile::<T>, $n, $w, $ys, $ny, $out)
    };
    (@body wide $tile:ident, $n:ident, $w:ident, $ys:ident, $ny:ident, $out:ident) => {{
        let nr = $out.len() / $ny.max(1);
        let ws = $w.len() / nr.max(1);
        let (w, ys, o) = ($w.as_ptr(), $ys.as_ptr(), $out.as_mut_ptr());
        // SAFETY: forwarded from the caller (nr rows of ws bytes, ny tokens, nr * ny outputs).
        unsafe {
            match nr {
                2 => $tile::<T, 2>($n, w, ws, ys, $ny, o),
                4 => $tile::<T, 4>($n, w, ws, ys, $ny, o),
                _ => $out.fill(f32::NAN),
            }
        }
    }};
}
tile_entry!(wide_tile_vbmi, wide_avx512vbmi, wide);
tile_entry!(wide_tile_vbmi_vnni, wide_avx512vbmi_vnni, wide);

fn wide_tile_for_type<T: KQuant>(isa: Isa) -> Option<TileFn> {
    match isa {
        Isa::Avx512Vbmi if T::VNNI => Some(wide_tile_vbmi_vnni::<T>),
        Isa::Avx512Vbmi => Some(wide_tile_vbmi::<T>),
        _ => None,
    }
}

/// The grid types' two-row wide kernels, at the `avx512vbmi` level only: each activation
/// block loaded once for two weight rows. Prefill of 256 tokens on the bench models (Zen 5,
/// alternating binaries, against single-row wide kernels for IQ1_S and IQ3_S and calls of 8
/// tokens for IQ2_XXS): IQ1_S 158-161 against 149, IQ3_S 152-154 against 136-138, IQ2_XXS
/// 167-173 against 125-141 t/s; four rows at once were slower (IQ1_S 138-149, IQ2_XXS
/// 131-143 against 156-169). Below that level, where the unpacking takes more registers, two
/// rows were as often slower as faster (IQ3_S 7.2 against 6.7 ns per block and token with 24
/// tokens, IQ1_S 5.0 against 6.5).
pub(crate) fn lookup_wide_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
    by_type!(ty, wide_tile_for_type(isa))
}

tile_entry!(tile256, tile_avx2);
tile_entry!(tile512, tile_avx512);
tile_entry!(tile512vnni, tile_avx512vnni);

fn tile_for_type<T: KQuant>(isa: Isa) -> Option<TileFn> {
    if !T::TILES {
        return None;
    }
    match isa {
        Isa::Avx2 => Some(tile256::<T>),
        Isa::Avx512 => Some(tile512::<T>),
        Isa::Avx512Vnni if T::VNNI => Some(tile512vnni::<T>),
        Isa::Scalar | Isa::AvxVnni | Isa::Avx512Vnni | Isa::Avx512Vbmi | Isa::Avx512Bf16 => None,
    }
}

/// The k-quants' and grid types' multi-row kernels (`KQuant::TILES` types only).
pub(crate) fn lookup_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
    by_type!(ty, tile_for_type(isa), Q2_K => Q2K, Q3_K => Q3K, Q4_K => Q4K, Q5_K => Q5K, Q6_K => Q6K)
}

fn for_type<T: KQuant>(isa: Isa) -> Option<KernelFn> {
    match isa {
        Isa::Avx2 => Some(avx2::<T>),
        Isa::Avx512 => Some(avx512::<T>),
        Isa::Avx512Vnni if T::VNNI => Some(avx512vnni::<T>),
        Isa::Avx512Vbmi if T::OWN_VBMI && T::VNNI => Some(avx512vbmi_vnni::<T>),
        Isa::Avx512Vbmi if T::OWN_VBMI => Some(avx512vbmi::<T>),
        Isa::Scalar | Isa::AvxVnni | Isa::Avx512Vnni | Isa::Avx512Bf16 | Isa::Avx512Vbmi => None,
    }
}

/// The k-quants' and grid types' single-row kernels.
pub(crate) fn lookup(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
    by_type!(ty, for_type(isa), Q2_K => Q2K, Q3_K => Q3K, Q4_K => Q4K, Q5_K => Q5K, Q6_K => Q6K)
}
