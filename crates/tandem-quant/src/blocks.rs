//! ggml block layouts (ggml/src/ggml-common.h) and ggml's scalar float conversions.
//!
//! Every block is `#[repr(C)]` with the field order and sizes of ggml's C struct, and a
//! compile-time assert ties its size to `GgmlType::type_size()`. Blocks are read from raw
//! (possibly unaligned, memory-mapped) bytes with [`read_block`], never by casting references.

use bytemuck::{Pod, Zeroable};
use half::f16;
use tandem_gguf::{GgmlType, QK_K};

/// Elements per block of Q4_0 (ggml `QK4_0`).
pub const QK4_0: usize = 32;
/// Elements per block of Q4_1 (ggml `QK4_1`).
pub const QK4_1: usize = 32;
/// Elements per block of Q5_0 (ggml `QK5_0`).
pub const QK5_0: usize = 32;
/// Elements per block of Q5_1 (ggml `QK5_1`).
pub const QK5_1: usize = 32;
/// Elements per block of Q8_0 (ggml `QK8_0`).
pub const QK8_0: usize = 32;
/// Elements per block of Q8_1 (ggml `QK8_1`).
pub const QK8_1: usize = 32;
/// Elements per block of IQ4_NL (ggml `QK4_NL`).
pub const QK4_NL: usize = 32;
/// Bytes of packed 6-bit scales and mins in Q4_K / Q5_K (ggml `K_SCALE_SIZE`).
pub const K_SCALE_SIZE: usize = 12;

/// The 16 non-linear levels of IQ4_NL / IQ4_XS (ggml-common.h `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

// The blocks are read with native byte order; GGUF data is little-endian.
#[cfg(target_endian = "big")]
compile_error!("tandem-quant reads ggml blocks in native byte order and supports little-endian targets only");

/// Q4_0: 32 weights, `x = d * (q - 8)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    /// Low nibbles: elements 0..16, high nibbles: elements 16..32.
    pub qs: [u8; QK4_0 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

/// Q4_1: 32 weights, `x = d * q + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK4_1 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

/// Q5_0: 32 weights, `x = d * (q - 16)`, the fifth bit of element j in bit j of `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK5_0 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);

/// Q5_1: 32 weights, `x = d * q + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK5_1 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

/// Q8_0: 32 weights, `x = d * q`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK8_0],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// Q8_1: Q8_0 plus `s = d * sum(qs)`, the activation type paired with Q4_1 / Q5_1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK8_1],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

/// Q2_K: 256 weights in 16 groups of 16; 4-bit scale (low nibble) and min (high nibble) per group.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

/// Q3_K: 256 weights in 16 groups of 16, 6-bit signed group scales packed into 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);

/// Q4_K: 256 weights in 8 groups of 32, 6-bit scales and mins.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

/// Q5_K: Q4_K plus a fifth bit per weight.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

/// Q6_K: 256 weights in 16 groups of 16 with 8-bit signed scales.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

/// Q8_K: the activation type of the k-quants; f32 scale and per-16 sums of the quants.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

/// IQ4_NL: 32 weights, `x = d * KVALUES_IQ4NL[q]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4NL {
    pub d: f16,
    pub qs: [u8; QK4_NL / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIQ4NL>() == 18);

/// IQ4_XS: 256 weights in 8 groups of 32 with 6-bit group scales (low 4 bits in `scales_l`,
/// high 2 bits in `scales_h`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4XS {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIQ4XS>() == 136);

/// IQ2_XXS: 256 weights in 8 groups of 32; per group two u32 (4 grid indices of 8 values, then
/// 4 x 7 sign bits and a 4-bit scale).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ2XXS {
    pub d: f16,
    pub qs: [u16; QK_K / 8],
}
const _: () = assert!(std::mem::size_of::<BlockIQ2XXS>() == 66);

/// IQ2_XS: 256 weights; each u16 of `qs` is a 9-bit grid index and 7 sign bits, `scales` one
/// 4-bit scale per 16 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ2XS {
    pub d: f16,
    pub qs: [u16; QK_K / 8],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIQ2XS>() == 74);

