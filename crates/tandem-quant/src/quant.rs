//! Reference quantizers, ported from ggml/src/ggml-quants.c (`quantize_row_*_ref`,
//! `quantize_iq4_nl`, `quantize_iq4_xs`) so that the output is byte-identical with what
//! `llama-quantize` writes without an importance matrix.
//!
//! Float expressions keep C's operand order (`a * b * c` is `(a * b) * c`, an int operand is
//! converted to f32 where C converts it), and C's float -> small-int casts follow x86-64.

// Index loops mirror the C being ported line for line, which keeps the port checkable.
#![allow(clippy::needless_range_loop)]

use half::f16;
use tandem_gguf::{GgmlType, QK_K};

use crate::blocks::*;
use crate::kquant_helpers::*;

/// Quantizes `src` (a whole number of blocks, checked by the caller) into `dst` (exactly sized).
/// Returns false when `ty` has no quantizer here.
pub(crate) fn quantize_into(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> bool {
    block_types!(ty, src, dst, {
        GgmlType::F32 => {
            for (o, v) in dst.chunks_exact_mut(4).zip(src) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, v) in dst.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&f32_to_fp16(*v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (o, v) in dst.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
            }
        }
        _ => return false,
    });
    true
}

/// Runs `f` over each block-sized chunk of `src` and stores the blocks in `dst`.
fn each_block<B: Block>(src: &[f32], dst: &mut [u8], f: impl Fn(&[f32]) -> B) {
    for (i, x) in src.chunks_exact(B::TYPE.block_size()).enumerate() {
        write_block(dst, i, &f(x));
    }
}

/// `d ? 1.0f/d : 0.0f` (a NaN `d` counts as non-zero, as in C).
#[inline]
fn inv_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// The value of largest magnitude, first one wins (the `amax`/`max` loop of the symmetric types).
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// ggml `MAX(amax, fabsf(v))` over `x`: a NaN input propagates, unlike `f32::max`.
#[inline]
fn c_absmax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |amax, v| if amax > v.abs() { amax } else { v.abs() })
}

/// Minimum and maximum as ggml's legacy quantizers compute them (`v < min`, `v > max`).
#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// ggml `quantize_row_q4_0_ref`.
fn q4_0(x: &[f32]) -> BlockQ4_0 {
    let d = signed_absmax(x) / -8.0;
    let id = inv_or_zero(d);
    let mut b = BlockQ4_0 { d: f32_to_fp16(d), qs: [0; QK4_0 / 2] };
    for j in 0..QK4_0 / 2 {
        let xi0 = 15.min(c_f32_to_i8(x[j] * id + 8.5) as i32) as u8;
        let xi1 = 15.min(c_f32_to_i8(x[QK4_0 / 2 + j] * id + 8.5) as i32) as u8;
        b.qs[j] = xi0 | (xi1 << 4);
    }
    b
}

/// ggml `quantize_row_q4_1_ref`.
fn q4_1(x: &[f32]) -> BlockQ4_1 {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inv_or_zero(d);
    let mut b = BlockQ4_1 { d: f32_to_fp16(d), m: f32_to_fp16(min), qs: [0; QK4_1 / 2] };
    for j in 0..QK4_1 / 2 {
        let xi0 = 15.min(c_f32_to_i8((x[j] - min) * id + 0.5) as i32) as u8;
        let xi1 = 15.min(c_f32_to_i8((x[QK4_1 / 2 + j] - min) * id + 0.5) as i32) as u8;
        b.qs[j] = xi0 | (xi1 << 4);
    }
    b
}

/// Packs 32 five-bit levels into Q5 nibbles and the 32-bit high-bit word.
#[inline]
fn pack_q5(xi: impl Fn(usize) -> u8, qs: &mut [u8; 16]) -> [u8; 4] {
    let mut qh = 0u32;
    for j in 0..16 {
        let (xi0, xi1) = (xi(j), xi(j + 16));
        qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
        qh |= (((xi0 & 0x10) >> 4) as u32) << j;
        qh |= (((xi1 & 0x10) >> 4) as u32) << (j + 16);
    }
    qh.to_le_bytes()
}

/// ggml `quantize_row_q5_0_ref`.
fn q5_0(x: &[f32]) -> BlockQ5_0 {
    let d = signed_absmax(x) / -16.0;
    let id = inv_or_zero(d);
    let mut qs = [0u8; QK5_0 / 2];
    let qh = pack_q5(|j| 31.min(c_f32_to_i8(x[j] * id + 16.5) as i32) as u8, &mut qs);
    BlockQ5_0 { d: f32_to_fp16(d), qh, qs }
}

