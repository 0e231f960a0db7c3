//! Scalar dot products of a weight row with an activation row in the type ggml pairs with it,
//! ported from ggml/src/ggml-cpu/quants.c (`ggml_vec_dot_*_generic`) and ggml-cpu/vec.cpp
//! (the non-SIMD branches of `ggml_vec_dot_f32/_f16/_bf16`).
//!
//! The results equal ggml's scalar build bit for bit. ggml's SIMD kernels (AVX2, NEON, ...)
//! sum the same integer products exactly but combine the per-block float terms in a different
//! order (and with FMA), so against them only a relative difference of a few ulp of the
//! accumulated magnitude is expected, never bit equality.

// Index loops mirror the C being ported line for line, which keeps the port checkable.
#![allow(clippy::needless_range_loop)]

use tandem_gguf::{GgmlType, QK_K};

use crate::blocks::*;
use crate::iq;
use crate::kquant_helpers::{get_scale_min_k4, unpack_q3k_scales};

/// The dot product of `x` (weights of type `ty`) and `y` (activations of type
/// `vec_dot_type(ty)`), both exactly sized for `n` elements (checked by the caller).
/// None when `ty` has no dot product here.
pub(crate) fn dot(ty: GgmlType, n: usize, x: &[u8], y: &[u8]) -> Option<f32> {
    Some(match ty {
        GgmlType::F32 => dot_f32(x, y),
        GgmlType::F16 => dot_scalar(x, y, |b| fp16_to_f32(half::f16::from_bits(b))),
        GgmlType::BF16 => dot_scalar(x, y, bf16_to_f32),
        GgmlType::Q4_0 => blocks(n, x, y, q4_0_q8_0),
        GgmlType::Q4_1 => blocks(n, x, y, q4_1_q8_1),
        GgmlType::Q5_0 => blocks(n, x, y, q5_0_q8_0),
        GgmlType::Q5_1 => blocks(n, x, y, q5_1_q8_1),
        GgmlType::Q8_0 => blocks(n, x, y, q8_0_q8_0),
        GgmlType::IQ4_NL => blocks(n, x, y, iq4_nl_q8_0),
        GgmlType::Q2_K => blocks(n, x, y, q2_k_q8_k),
        GgmlType::IQ4_XS => blocks(n, x, y, iq4_xs_q8_k),
        GgmlType::IQ2_XXS => 0.125 * blocks(n, x, y, iq::dot_iq2_xxs),
        GgmlType::IQ2_XS => 0.125 * blocks(n, x, y, iq::dot_iq2_xs),
        GgmlType::IQ2_S => 0.125 * blocks(n, x, y, iq::dot_iq2_s),
        GgmlType::IQ3_XXS => 0.25 * blocks(n, x, y, iq::dot_iq3_xxs),
        GgmlType::IQ3_S => blocks(n, x, y, iq::dot_iq3_s),
        GgmlType::IQ1_S => blocks(n, x, y, iq::dot_iq1_s),
        GgmlType::IQ1_M => blocks(n, x, y, iq::dot_iq1_m),
        GgmlType::Q3_K => lanes(n, x, y, q3_k_q8_k),
        GgmlType::Q4_K => lanes(n, x, y, q4_k_q8_k),
        GgmlType::Q5_K => lanes(n, x, y, q5_k_q8_k),
        GgmlType::Q6_K => lanes(n, x, y, q6_k_q8_k),
        _ => return None,
    })
}

/// `ggml_vec_dot_f32` without SIMD: f32 products summed in f64.
fn dot_f32(x: &[u8], y: &[u8]) -> f32 {
    let mut sumf = 0f64;
    for (a, b) in x.chunks_exact(4).zip(y.chunks_exact(4)) {
        let a = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
        let b = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        sumf += (a * b) as f64;
    }
    sumf as f32
}

/// `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` without SIMD: f32 products summed in f64.
fn dot_scalar(x: &[u8], y: &[u8], to_f32: impl Fn(u16) -> f32) -> f32 {
    let mut sumf = 0f64;
    for (a, b) in x.chunks_exact(2).zip(y.chunks_exact(2)) {
        let a = to_f32(u16::from_le_bytes([a[0], a[1]]));
        let b = to_f32(u16::from_le_bytes([b[0], b[1]]));
        sumf += (a * b) as f64;
    }
    sumf as f32
}

