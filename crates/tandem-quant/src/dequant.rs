//! Scalar reference dequantization, ported from ggml/src/ggml-quants.c (`dequantize_row_*`)
//! with the same f32 operation order, so results are bit-identical with ggml's.

use tandem_gguf::{GgmlType, QK_K};

use crate::blocks::*;
use crate::iq;
use crate::kquant_helpers::{get_scale_min_k4, unpack_q3k_scales};

/// Dequantizes `src` (exactly sized, checked by the caller) into `dst`. Returns false when `ty`
/// has no dequantizer here.
pub(crate) fn dequantize_into(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> bool {
    block_types!(ty, src, dst, {
        GgmlType::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = fp16_to_f32(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])));
            }
        }
        GgmlType::BF16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::IQ2_XXS => each_block(src, dst, iq::dequant_iq2_xxs),
        GgmlType::IQ2_XS => each_block(src, dst, iq::dequant_iq2_xs),
        GgmlType::IQ2_S => each_block(src, dst, iq::dequant_iq2_s),
        GgmlType::IQ3_XXS => each_block(src, dst, iq::dequant_iq3_xxs),
        GgmlType::IQ3_S => each_block(src, dst, iq::dequant_iq3_s),
        GgmlType::IQ1_S => each_block(src, dst, iq::dequant_iq1_s),
        GgmlType::IQ1_M => each_block(src, dst, iq::dequant_iq1_m),
        _ => return false,
    });
    true
}

/// Reads each block of `src` (unaligned is fine) and lets `f` fill its slice of `dst`.
fn each_block<B: Block>(src: &[u8], dst: &mut [f32], f: impl Fn(&B, &mut [f32])) {
    for (i, y) in dst.chunks_exact_mut(B::TYPE.block_size()).enumerate() {
        f(&read_block::<B>(src, i), y);
    }
}

