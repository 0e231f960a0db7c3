//! The IQ1/IQ2/IQ3 families (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): groups of 8
//! or 4 weights taken from a fixed grid (`iq_tables`), with sign bits and small odd scales.
//! Dequantization ports ggml-quants.c's `dequantize_row_iq*` with its f32 operation order; the
//! dot products port ggml-cpu/quants.c's `ggml_vec_dot_iq*_q8_K_generic` (integer sums per
//! block, one f32 term per block). ggml has no reference quantizer for these types that works
//! without an importance matrix, and neither does tandem: they are read, never written.

// Index loops mirror the C being ported line for line, which keeps the port checkable.
#![allow(clippy::needless_range_loop)]

use crate::blocks::*;
use crate::iq_tables::*;
use tandem_gguf::QK_K;

/// ggml `kmask_iq2xs`: the bit of each of 8 weights in a sign byte.
const KMASK: [u8; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// ggml `IQ1S_DELTA` / `IQ1M_DELTA`: the shift of the IQ1 grid values.
pub const IQ1_DELTA: f32 = 0.125;

/// Byte `j` of a grid entry.
#[inline]
fn gb(entry: u64, j: usize) -> u8 {
    (entry >> (8 * j)) as u8
}

#[inline]
fn sign(signs: u8, j: usize) -> f32 {
    if signs & KMASK[j] != 0 {
        -1.0
    } else {
        1.0
    }
}

#[inline]
fn sign_i(signs: u8, j: usize) -> i32 {
    if signs & KMASK[j] != 0 {
        -1
    } else {
        1
    }
}

/// A grid entry of eight levels against `q8[..8]`, each level's sign from bit `j` of `signs`
/// (the IQ2 types).
fn signed_grid(grid: u64, signs: u8, q8: &[i8]) -> i32 {
    (0..8).map(|j| gb(grid, j) as i32 * q8[j] as i32 * sign_i(signs, j)).sum()
}

/// Two grid entries of four levels against `q8[..8]`, each level's sign from bit `j` of `signs`
/// (the IQ3 types' pairs of grid indices).
fn signed_grids(grid1: u64, grid2: u64, signs: u8, q8: &[i8]) -> i32 {
    let mut sum = 0;
    for j in 0..4 {
        sum += gb(grid1, j) as i32 * q8[j] as i32 * sign_i(signs, j);
        sum += gb(grid2, j) as i32 * q8[j + 4] as i32 * sign_i(signs, j + 4);
    }
    sum
}

/// IQ1_M's fp16 scale, spread over the top nibbles of its four u16 scale words.
pub fn iq1m_scale(scales: &[u8; 8]) -> f32 {
    let sc = |k: usize| u16::from_le_bytes([scales[2 * k], scales[2 * k + 1]]);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000);
    fp16_to_f32(half::f16::from_bits(bits))
}

/// IQ1_M's 16-bit scale words.
#[inline]
fn iq1m_words(scales: &[u8; 8]) -> [u16; 4] {
    std::array::from_fn(|k| u16::from_le_bytes([scales[2 * k], scales[2 * k + 1]]))
}

/// ggml `dequantize_row_iq2_xxs`.
pub(crate) fn dequant_iq2_xxs(x: &BlockIQ2XXS, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for ib32 in 0..8 {
        let aux0 = x.qs[4 * ib32] as u32 | (x.qs[4 * ib32 + 1] as u32) << 16;
        let aux1 = x.qs[4 * ib32 + 2] as u32 | (x.qs[4 * ib32 + 3] as u32) << 16;
        let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[((aux0 >> (8 * l)) & 0xFF) as usize];
            let signs = KSIGNS_IQ2XS[((aux1 >> (7 * l)) & 127) as usize];
            for j in 0..8 {
                y[32 * ib32 + 8 * l + j] = db * gb(grid, j) as f32 * sign(signs, j);
            }
        }
    }
}

/// ggml `dequantize_row_iq2_xs`.
pub(crate) fn dequant_iq2_xs(x: &BlockIQ2XS, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for ib32 in 0..8 {
        let db = [d * (0.5 + (x.scales[ib32] & 0xf) as f32) * 0.25, d * (0.5 + (x.scales[ib32] >> 4) as f32) * 0.25];
        for l in 0..4 {
            let q = x.qs[4 * ib32 + l];
            let grid = IQ2XS_GRID[(q & 511) as usize];
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            for j in 0..8 {
                y[32 * ib32 + 8 * l + j] = db[l / 2] * gb(grid, j) as f32 * sign(signs, j);
            }
        }
    }
}

