//! ggml block formats: scalar reference dequantize, quantize and vec_dot, bit-exact with ggml.
//!
//! * [`dequantize_row`] decodes F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K..Q8_K,
//!   IQ4_NL, IQ4_XS and the IQ1/IQ2/IQ3 families (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
//!   IQ3_S) exactly as ggml's `dequantize_row_*` (ggml/src/ggml-quants.c).
//! * [`quantize_row`] encodes those types up to IQ4_XS as ggml's reference quantizers,
//!   byte-identical with `llama-quantize` without an importance matrix (the IQ1/IQ2/IQ3 types are
//!   only read: ggml quantizes them from an importance matrix).
//! * [`vec_dot`] is ggml's scalar (`*_generic`) dot product of a weight row with an activation
//!   row quantized to [`vec_dot_type`].
//!
//! All functions take raw little-endian bytes, so unaligned memory-mapped tensor data works, and
//! report bad lengths and unsupported types as [`Error`]s instead of panicking.
//! These are the references the SIMD kernels of tandem-cpu and the CUDA kernels are tested against.

/// `match $ty { .. }` over the block types that `quant` and `dequant` both convert, each arm
/// `each_block($src, $dst, name)` with that module's function of the type's name (ggml's
/// `quantize_row_*` / `dequantize_row_*`), then the caller's own `$arms`.
macro_rules! block_types {
    ($ty:expr, $src:expr, $dst:expr, { $($arms:tt)* }) => {
        match $ty {
            GgmlType::Q4_0 => each_block($src, $dst, q4_0),
            GgmlType::Q4_1 => each_block($src, $dst, q4_1),
            GgmlType::Q5_0 => each_block($src, $dst, q5_0),
            GgmlType::Q5_1 => each_block($src, $dst, q5_1),
            GgmlType::Q8_0 => each_block($src, $dst, q8_0),
            GgmlType::Q8_1 => each_block($src, $dst, q8_1),
            GgmlType::Q2_K => each_block($src, $dst, q2_k),
            GgmlType::Q3_K => each_block($src, $dst, q3_k),
            GgmlType::Q4_K => each_block($src, $dst, q4_k),
            GgmlType::Q5_K => each_block($src, $dst, q5_k),
            GgmlType::Q6_K => each_block($src, $dst, q6_k),
            GgmlType::Q8_K => each_block($src, $dst, q8_k),
            GgmlType::IQ4_NL => each_block($src, $dst, iq4_nl),
            GgmlType::IQ4_XS => each_block($src, $dst, iq4_xs),
            $($arms)*
        }
    };
}

pub mod blocks;
mod dequant;
mod iq;
pub mod iq_tables;
mod kquant_helpers;
mod quant;
pub mod testing;
mod vec_dot;

pub use blocks::{bf16_to_f32, f32_to_bf16, f32_to_fp16, fp16_to_f32};
pub use iq::{iq1m_scale, IQ1_DELTA};
pub use kquant_helpers::{get_scale_min_k4, unpack_q3k_scales};
pub use tandem_gguf::{GgmlType, QK_K};