/// ggml `dequantize_row_q4_0`.
fn q4_0(x: &BlockQ4_0, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for (j, &q) in x.qs.iter().enumerate() {
        y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        y[j + QK4_0 / 2] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// ggml `dequantize_row_q4_1`.
fn q4_1(x: &BlockQ4_1, y: &mut [f32]) {
    let (d, m) = (fp16_to_f32(x.d), fp16_to_f32(x.m));
    for (j, &q) in x.qs.iter().enumerate() {
        y[j] = (q & 0x0F) as f32 * d + m;
        y[j + QK4_1 / 2] = (q >> 4) as f32 * d + m;
    }
}

/// ggml `dequantize_row_q5_0`.
fn q5_0(x: &BlockQ5_0, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    let qh = u32::from_le_bytes(x.qh);
    for (j, &q) in x.qs.iter().enumerate() {
        let xh_0 = ((qh >> j) << 4) & 0x10;
        let xh_1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((q & 0x0F) as u32 | xh_0) as i32 - 16) as f32 * d;
        y[j + QK5_0 / 2] = (((q >> 4) as u32 | xh_1) as i32 - 16) as f32 * d;
    }
}

/// ggml `dequantize_row_q5_1`.
fn q5_1(x: &BlockQ5_1, y: &mut [f32]) {
    let (d, m) = (fp16_to_f32(x.d), fp16_to_f32(x.m));
    let qh = u32::from_le_bytes(x.qh);
    for (j, &q) in x.qs.iter().enumerate() {
        let xh_0 = ((qh >> j) << 4) & 0x10;
        let xh_1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((q & 0x0F) as u32 | xh_0) as f32 * d + m;
        y[j + QK5_1 / 2] = ((q >> 4) as u32 | xh_1) as f32 * d + m;
    }
}

/// ggml `dequantize_row_q8_0`.
fn q8_0(x: &BlockQ8_0, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for (o, &q) in y.iter_mut().zip(&x.qs) {
        *o = q as f32 * d;
    }
}

/// Q8_1 as `d * q` (ggml has no `dequantize_row_q8_1`; the CUDA backend's Q8_1 -> f32 and the
/// meaning of the format agree; `s` is redundant).
fn q8_1(x: &BlockQ8_1, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for (o, &q) in y.iter_mut().zip(&x.qs) {
        *o = q as f32 * d;
    }
}

/// ggml `dequantize_row_q2_K`.
fn q2_k(x: &BlockQ2K, y: &mut [f32]) {
    let (d, min) = (fp16_to_f32(x.d), fp16_to_f32(x.dmin));
    let mut out = 0;
    let mut is = 0;
    for q in x.qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for half in [&q[..16], &q[16..]] {
                let sc = x.scales[is];
                is += 1;
                let dl = d * (sc & 0xF) as f32;
                let ml = min * (sc >> 4) as f32;
                for &b in half {
                    y[out] = dl * ((b >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// ggml `dequantize_row_q3_K`.
fn q3_k(x: &BlockQ3K, y: &mut [f32]) {
    let d_all = fp16_to_f32(x.d);
    let scales = unpack_q3k_scales(&x.scales);
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for q in x.qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for (off, half) in [(0, &q[..16]), (16, &q[16..])] {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for (l, &b) in half.iter().enumerate() {
                    let hbit = if x.hmask[off + l] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (((b >> shift) & 3) as i32 - hbit) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// The scale and min of group `j` of a Q4_K / Q5_K block whose super-block scale and min are `d`
/// and `min`.
fn scale_min(j: usize, scales: &[u8; K_SCALE_SIZE], d: f32, min: f32) -> (f32, f32) {
    let (sc, m) = get_scale_min_k4(j, scales);
    (d * sc as f32, min * m as f32)
}

/// ggml `dequantize_row_q4_K`.
fn q4_k(x: &BlockQ4K, y: &mut [f32]) {
    let (d, min) = (fp16_to_f32(x.d), fp16_to_f32(x.dmin));
    for (j, (q, y)) in x.qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (d1, m1) = scale_min(2 * j, &x.scales, d, min);
        let (d2, m2) = scale_min(2 * j + 1, &x.scales, d, min);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// ggml `dequantize_row_q5_K`.
fn q5_k(x: &BlockQ5K, y: &mut [f32]) {
    let (d, min) = (fp16_to_f32(x.d), fp16_to_f32(x.dmin));
    let (mut u1, mut u2) = (1u8, 2u8);
    for (j, (ql, y)) in x.qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (d1, m1) = scale_min(2 * j, &x.scales, d, min);
        let (d2, m2) = scale_min(2 * j + 1, &x.scales, d, min);
        for l in 0..32 {
            let h1 = if x.qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if x.qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
        u1 <<= 2;
        u2 <<= 2;
    }
}

/// ggml `dequantize_row_q6_K`.
fn q6_k(x: &BlockQ6K, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for n in 0..QK_K / 128 {
        let (ql, qh) = (&x.ql[64 * n..64 * n + 64], &x.qh[32 * n..32 * n + 32]);
        let sc = &x.scales[8 * n..8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * sc[is] as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
        }
    }
}

/// ggml `dequantize_row_q8_K`.
fn q8_k(x: &BlockQ8K, y: &mut [f32]) {
    for (o, &q) in y.iter_mut().zip(&x.qs) {
        *o = x.d * q as f32;
    }
}

/// ggml `dequantize_row_iq4_nl`.
fn iq4_nl(x: &BlockIQ4NL, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for (j, &q) in x.qs.iter().enumerate() {
        y[j] = d * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
        y[j + QK4_NL / 2] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
    }
}

/// ggml `dequantize_row_iq4_xs`.
fn iq4_xs(x: &BlockIQ4XS, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for (ib, (qs, y)) in x.qs.chunks_exact(16).zip(y.chunks_exact_mut(32)).enumerate() {
        let ls = ((x.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) as i32 | ((((x.scales_h >> (2 * ib)) & 3) as i32) << 4);
        let dl = d * (ls - 32) as f32;
        for j in 0..16 {
            y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
            y[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
        }
    }
}