/// ggml `dequantize_row_iq2_s`.
pub(crate) fn dequant_iq2_s(x: &BlockIQ2S, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    let (qs, signs) = x.qs.split_at(QK_K / 8);
    for ib32 in 0..8 {
        let db = [d * (0.5 + (x.scales[ib32] & 0xf) as f32) * 0.25, d * (0.5 + (x.scales[ib32] >> 4) as f32) * 0.25];
        for l in 0..4 {
            let dl = db[l / 2];
            let idx = qs[4 * ib32 + l] as usize | (((x.qh[ib32] as usize) << (8 - 2 * l)) & 0x300);
            let grid = IQ2S_GRID[idx];
            for j in 0..8 {
                y[32 * ib32 + 8 * l + j] = dl * gb(grid, j) as f32 * sign(signs[4 * ib32 + l], j);
            }
        }
    }
}

/// ggml `dequantize_row_iq3_xxs`.
pub(crate) fn dequant_iq3_xxs(x: &BlockIQ3XXS, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    let (qs, gas) = x.qs.split_at(QK_K / 4);
    for ib32 in 0..8 {
        let aux32 = u32::from_le_bytes(gas[4 * ib32..4 * ib32 + 4].try_into().unwrap());
        let db = d * (0.5 + (aux32 >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux32 >> (7 * l)) & 127) as usize];
            let grid1 = IQ3XXS_GRID[qs[8 * ib32 + 2 * l] as usize] as u64;
            let grid2 = IQ3XXS_GRID[qs[8 * ib32 + 2 * l + 1] as usize] as u64;
            let o = 32 * ib32 + 8 * l;
            for j in 0..4 {
                y[o + j] = db * gb(grid1, j) as f32 * sign(signs, j);
                y[o + j + 4] = db * gb(grid2, j) as f32 * sign(signs, j + 4);
            }
        }
    }
}

/// The grid index of IQ3_S pair `l` (0..4) of a group: low byte `q`, ninth bit from `qh`.
#[inline]
fn iq3s_index(q: u8, qh: u8, shift: usize) -> usize {
    q as usize | (((qh as usize) << shift) & 256)
}

/// ggml `dequantize_row_iq3_s`.
pub(crate) fn dequant_iq3_s(x: &BlockIQ3S, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for ib32 in (0..8).step_by(2) {
        let db1 = d * (1 + 2 * (x.scales[ib32 / 2] & 0xf) as i32) as f32;
        let db2 = d * (1 + 2 * (x.scales[ib32 / 2] >> 4) as i32) as f32;
        for (half, db) in [(0, db1), (1, db2)] {
            let g = ib32 + half;
            let qh = x.qh[g];
            for l in 0..4 {
                let grid1 = IQ3S_GRID[iq3s_index(x.qs[8 * g + 2 * l], qh, 8 - 2 * l)] as u64;
                let grid2 = IQ3S_GRID[iq3s_index(x.qs[8 * g + 2 * l + 1], qh, 7 - 2 * l)] as u64;
                let signs = x.signs[4 * g + l];
                let o = 32 * g + 8 * l;
                for j in 0..4 {
                    y[o + j] = db * gb(grid1, j) as f32 * sign(signs, j);
                    y[o + j + 4] = db * gb(grid2, j) as f32 * sign(signs, j + 4);
                }
            }
        }
    }
}

/// ggml `dequantize_row_iq1_s`.
pub(crate) fn dequant_iq1_s(x: &BlockIQ1S, y: &mut [f32]) {
    let d = fp16_to_f32(x.d);
    for ib in 0..8 {
        let qh = x.qh[ib];
        let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
        let delta = if qh & 0x8000 != 0 { -IQ1_DELTA } else { IQ1_DELTA };
        for l in 0..4 {
            let grid = IQ1S_GRID[x.qs[4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8)];
            for j in 0..8 {
                y[32 * ib + 8 * l + j] = dl * (gb(grid, j) as i8 as f32 + delta);
            }
        }
    }
}

/// The IQ1_M grid index of group of 8 `l` (0..4) within a group of 32 (`qh`: its two bytes).
#[inline]
fn iq1m_index(qs: u8, qh: &[u8], l: usize) -> usize {
    qs as usize | (((qh[l / 2] as usize) << (8 - 4 * (l % 2))) & 0x700)
}