/// Kernels whose per-block term is added straight to one f32 sum.
fn blocks<X: Block, Y: Block>(n: usize, x: &[u8], y: &[u8], f: impl Fn(&X, &Y) -> f32) -> f32 {
    let mut sumf = 0f32;
    for i in 0..n / X::TYPE.block_size() {
        sumf += f(&read_block::<X>(x, i), &read_block::<Y>(y, i));
    }
    sumf
}

/// Kernels of the k-quants that keep 8 f32 lane sums (added at the end) and subtract the min
/// terms from the scalar sum as they go: `f` returns (lane terms, min term).
fn lanes<X: Block>(n: usize, x: &[u8], y: &[u8], f: impl Fn(&X, &BlockQ8K) -> ([f32; 8], f32)) -> f32 {
    let mut sums = [0f32; 8];
    let mut sumf = 0f32;
    for i in 0..n / QK_K {
        let (lane, min_term) = f(&read_block::<X>(x, i), &read_block::<BlockQ8K>(y, i));
        for (s, t) in sums.iter_mut().zip(lane) {
            *s += t;
        }
        sumf -= min_term;
    }
    for s in sums {
        sumf += s;
    }
    sumf
}

/// ggml `ggml_vec_dot_q4_0_q8_0_generic` (one block).
fn q4_0_q8_0(x: &BlockQ4_0, y: &BlockQ8_0) -> f32 {
    let (mut sumi0, mut sumi1) = (0i32, 0i32);
    for j in 0..16 {
        sumi0 += ((x.qs[j] & 0x0F) as i32 - 8) * y.qs[j] as i32;
        sumi1 += ((x.qs[j] >> 4) as i32 - 8) * y.qs[j + 16] as i32;
    }
    (sumi0 + sumi1) as f32 * fp16_to_f32(x.d) * fp16_to_f32(y.d)
}

/// ggml `ggml_vec_dot_q4_1_q8_1_generic` (one block); uses the activation's stored fp16 sum `s`.
fn q4_1_q8_1(x: &BlockQ4_1, y: &BlockQ8_1) -> f32 {
    let (mut sumi0, mut sumi1) = (0i32, 0i32);
    for j in 0..16 {
        sumi0 += (x.qs[j] & 0x0F) as i32 * y.qs[j] as i32;
        sumi1 += (x.qs[j] >> 4) as i32 * y.qs[j + 16] as i32;
    }
    (fp16_to_f32(x.d) * fp16_to_f32(y.d)) * (sumi0 + sumi1) as f32 + fp16_to_f32(x.m) * fp16_to_f32(y.s)
}

/// ggml `ggml_vec_dot_q5_0_q8_0_generic` (one block).
fn q5_0_q8_0(x: &BlockQ5_0, y: &BlockQ8_0) -> f32 {
    let qh = u32::from_le_bytes(x.qh);
    let (mut sumi0, mut sumi1) = (0i32, 0i32);
    for j in 0..16 {
        let xh_0 = ((qh >> j) & 1) << 4;
        let xh_1 = ((qh >> (j + 16)) & 1) << 4;
        let x0 = ((x.qs[j] & 0x0F) as u32 | xh_0) as i32 - 16;
        let x1 = ((x.qs[j] >> 4) as u32 | xh_1) as i32 - 16;
        sumi0 += x0 * y.qs[j] as i32;
        sumi1 += x1 * y.qs[j + 16] as i32;
    }
    (fp16_to_f32(x.d) * fp16_to_f32(y.d)) * (sumi0 + sumi1) as f32
}

/// ggml `ggml_vec_dot_q5_1_q8_1_generic` (one block).
fn q5_1_q8_1(x: &BlockQ5_1, y: &BlockQ8_1) -> f32 {
    let qh = u32::from_le_bytes(x.qh);
    let (mut sumi0, mut sumi1) = (0i32, 0i32);
    for j in 0..16 {
        let xh_0 = ((qh >> j) << 4) & 0x10;
        let xh_1 = (qh >> (j + 12)) & 0x10;
        sumi0 += ((x.qs[j] & 0xF) as u32 | xh_0) as i32 * y.qs[j] as i32;
        sumi1 += ((x.qs[j] >> 4) as u32 | xh_1) as i32 * y.qs[j + 16] as i32;
    }
    (fp16_to_f32(x.d) * fp16_to_f32(y.d)) * (sumi0 + sumi1) as f32 + fp16_to_f32(x.m) * fp16_to_f32(y.s)
}