/// ggml `quantize_row_q5_1_ref`.
fn q5_1(x: &[f32]) -> BlockQ5_1 {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inv_or_zero(d);
    let mut qs = [0u8; QK5_1 / 2];
    let qh = pack_q5(|j| c_f32_to_u8((x[j] - min) * id + 0.5), &mut qs);
    BlockQ5_1 { d: f32_to_fp16(d), m: f32_to_fp16(min), qh, qs }
}

/// ggml `quantize_row_q8_0_ref`.
fn q8_0(x: &[f32]) -> BlockQ8_0 {
    let d = c_absmax(x) / 127.0;
    let id = inv_or_zero(d);
    let mut b = BlockQ8_0 { d: f32_to_fp16(d), qs: [0; QK8_0] };
    for (q, v) in b.qs.iter_mut().zip(x) {
        *q = c_f32_to_i8((v * id).round());
    }
    b
}

/// ggml `quantize_row_q8_1_ref`: Q8_0 plus the fp16 of `d * sum(qs)`.
fn q8_1(x: &[f32]) -> BlockQ8_1 {
    let d = c_absmax(x) / 127.0;
    let id = inv_or_zero(d);
    let mut b = BlockQ8_1 { d: f32_to_fp16(d), s: f16::ZERO, qs: [0; QK8_1] };
    let mut sum = 0i32;
    for (q, v) in b.qs.iter_mut().zip(x) {
        *q = c_f32_to_i8((v * id).round());
        sum += *q as i32;
    }
    b.s = f32_to_fp16(sum as f32 * d);
    b
}

/// Packs 256 two-bit levels the way Q2_K and Q3_K store them.
#[inline]
fn pack_2bit(l: impl Fn(usize) -> u8, qs: &mut [u8; QK_K / 4]) {
    for j in (0..QK_K).step_by(128) {
        for k in 0..32 {
            qs[j / 4 + k] = l(j + k) | (l(j + k + 32) << 2) | (l(j + k + 64) << 4) | (l(j + k + 96) << 6);
        }
    }
}