/// ggml `dequantize_row_iq1_m`.
pub(crate) fn dequant_iq1_m(x: &BlockIQ1M, y: &mut [f32]) {
    let sc = iq1m_words(&x.scales);
    let d = iq1m_scale(&x.scales);
    for ib in 0..8 {
        let dl1 = d * (2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 0x7) + 1) as f32;
        let dl2 = d * (2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1) as f32;
        let qh = &x.qh[2 * ib..2 * ib + 2];
        let delta =
            [qh[0] & 0x08, qh[0] & 0x80, qh[1] & 0x08, qh[1] & 0x80]
                .map(|b| if b != 0 { -IQ1_DELTA } else { IQ1_DELTA });
        for l in 0..4 {
            let dl = if l < 2 { dl1 } else { dl2 };
            let grid = IQ1S_GRID[iq1m_index(x.qs[4 * ib + l], qh, l)];
            for j in 0..8 {
                y[32 * ib + 8 * l + j] = dl * (gb(grid, j) as i8 as f32 + delta[l]);
            }
        }
    }
}

/// ggml `ggml_vec_dot_iq2_xxs_q8_K_generic`, one block: `d * bsum` (the caller scales the sum
/// of all blocks by 1/8).
pub(crate) fn dot_iq2_xxs(x: &BlockIQ2XXS, y: &BlockQ8K) -> f32 {
    let d = fp16_to_f32(x.d) * y.d;
    let mut bsum = 0i32;
    for ib32 in 0..8 {
        let aux0 = x.qs[4 * ib32] as u32 | (x.qs[4 * ib32 + 1] as u32) << 16;
        let aux1 = x.qs[4 * ib32 + 2] as u32 | (x.qs[4 * ib32 + 3] as u32) << 16;
        let ls = 2 * (aux1 >> 28) as i32 + 1;
        let mut sumi = 0i32;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[((aux0 >> (8 * l)) & 0xFF) as usize];
            let signs = KSIGNS_IQ2XS[((aux1 >> (7 * l)) & 127) as usize];
            sumi += signed_grid(grid, signs, &y.qs[32 * ib32 + 8 * l..]);
        }
        bsum += sumi * ls;
    }
    d * bsum as f32
}

/// ggml `ggml_vec_dot_iq2_xs_q8_K_generic`, one block (the caller scales by 1/8).
pub(crate) fn dot_iq2_xs(x: &BlockIQ2XS, y: &BlockQ8K) -> f32 {
    let d = fp16_to_f32(x.d) * y.d;
    let mut bsum = 0i32;
    for ib32 in 0..8 {
        let ls1 = 2 * (x.scales[ib32] & 0xf) as i32 + 1;
        let ls2 = 2 * (x.scales[ib32] >> 4) as i32 + 1;
        for (half, ls) in [(0, ls1), (1, ls2)] {
            let mut sumi = 0i32;
            for l in 2 * half..2 * half + 2 {
                let q = x.qs[4 * ib32 + l];
                let grid = IQ2XS_GRID[(q & 511) as usize];
                let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
                sumi += signed_grid(grid, signs, &y.qs[32 * ib32 + 8 * l..]);
            }
            bsum += ls * sumi;
        }
    }
    d * bsum as f32
}

/// ggml `ggml_vec_dot_iq2_s_q8_K_generic`, one block (the caller scales by 1/8).
pub(crate) fn dot_iq2_s(x: &BlockIQ2S, y: &BlockQ8K) -> f32 {
    let d = fp16_to_f32(x.d) * y.d;
    let (qs, signs) = x.qs.split_at(QK_K / 8);
    let mut bsum = 0i32;
    for ib32 in 0..8 {
        let ls1 = 1 + 2 * (x.scales[ib32] & 0xf) as i32;
        let ls2 = 1 + 2 * (x.scales[ib32] >> 4) as i32;
        let mut sumi = [0i32; 2];
        for l in 0..4 {
            let idx = qs[4 * ib32 + l] as usize | (((x.qh[ib32] as usize) << (8 - 2 * l)) & 0x300);
            let grid = IQ2S_GRID[idx];
            sumi[l / 2] += signed_grid(grid, signs[4 * ib32 + l], &y.qs[32 * ib32 + 8 * l..]);
        }
        bsum += ls1 * sumi[0] + ls2 * sumi[1];
    }
    d * bsum as f32
}