/// ggml `ggml_vec_dot_q8_0_q8_0_generic` (one block).
fn q8_0_q8_0(x: &BlockQ8_0, y: &BlockQ8_0) -> f32 {
    let sumi: i32 = x.qs.iter().zip(&y.qs).map(|(&a, &b)| a as i32 * b as i32).sum();
    sumi as f32 * (fp16_to_f32(x.d) * fp16_to_f32(y.d))
}

/// ggml `ggml_vec_dot_iq4_nl_q8_0_generic` (one block).
fn iq4_nl_q8_0(x: &BlockIQ4NL, y: &BlockQ8_0) -> f32 {
    let d = fp16_to_f32(y.d) * fp16_to_f32(x.d);
    let (mut sumi1, mut sumi2) = (0i32, 0i32);
    for j in 0..16 {
        sumi1 += y.qs[j] as i32 * KVALUES_IQ4NL[(x.qs[j] & 0xF) as usize] as i32;
        sumi2 += y.qs[j + 16] as i32 * KVALUES_IQ4NL[(x.qs[j] >> 4) as usize] as i32;
    }
    d * (sumi1 + sumi2) as f32
}

/// ggml `ggml_vec_dot_q2_K_q8_K_generic` (one block).
fn q2_k_q8_k(x: &BlockQ2K, y: &BlockQ8K) -> f32 {
    let sc = &x.scales;
    let mut summs = 0i32;
    for j in 0..16 {
        summs += y.bsums[j] as i32 * (sc[j] >> 4) as i32;
    }
    let dall = y.d * fp16_to_f32(x.d);
    let dmin = y.d * fp16_to_f32(x.dmin);
    let mut isum = 0i32;
    let mut is = 0;
    for (chunk, q2) in x.qs.chunks_exact(32).enumerate() {
        for (k, shift) in [0, 2, 4, 6].into_iter().enumerate() {
            let q8 = &y.qs[128 * chunk + 32 * k..128 * chunk + 32 * k + 32];
            for half in 0..2 {
                let d = (sc[is] & 0xF) as i32;
                is += 1;
                let mut isuml = 0i32;
                for l in 16 * half..16 * half + 16 {
                    isuml += q8[l] as i32 * ((q2[l] >> shift) & 3) as i32;
                }
                isum += d * isuml;
            }
        }
    }
    dall * isum as f32 - dmin * summs as f32
}

/// ggml `ggml_vec_dot_iq4_xs_q8_K_generic` (one block).
fn iq4_xs_q8_k(x: &BlockIQ4XS, y: &BlockQ8K) -> f32 {
    let d4d8 = fp16_to_f32(x.d) * y.d;
    let mut h = x.scales_h;
    let mut sumf = 0f32;
    for ib in (0..QK_K / 32).step_by(2) {
        let ls1 = (x.scales_l[ib / 2] & 0xF) as i32 | ((h << 4) & 0x30) as i32;
        let ls2 = (x.scales_l[ib / 2] >> 4) as i32 | ((h << 2) & 0x30) as i32;
        h >>= 4;
        for (k, ls) in [(ib, ls1), (ib + 1, ls2)] {
            let dl = d4d8 * (ls - 32) as f32;
            let (qs, q8) = (&x.qs[16 * k..16 * k + 16], &y.qs[32 * k..32 * k + 32]);
            let (mut sumi1, mut sumi2) = (0i32, 0i32);
            for j in 0..16 {
                sumi1 += q8[j] as i32 * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as i32;
                sumi2 += q8[j + 16] as i32 * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as i32;
            }
            sumf += dl * (sumi1 + sumi2) as f32;
        }
    }
    sumf
}

/// The `aux16`/`aux32` accumulation of the k-quant kernels: signed levels `a` times activations
/// times a per-16 scale, summed into 8 integer lanes (integer math, so the order is free).
fn accumulate_lanes(a: &[i8; QK_K], q8: &[i8; QK_K], scale16: impl Fn(usize) -> i32) -> [i32; 8] {
    let mut aux32 = [0i32; 8];
    for g in 0..QK_K / 8 {
        let scale = scale16(g / 2);
        for l in 0..8 {
            let aux16 = (q8[8 * g + l] as i16).wrapping_mul(a[8 * g + l] as i16);
            aux32[l] = aux32[l].wrapping_add(scale.wrapping_mul(aux16 as i32));
        }
    }
    aux32
}

/// `sums[l] += d * aux32[l]` terms of one block.
fn lane_terms(d: f32, aux32: [i32; 8]) -> [f32; 8] {
    aux32.map(|v| d * v as f32)
}