/// Errors of tandem-quant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The type exists in ggml but this crate has no `op` for it.
    #[error("unsupported tensor type {ty} (id {}): {op} not implemented", .ty.id())]
    UnsupportedType { ty: GgmlType, op: &'static str },
    /// An element count that does not fill whole blocks.
    #[error("{ty}: {n} elements is not a whole number of {block}-element blocks")]
    PartialBlock { ty: GgmlType, n: usize, block: usize },
    /// An element count whose byte size overflows `usize`.
    #[error("{ty}: a row of {n} elements is too large to address")]
    RowTooLarge { ty: GgmlType, n: usize },
    /// A byte buffer whose length does not match the element count.
    #[error("{ty}: {what} is {got} bytes, but {n} elements take {expected} bytes")]
    BufferLength { ty: GgmlType, what: &'static str, n: usize, expected: usize, got: usize },
}

/// Result of tandem-quant.
pub type Result<T> = std::result::Result<T, Error>;

/// Types [`quantize_row`] encodes (and [`dequantize_row`] decodes).
pub const QUANTIZE_TYPES: [GgmlType; 17] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// The IQ1/IQ2/IQ3 types: decoded and multiplied, never encoded here.
pub const GRID_TYPES: [GgmlType; 7] = [
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
];

/// Types [`dequantize_row`] decodes: [`QUANTIZE_TYPES`], then [`GRID_TYPES`].
pub const DEQUANTIZE_TYPES: [GgmlType; 24] = concat(QUANTIZE_TYPES, GRID_TYPES);

/// Weight types [`vec_dot`] multiplies (Q8_1 and Q8_K are activation-only types, as in ggml):
/// those of [`QUANTIZE_TYPES`], then [`GRID_TYPES`].
pub const VEC_DOT_TYPES: [GgmlType; 22] = {
    let mut t = [GgmlType::F32; 22];
    let mut n = 0;
    let all = DEQUANTIZE_TYPES;
    let mut i = 0;
    while i < all.len() {
        if !matches!(all[i], GgmlType::Q8_1 | GgmlType::Q8_K) {
            t[n] = all[i];
            n += 1;
        }
        i += 1;
    }
    assert!(n == t.len());
    t
};

/// `a` then `b` (`C = A + B`, checked at compile time).
const fn concat<const A: usize, const B: usize, const C: usize>(a: [GgmlType; A], b: [GgmlType; B]) -> [GgmlType; C] {
    assert!(A + B == C);
    let mut t = [GgmlType::F32; C];
    let mut i = 0;
    while i < C {
        t[i] = if i < A { a[i] } else { b[i - A] };
        i += 1;
    }
    t
}

/// Bytes of a row of `n` elements of `ty`, or an error when `n` is not whole blocks.
pub fn row_size(ty: GgmlType, n: usize) -> Result<usize> {
    let block = ty.block_size();
    if !n.is_multiple_of(block) {
        return Err(Error::PartialBlock { ty, n, block });
    }
    (n / block).checked_mul(ty.type_size()).ok_or(Error::RowTooLarge { ty, n })
}

/// Checks that `got` bytes hold exactly `n` elements of `ty`.
fn check_bytes(ty: GgmlType, what: &'static str, n: usize, got: usize) -> Result<()> {
    let expected = row_size(ty, n)?;
    if got != expected {
        return Err(Error::BufferLength { ty, what, n, expected, got });
    }
    Ok(())
}

/// Decodes `src` (whole blocks of `ty`) into `dst`; `dst.len()` is the element count.
/// ggml `dequantize_row_*` (Q8_1, which ggml cannot decode, as `d * q`).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    if !DEQUANTIZE_TYPES.contains(&ty) {
        return Err(Error::UnsupportedType { ty, op: "dequantize" });
    }
    check_bytes(ty, "source", dst.len(), src.len())?;
    let done = dequant::dequantize_into(ty, src, dst);
    debug_assert!(done);
    Ok(())
}

/// Encodes `src` (a whole number of blocks) as `ty` into `dst`, which must be exactly
/// `row_size(ty, src.len())` bytes. Ports ggml's `quantize_row_*_ref`; for IQ4_NL / IQ4_XS it
/// ports `quantize_iq4_nl` / `quantize_iq4_xs` without importance weights (what llama-quantize
/// writes), and for Q8_K an all-zero block gets zero `bsums` where ggml leaves them untouched.
///
/// Q8_0 / Q8_1 / Q8_K are ggml's *reference* activation quantizers. llama.cpp's x86 runtime
/// quantizes activations with AVX code instead (`127/max` as the inverse scale and ties to even
/// for Q8_0/Q8_1), which can differ from the reference in the last level of a few values.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    if !QUANTIZE_TYPES.contains(&ty) {
        return Err(Error::UnsupportedType { ty, op: "quantize" });
    }
    check_bytes(ty, "destination", src.len(), dst.len())?;
    let done = quant::quantize_into(ty, src, dst);
    debug_assert!(done);
    Ok(())
}

/// The type ggml quantizes activations to before multiplying them with weights of type `ty`
/// (`type_traits_cpu[ty].vec_dot_type`). Types ggml has no dot product for (integers, F64,
/// the activation-only Q8_1 / Q8_K) map to themselves.
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    use GgmlType::*;
    match ty {
        F32 | F16 | BF16 => ty,
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL | MXFP4 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Q8_K,
        IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S | IQ1_M | IQ4_XS | TQ1_0 | TQ2_0 => Q8_K,
        Q8_1 | Q8_K | I8 | I16 | I32 | I64 | F64 => ty,
    }
}

/// Dot product of `n` weights of type `ty` (`weight_row`) with `n` activations of type
/// `vec_dot_type(ty)` (`act_row`), as ggml's scalar `ggml_vec_dot_*` computes it.
pub fn vec_dot(ty: GgmlType, n: usize, weight_row: &[u8], act_row: &[u8]) -> Result<f32> {
    if !VEC_DOT_TYPES.contains(&ty) {
        return Err(Error::UnsupportedType { ty, op: "vec_dot" });
    }
    let act_ty = vec_dot_type(ty);
    check_bytes(ty, "weight row", n, weight_row.len())?;
    check_bytes(act_ty, "activation row", n, act_row.len())?;
    let sum = vec_dot::dot(ty, n, weight_row, act_row);
    debug_assert!(sum.is_some());
    Ok(sum.unwrap_or(0.0))
}