/// ggml `quantize_row_q2_K_ref`.
fn q2_k(x: &[f32]) -> BlockQ2K {
    const Q4SCALE: f32 = 15.0;
    let search = Qkx2Search { rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: true };
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let mut mins = [0f32; QK_K / 16];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..QK_K / 16 {
        let xg = &x[16 * j..16 * j + 16];
        let weights: [f32; 16] = std::array::from_fn(|k| xg[k].abs());
        (scales[j], mins[j]) = make_qkx2_quants(3, xg, &weights, &mut l[16 * j..], &search);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let mut b = BlockQ2K { scales: [0; QK_K / 16], qs: [0; QK_K / 4], d: f16::ZERO, dmin: f16::ZERO };
    if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for j in 0..QK_K / 16 {
            b.scales[j] = nearest_int(iscale * scales[j]) as u8;
        }
        b.d = f32_to_fp16(max_scale / Q4SCALE);
    } else {
        b.d = f32_to_fp16(0.0);
    }
    if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for j in 0..QK_K / 16 {
            b.scales[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        b.dmin = f32_to_fp16(max_min / Q4SCALE);
    } else {
        b.dmin = f32_to_fp16(0.0);
    }
    for j in 0..QK_K / 16 {
        let d = fp16_to_f32(b.d) * (b.scales[j] & 0xF) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = fp16_to_f32(b.dmin) * (b.scales[j] >> 4) as f32;
        for ii in 0..16 {
            l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(|k| l[k], &mut b.qs);
    b
}

/// ggml `quantize_row_q3_K_ref`.
fn q3_k(x: &[f32]) -> BlockQ3K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for j in 0..QK_K / 16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..], true);
        let scale = scales[j].abs();
        if scale > amax {
            amax = scale;
            max_scale = scales[j];
        }
    }
    let mut b = BlockQ3K { hmask: [0; QK_K / 8], qs: [0; QK_K / 4], scales: [0; 12], d: f16::ZERO };
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..QK_K / 16 {
            let lj = nearest_int(iscale * scales[j]) as i8;
            let lj = ((lj as i32).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                b.scales[j] = lj & 0xF;
            } else {
                b.scales[j - 8] |= (lj & 0xF) << 4;
            }
            b.scales[j % 4 + 8] |= (lj >> 4) << (2 * (j / 4));
        }
        b.d = f32_to_fp16(1.0 / iscale);
    } else {
        b.d = f32_to_fp16(0.0);
    }
    for j in 0..QK_K / 16 {
        let sc = if j < 8 { b.scales[j] & 0xF } else { b.scales[j - 8] >> 4 };
        let sc = (sc | (((b.scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32;
        let d = fp16_to_f32(b.d) * sc as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    // The high bit of the first 32 quants goes to bit 0 of hmask[0..32], the next 32 to bit 1, ...
    for (j, lj) in l.iter_mut().enumerate() {
        if *lj > 3 {
            b.hmask[j % (QK_K / 8)] |= 1 << (j / (QK_K / 8));
            *lj -= 4;
        }
    }
    pack_2bit(|k| l[k] as u8, &mut b.qs);
    b
}

/// The per-32 scale/min search shared by Q4_K and Q5_K (`quantize_row_q{4,5}_K_ref`), then the
/// 6-bit packing of scales and mins. Returns (levels, d, dmin, packed scales).
fn qkx_superblock(x: &[f32], nmax: i32, search: &Qkx2Search) -> ([u8; QK_K], f16, f16, [u8; K_SCALE_SIZE]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 32];
    let mut mins = [0f32; QK_K / 32];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..QK_K / 32 {
        let xg = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for v in xg {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|k| av_x + xg[k].abs());
        (scales[j], mins[j]) = make_qkx2_quants(nmax, xg, &weights, &mut l[32 * j..], search);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; K_SCALE_SIZE];
    for j in 0..QK_K / 32 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d = f32_to_fp16(max_scale / 63.0);
    let dmin = f32_to_fp16(max_min / 63.0);
    for j in 0..QK_K / 32 {
        let (sc, m) = get_scale_min_k4(j, &packed);
        let dj = fp16_to_f32(d) * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = fp16_to_f32(dmin) * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (l, d, dmin, packed)
}

/// ggml `quantize_row_q4_K_ref`.
fn q4_k(x: &[f32]) -> BlockQ4K {
    let search = Qkx2Search { rmin: -1.0, rdelta: 0.1, nstep: 20, use_mad: false };
    let (l, d, dmin, scales) = qkx_superblock(x, 15, &search);
    let mut b = BlockQ4K { d, dmin, scales, qs: [0; QK_K / 2] };
    for (j, chunk) in (0..QK_K).step_by(64).zip(b.qs.chunks_exact_mut(32)) {
        for k in 0..32 {
            chunk[k] = l[j + k] | (l[j + k + 32] << 4);
        }
    }
    b
}

/// ggml `quantize_row_q5_K_ref`.
fn q5_k(x: &[f32]) -> BlockQ5K {
    let search = Qkx2Search { rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: false };
    let (l, d, dmin, scales) = qkx_superblock(x, 31, &search);
    let mut b = BlockQ5K { d, dmin, scales, qh: [0; QK_K / 8], qs: [0; QK_K / 2] };
    let (mut m1, mut m2) = (1u8, 2u8);
    for (n, ql) in (0..QK_K).step_by(64).zip(b.qs.chunks_exact_mut(32)) {
        for j in 0..32 {
            let mut l1 = l[n + j];
            if l1 > 15 {
                l1 -= 16;
                b.qh[j] |= m1;
            }
            let mut l2 = l[n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                b.qh[j] |= m2;
            }
            ql[j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
    }
    b
}

/// ggml `quantize_row_q6_K_ref`.
fn q6_k(x: &[f32]) -> BlockQ6K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for ib in 0..QK_K / 16 {
        let scale = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..], 1, None);
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    let mut b = BlockQ6K { ql: [0; QK_K / 2], qh: [0; QK_K / 4], scales: [0; QK_K / 16], d: f16::ZERO };
    if max_abs_scale < GROUP_MAX_EPS {
        b.d = f32_to_fp16(0.0);
        return b;
    }
    let iscale = -128.0 / max_scale;
    b.d = f32_to_fp16(1.0 / iscale);
    for ib in 0..QK_K / 16 {
        b.scales[ib] = 127.min(nearest_int(iscale * scales[ib])) as i8;
    }
    for j in 0..QK_K / 16 {
        let d = fp16_to_f32(b.d) * b.scales[j] as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    for (half, j) in (0..QK_K).step_by(128).enumerate() {
        let (ql, qh) = (&mut b.ql[64 * half..64 * half + 64], &mut b.qh[32 * half..32 * half + 32]);
        for k in 0..32 {
            let q = |o: usize| l[j + k + o] as u8;
            ql[k] = (q(0) & 0xF) | ((q(64) & 0xF) << 4);
            ql[k + 32] = (q(32) & 0xF) | ((q(96) & 0xF) << 4);
            qh[k] = (q(0) >> 4) | ((q(32) >> 4) << 2) | ((q(64) >> 4) << 4) | ((q(96) >> 4) << 6);
        }
    }
    b
}

/// ggml `quantize_row_q8_K_ref`. Deviation: an all-zero block gets zero `bsums` (ggml leaves
/// them as they were in the destination buffer).
fn q8_k(x: &[f32]) -> BlockQ8K {
    let mut b = BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] };
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        return b;
    }
    // ggml uses -127 rather than -128 so that the IQ2 AVX kernels need no special case.
    let iscale = -127.0 / max;
    for (q, v) in b.qs.iter_mut().zip(x) {
        *q = 127.min(nearest_int(iscale * v)) as i8;
    }
    for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = g.iter().map(|&q| q as i32).sum::<i32>() as i16;
    }
    b.d = 1.0 / iscale;
    b
}

/// Number of alternative scales IQ4 tries on each side (ggml `quantize_iq4_nl`/`_xs`: ntry 7).
const IQ4_NTRY: i32 = 7;

/// The scale search for one group of 32 of `quantize_row_iq4_nl_impl` without importance
/// weights (weights `x*x`). Fills `lb` with the first-pass levels; None for an all-zero group.
fn iq4_group_scale(xb: &[f32], lb: &mut [u8]) -> Option<f32> {
    let values = &KVALUES_IQ4NL;
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return None;
    }
    let v0 = values[0] as f32;
    let mut d = if IQ4_NTRY > 0 { -max / v0 } else { max / v0 };
    let mut id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for (j, &x) in xb.iter().enumerate() {
        let l = best_index_int8(values, id * x);
        lb[j] = l as u8;
        let q = values[l] as f32;
        let w = x * x;
        sumqx += w * q * x;
        sumq2 += w * q * q;
    }
    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -IQ4_NTRY..=IQ4_NTRY {
        id = (itry + values[0] as i32) as f32 / max;
        sumqx = 0.0;
        sumq2 = 0.0;
        for &x in xb {
            let q = values[best_index_int8(values, id * x)] as f32;
            let w = x * x;
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    Some(d)
}

/// Packs 32-element groups of 4-bit indices: element j in the low nibble, j+16 in the high one.
#[inline]
fn pack_nibbles(l: &[u8], q4: &mut [u8]) {
    for (i, out) in q4.chunks_exact_mut(16).enumerate() {
        for j in 0..16 {
            out[j] = l[32 * i + j] | (l[32 * i + 16 + j] << 4);
        }
    }
}

/// ggml `quantize_iq4_nl` without an importance matrix (`quantize_row_iq4_nl_impl`, one group,
/// ntry 7) — what llama-quantize writes. ggml's `quantize_row_iq4_nl_ref` (ntry -1) differs.
fn iq4_nl(x: &[f32]) -> BlockIQ4NL {
    let mut l = [0u8; QK4_NL];
    let scale = iq4_group_scale(x, &mut l).unwrap_or(0.0);
    let id = inv_or_zero(scale);
    for (lj, &v) in l.iter_mut().zip(x) {
        *lj = best_index_int8(&KVALUES_IQ4NL, id * v) as u8;
    }
    let mut b = BlockIQ4NL { d: f32_to_fp16(scale), qs: [0; QK4_NL / 2] };
    pack_nibbles(&l, &mut b.qs);
    b
}

/// ggml `quantize_iq4_xs` without an importance matrix (`quantize_row_iq4_nl_impl`, 8 groups).
fn iq4_xs(x: &[f32]) -> BlockIQ4XS {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 32];
    let (mut max_scale, mut amax_scale) = (0f32, 0f32);
    for ib in 0..QK_K / 32 {
        let Some(d) = iq4_group_scale(&x[32 * ib..32 * ib + 32], &mut l[32 * ib..32 * ib + 32]) else {
            continue;
        };
        scales[ib] = d;
        if d.abs() > amax_scale {
            amax_scale = d.abs();
            max_scale = d;
        }
    }
    let mut b = BlockIQ4XS { d: f16::ZERO, scales_h: 0, scales_l: [0; QK_K / 64], qs: [0; QK_K / 2] };
    let d = -max_scale / 32.0;
    b.d = f32_to_fp16(d);
    let id = inv_or_zero(d);
    for ib in 0..QK_K / 32 {
        let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
        let idl = inv_or_zero(d * ls as f32);
        for j in 0..32 {
            l[32 * ib + j] = best_index_int8(&KVALUES_IQ4NL, idl * x[32 * ib + j]) as u8;
        }
        let ls = (ls + 32) as u8;
        if ib % 2 == 0 {
            b.scales_l[ib / 2] = ls & 0xF;
        } else {
            b.scales_l[ib / 2] |= (ls & 0xF) << 4;
        }
        b.scales_h |= ((ls >> 4) as u16) << (2 * (ib % 8));
    }
    pack_nibbles(&l, &mut b.qs);
    b
}