/// ggml `ggml_vec_dot_q3_K_q8_K_generic` (one block).
fn q3_k_q8_k(x: &BlockQ3K, y: &BlockQ8K) -> ([f32; 8], f32) {
    let mut a = [0i8; QK_K];
    let mut m = 1u8;
    for (chunk, q3) in x.qs.chunks_exact(32).enumerate() {
        for (k, shift) in [0, 2, 4, 6].into_iter().enumerate() {
            let base = 128 * chunk + 32 * k;
            for l in 0..32 {
                let hbit = if x.hmask[l] & m != 0 { 0 } else { 4 };
                a[base + l] = ((q3[l] >> shift) & 3) as i8 - hbit;
            }
            m <<= 1;
        }
    }
    let scales = unpack_q3k_scales(&x.scales);
    let aux32 = accumulate_lanes(&a, &y.qs, |j| scales[j] as i32 - 32);
    (lane_terms(fp16_to_f32(x.d) * y.d, aux32), 0.0)
}

/// The 8 six-bit scales and mins of a Q4_K / Q5_K block (the `utmp`/`kmask` unpacking).
fn k4_scales_mins(packed: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    for j in 0..8 {
        (scales[j], mins[j]) = get_scale_min_k4(j, packed);
    }
    (scales, mins)
}

/// `sum(bsums[j] * mins[j/2])`, the min correction of Q4_K / Q5_K.
fn min_sum(y: &BlockQ8K, mins: &[u8; 8]) -> i32 {
    (0..QK_K / 16).map(|j| y.bsums[j] as i32 * mins[j / 2] as i32).sum()
}

/// ggml `ggml_vec_dot_q4_K_q8_K_generic` (one block).
fn q4_k_q8_k(x: &BlockQ4K, y: &BlockQ8K) -> ([f32; 8], f32) {
    let mut a = [0i8; QK_K];
    for (j, q4) in x.qs.chunks_exact(32).enumerate() {
        for l in 0..32 {
            a[64 * j + l] = (q4[l] & 0xF) as i8;
            a[64 * j + 32 + l] = (q4[l] >> 4) as i8;
        }
    }
    k4_terms(&a, &x.scales, x.d, x.dmin, y)
}

/// The rest of Q4_K's and Q5_K's dot products once their levels `a` are unpacked: the 6-bit
/// scales and mins of `scales`, the mins against the activations' sums, the lanes' scaled sums.
fn k4_terms(
    a: &[i8; QK_K],
    scales: &[u8; K_SCALE_SIZE],
    d: half::f16,
    dmin: half::f16,
    y: &BlockQ8K,
) -> ([f32; 8], f32) {
    let (scales, mins) = k4_scales_mins(scales);
    let sumi = min_sum(y, &mins);
    let aux32 = accumulate_lanes(a, &y.qs, |j| scales[j / 2] as i32);
    let dmin = fp16_to_f32(dmin) * y.d;
    (lane_terms(fp16_to_f32(d) * y.d, aux32), dmin * sumi as f32)
}

/// ggml `ggml_vec_dot_q5_K_q8_K_generic` (one block).
fn q5_k_q8_k(x: &BlockQ5K, y: &BlockQ8K) -> ([f32; 8], f32) {
    let mut a = [0i8; QK_K];
    let mut m = 1u8;
    for (j, q4) in x.qs.chunks_exact(32).enumerate() {
        for l in 0..32 {
            a[64 * j + l] = (q4[l] & 0xF) as i8 + if x.qh[l] & m != 0 { 16 } else { 0 };
            a[64 * j + 32 + l] = (q4[l] >> 4) as i8 + if x.qh[l] & (m << 1) != 0 { 16 } else { 0 };
        }
        m <<= 2;
    }
    k4_terms(&a, &x.scales, x.d, x.dmin, y)
}

/// ggml `ggml_vec_dot_q6_K_q8_K_generic` (one block).
fn q6_k_q8_k(x: &BlockQ6K, y: &BlockQ8K) -> ([f32; 8], f32) {
    let mut a = [0i8; QK_K];
    for n in 0..QK_K / 128 {
        let (ql, qh) = (&x.ql[64 * n..64 * n + 64], &x.qh[32 * n..32 * n + 32]);
        let a = &mut a[128 * n..128 * n + 128];
        for l in 0..32 {
            a[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            a[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            a[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            a[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    let aux32 = accumulate_lanes(&a, &y.qs, |j| x.scales[j] as i32);
    (lane_terms(fp16_to_f32(x.d) * y.d, aux32), 0.0)
}