/// IQ2_S: 256 weights; `qs` holds 32 grid-index low bytes then 32 sign bytes, `qh` the index
/// high bits, `scales` one 4-bit scale per 16 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ2S {
    pub d: f16,
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIQ2S>() == 82);

/// IQ3_XXS: 256 weights; 64 grid indices (4 values each), then per group of 32 a u32 of 4 x 7
/// sign bits and a 4-bit scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ3XXS {
    pub d: f16,
    pub qs: [u8; 3 * QK_K / 8],
}
const _: () = assert!(std::mem::size_of::<BlockIQ3XXS>() == 98);

/// IQ3_S: 256 weights; 9-bit grid indices (`qs` low bytes, `qh` high bits), one sign bit per
/// weight, one 4-bit scale per 32 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ3S {
    pub d: f16,
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub signs: [u8; QK_K / 8],
    pub scales: [u8; QK_K / 64],
}
const _: () = assert!(std::mem::size_of::<BlockIQ3S>() == 110);

/// IQ1_S: 256 weights; 11-bit indices into a grid of -1/0/1 (`qs` low bytes, 3 high bits each
/// in `qh`), per group of 32 a 3-bit scale and the sign of the 1/8 shift in `qh`'s top bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ1S {
    pub d: f16,
    pub qs: [u8; QK_K / 8],
    pub qh: [u16; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIQ1S>() == 50);

/// IQ1_M: 256 weights; indices as IQ1_S with the high bits and shift signs per 8 weights in
/// `qh`, 3-bit scales per 16 weights in `scales`, whose four top nibbles hold the fp16 `d`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ1M {
    pub qs: [u8; QK_K / 8],
    pub qh: [u8; QK_K / 16],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIQ1M>() == 56);

/// A ggml block type and the ggml type it encodes.
pub trait Block: Pod {
    const TYPE: GgmlType;
}

macro_rules! impl_block {
    ($($block:ty => $ty:ident),* $(,)?) => {$(
        impl Block for $block {
            const TYPE: GgmlType = GgmlType::$ty;
        }
    )*};
}

impl_block!(
    BlockQ4_0 => Q4_0, BlockQ4_1 => Q4_1, BlockQ5_0 => Q5_0, BlockQ5_1 => Q5_1,
    BlockQ8_0 => Q8_0, BlockQ8_1 => Q8_1, BlockQ2K => Q2_K, BlockQ3K => Q3_K,
    BlockQ4K => Q4_K, BlockQ5K => Q5_K, BlockQ6K => Q6_K, BlockQ8K => Q8_K,
    BlockIQ4NL => IQ4_NL, BlockIQ4XS => IQ4_XS, BlockIQ2XXS => IQ2_XXS, BlockIQ2XS => IQ2_XS,
    BlockIQ2S => IQ2_S, BlockIQ3XXS => IQ3_XXS, BlockIQ3S => IQ3_S, BlockIQ1S => IQ1_S, BlockIQ1M => IQ1_M,
);

/// Block `i` of `bytes`, copied out so that unaligned (memory-mapped) data is fine.
/// The caller has checked `bytes.len()` against the block count.
#[inline]
pub(crate) fn read_block<B: Block>(bytes: &[u8], i: usize) -> B {
    let size = std::mem::size_of::<B>();
    bytemuck::pod_read_unaligned(&bytes[i * size..(i + 1) * size])
}

/// Writes `block` as block `i` of `bytes` (unaligned is fine).
#[inline]
pub(crate) fn write_block<B: Block>(bytes: &mut [u8], i: usize, block: &B) {
    let size = std::mem::size_of::<B>();
    bytes[i * size..(i + 1) * size].copy_from_slice(bytemuck::bytes_of(block));
}