/// ggml `ggml_vec_dot_iq3_xxs_q8_K_generic`, one block (the caller scales by 1/4).
pub(crate) fn dot_iq3_xxs(x: &BlockIQ3XXS, y: &BlockQ8K) -> f32 {
    let d = fp16_to_f32(x.d) * y.d;
    let (qs, gas) = x.qs.split_at(QK_K / 4);
    let mut bsum = 0i32;
    for ib32 in 0..8 {
        let aux32 = u32::from_le_bytes(gas[4 * ib32..4 * ib32 + 4].try_into().unwrap());
        let ls = 2 * (aux32 >> 28) as i32 + 1;
        let mut sumi = 0i32;
        for l in 0..4 {
            let grid1 = IQ3XXS_GRID[qs[8 * ib32 + 2 * l] as usize] as u64;
            let grid2 = IQ3XXS_GRID[qs[8 * ib32 + 2 * l + 1] as usize] as u64;
            let signs = KSIGNS_IQ2XS[((aux32 >> (7 * l)) & 127) as usize];
            let q8 = &y.qs[32 * ib32 + 8 * l..];
            sumi += signed_grids(grid1, grid2, signs, q8);
        }
        bsum += sumi * ls;
    }
    d * bsum as f32
}

/// ggml `ggml_vec_dot_iq3_s_q8_K_generic`, one block.
pub(crate) fn dot_iq3_s(x: &BlockIQ3S, y: &BlockQ8K) -> f32 {
    let d = fp16_to_f32(x.d) * y.d;
    let mut bsum = 0i32;
    for ib32 in (0..8).step_by(2) {
        let ls1 = 2 * (x.scales[ib32 / 2] & 0xf) as i32 + 1;
        let ls2 = 2 * (x.scales[ib32 / 2] >> 4) as i32 + 1;
        for (half, ls) in [(0, ls1), (1, ls2)] {
            let g = ib32 + half;
            let qh = x.qh[g];
            let mut sumi = 0i32;
            for l in 0..4 {
                let grid1 = IQ3S_GRID[iq3s_index(x.qs[8 * g + 2 * l], qh, 8 - 2 * l)] as u64;
                let grid2 = IQ3S_GRID[iq3s_index(x.qs[8 * g + 2 * l + 1], qh, 7 - 2 * l)] as u64;
                let signs = x.signs[4 * g + l];
                let q8 = &y.qs[32 * g + 8 * l..];
                sumi += signed_grids(grid1, grid2, signs, q8);
            }
            bsum += sumi * ls;
        }
    }
    d * bsum as f32
}

/// ggml `ggml_vec_dot_iq1_s_q8_K_generic`, one block.
pub(crate) fn dot_iq1_s(x: &BlockIQ1S, y: &BlockQ8K) -> f32 {
    let (mut sumi, mut sumi1) = (0i32, 0i32);
    for ib in 0..8 {
        let qh = x.qh[ib];
        let ls = 2 * ((qh >> 12) & 7) as i32 + 1;
        let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
        let mut lsum = 0i32;
        for l in 0..4 {
            let grid = IQ1S_GRID[x.qs[4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8)];
            for j in 0..8 {
                lsum += y.qs[32 * ib + 8 * l + j] as i32 * gb(grid, j) as i8 as i32;
            }
        }
        sumi += ls * lsum;
        sumi1 += ls * delta * (y.bsums[2 * ib] as i32 + y.bsums[2 * ib + 1] as i32);
    }
    fp16_to_f32(x.d) * y.d * (sumi as f32 + IQ1_DELTA * sumi1 as f32)
}

/// ggml `ggml_vec_dot_iq1_m_q8_K_generic`, one block.
pub(crate) fn dot_iq1_m(x: &BlockIQ1M, y: &BlockQ8K) -> f32 {
    let sc = iq1m_words(&x.scales);
    let (mut sumi1, mut sumi2) = (0i32, 0i32);
    for ib in 0..8 {
        let qh = &x.qh[2 * ib..2 * ib + 2];
        let delta = [qh[0] & 0x08, qh[0] & 0x80, qh[1] & 0x08, qh[1] & 0x80].map(|b| if b != 0 { -1 } else { 1 });
        let (mut sum1, mut sum2) = ([0i32; 2], [0i32; 2]);
        for l in 0..4 {
            let grid = IQ1S_GRID[iq1m_index(x.qs[4 * ib + l], qh, l)];
            let (mut lsum1, mut lsum2) = (0i32, 0i32);
            for j in 0..8 {
                let q = y.qs[32 * ib + 8 * l + j] as i32;
                lsum1 += q * gb(grid, j) as i8 as i32;
                lsum2 += q;
            }
            sum1[l / 2] += lsum1;
            sum2[l / 2] += lsum2 * delta[l];
        }
        let ls1 = 2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 0x7) as i32 + 1;
        let ls2 = 2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 0x7) as i32 + 1;
        sumi1 += sum1[0] * ls1 + sum1[1] * ls2;
        sumi2 += sum2[0] * ls1 + sum2[1] * ls2;
    }
    iq1m_scale(&x.scales) * y.d * (sumi1 as f32 + IQ1_DELTA * sumi2 as f32)
}