/// ggml's FP16 -> FP32 (`ggml_compute_fp16_to_fp32`, ggml-impl.h; exact for every input).
#[inline]
pub fn fp16_to_f32(h: f16) -> f32 {
    let w = (h.to_bits() as u32) << 16;
    let sign = w & 0x8000_0000;
    let two_w = w.wrapping_add(w);
    let exp_offset: u32 = 0xE0 << 23;
    let exp_scale = f32::from_bits(0x0780_0000); // 0x1.0p-112f
    let normalized_value = f32::from_bits((two_w >> 4) + exp_offset) * exp_scale;
    let magic_mask: u32 = 126 << 23;
    let magic_bias = 0.5f32;
    let denormalized_value = f32::from_bits((two_w >> 17) | magic_mask) - magic_bias;
    let denormalized_cutoff: u32 = 1 << 27;
    let result =
        sign | if two_w < denormalized_cutoff { denormalized_value.to_bits() } else { normalized_value.to_bits() };
    f32::from_bits(result)
}

/// ggml's FP32 -> FP16 (`ggml_compute_fp32_to_fp16`): round to nearest even, every NaN becomes
/// the quiet NaN 0x7E00 with the input's sign (half::f16::from_f32 keeps NaN payloads instead).
#[inline]
pub fn f32_to_fp16(f: f32) -> f16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 0x1.0p+112f
    let scale_to_zero = f32::from_bits(0x0880_0000); // 0x1.0p-110f
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let mut bias = shl1_w & 0xFF00_0000;
    if bias < 0x7100_0000 {
        bias = 0x7100_0000;
    }
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7C00;
    let mantissa_bits = bits & 0x0000_0FFF;
    let nonsign = exp_bits + mantissa_bits;
    let out = (sign >> 16) | if shl1_w > 0xFF00_0000 { 0x7E00 } else { nonsign };
    f16::from_bits(out as u16)
}

/// ggml's BF16 -> FP32 (`ggml_compute_bf16_to_fp32`): the bits shifted up.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// ggml's FP32 -> BF16 (`ggml_compute_fp32_to_bf16`): round to nearest even, NaN forced quiet.
#[inline]
pub fn f32_to_bf16(s: f32) -> u16 {
    let i = s.to_bits();
    if (i & 0x7fff_ffff) > 0x7f80_0000 {
        return ((i >> 16) | 64) as u16;
    }
    (i.wrapping_add(0x7fff + ((i >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml_type_table() {
        fn check<B: Block>() {
            assert_eq!(std::mem::size_of::<B>(), B::TYPE.type_size(), "{}", B::TYPE);
        }
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ8_1>();
        check::<BlockQ2K>();
        check::<BlockQ3K>();
        check::<BlockQ4K>();
        check::<BlockQ5K>();
        check::<BlockQ6K>();
        check::<BlockQ8K>();
        check::<BlockIQ4NL>();
        check::<BlockIQ4XS>();
        check::<BlockIQ2XXS>();
        check::<BlockIQ2XS>();
        check::<BlockIQ2S>();
        check::<BlockIQ3XXS>();
        check::<BlockIQ3S>();
        check::<BlockIQ1S>();
        check::<BlockIQ1M>();
    }

    #[test]
    fn fp16_conversions_agree_with_half_except_nan_payloads() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let ours = fp16_to_f32(h);
            let theirs = h.to_f32();
            assert_eq!(ours.to_bits(), theirs.to_bits(), "fp16 {bits:#06x}");
            if !ours.is_nan() {
                assert_eq!(f32_to_fp16(ours).to_bits(), bits, "round trip {bits:#06x}");
            }
        }
        // Rounding of values between f16 numbers, including ties and the subnormal range.
        let mut x = 0x1234_5678u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let f = f32::from_bits(x);
            if f.is_nan() {
                assert_eq!(f32_to_fp16(f).to_bits() & 0x7fff, 0x7E00);
            } else {
                assert_eq!(f32_to_fp16(f).to_bits(), f16::from_f32(f).to_bits(), "f32 {x:#010x}");
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_quiets_nan() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even stays
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd rounds up
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0); // signalling NaN -> quiet
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_to_f32(0xc000), -2.0);
    }
}
