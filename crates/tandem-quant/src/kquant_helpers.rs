//! The scale searches of ggml's reference quantizers (ggml/src/ggml-quants.c), ported with the
//! same f32 operation order so the chosen scales and levels are bit-identical.
//!
//! Rust never contracts `a * b + c` into an FMA, which matches ggml-base: ggml-quants.c is
//! compiled without `-march` flags (no FMA available) and without `-ffast-math`.

// Index loops mirror the C being ported line for line, which keeps the port checkable.
#![allow(clippy::needless_range_loop)]

use crate::blocks::K_SCALE_SIZE;

/// Smallest group maximum treated as non-zero (ggml `GROUP_MAX_EPS`).
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even, by the float-add trick (ggml `nearest_int`); valid for
/// |fval| <= 4194303, and deterministic (not meaningful) outside that range, as in ggml.
#[inline]
pub(crate) fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0f32;
    let i = val.to_bits() as i32;
    (i & 0x007f_ffff) - 0x0040_0000
}

/// C's float -> int conversion as x86-64 performs it (`cvttss2si`): truncation toward zero,
/// and 0x80000000 for NaN and out-of-range inputs (where C leaves the result undefined).
#[inline]
pub(crate) fn c_trunc_i32(v: f32) -> i32 {
    if !(-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        i32::MIN
    } else {
        v as i32
    }
}

/// `(int8_t)v` for a float `v` as GCC compiles it on x86-64: convert to int32, keep the low byte.
#[inline]
pub(crate) fn c_f32_to_i8(v: f32) -> i8 {
    c_trunc_i32(v) as i8
}

/// `(uint8_t)v` for a float `v` as GCC compiles it on x86-64.
#[inline]
pub(crate) fn c_f32_to_u8(v: f32) -> u8 {
    c_trunc_i32(v) as u8
}

/// The first value of `x` with the largest magnitude, sign kept; `None` when that magnitude is
/// below [`GROUP_MAX_EPS`] (a group of zeros).
fn signed_max(x: &[f32]) -> Option<f32> {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &xi in x {
        let ax = xi.abs();
        if ax > amax {
            amax = ax;
            max = xi;
        }
    }
    (amax >= GROUP_MAX_EPS).then_some(max)
}

/// Signed symmetric levels with an rmse-refined scale (ggml `make_qx_quants`); `l` receives
/// levels shifted to `0..2*nmax`.
pub(crate) fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8], rmse_type: i32, qw: Option<&[f32]>) -> f32 {
    let n = x.len();
    let Some(max) = signed_max(x) else {
        l_out[..n].fill(0);
        return 0.0;
    };
    let mut iscale = -(nmax as f32) / max;
    if rmse_type == 0 {
        for i in 0..n {
            let l = nearest_int(iscale * x[i]);
            l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
        }
        return 1.0 / iscale;
    }
    let (rmse_type, return_early) = if rmse_type < 0 { (-rmse_type, true) } else { (rmse_type, false) };
    let weight = |i: usize| -> f32 {
        match qw {
            Some(qw) => qw[i],
            None => match rmse_type {
                1 => x[i] * x[i],
                2 => 1.0,
                3 => x[i].abs(),
                _ => x[i].abs().sqrt(),
            },
        }
    };
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = weight(i);
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    if return_early {
        return if suml2 > 0.0 { 0.5 * (scale + 1.0 / iscale) } else { 1.0 / iscale };
    }
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1f32 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..n {
            let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            let w = weight(i);
            let lf = l as f32;
            sumlx += w * x[i] * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Signed levels for Q3_K with coordinate-descent refinement (ggml `make_q3_quants`); `l`
/// receives levels shifted to `0..2*nmax`.
pub(crate) fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8], do_rmse: bool) -> f32 {
    let n = x.len();
    let Some(max) = signed_max(x) else {
        l_out[..n].fill(0);
        return 0.0;
    };
    let iscale = -(nmax as f32) / max;
    if do_rmse {
        let mut sumlx = 0f32;
        let mut suml2 = 0f32;
        for i in 0..n {
            let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            l_out[i] = l as i8;
            let w = x[i] * x[i];
            sumlx += w * x[i] * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        for _itry in 0..5 {
            let mut n_changed = 0;
            for i in 0..n {
                let w = x[i] * x[i];
                let li = l_out[i] as f32;
                let mut slx = sumlx - w * x[i] * li;
                if slx > 0.0 {
                    let mut sl2 = suml2 - w * li * li;
                    let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                    if new_l != l_out[i] as i32 {
                        let nl = new_l as f32;
                        slx += w * x[i] * nl;
                        sl2 += w * nl * nl;
                        if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                            l_out[i] = new_l as i8;
                            sumlx = slx;
                            suml2 = sl2;
                            n_changed += 1;
                        }
                    }
                }
            }
            if n_changed == 0 {
                break;
            }
        }
        for l in &mut l_out[..n] {
            *l += nmax as i8;
        }
        return if suml2 > 0.0 { sumlx / suml2 } else { 0.0 };
    }
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
    }
    1.0 / iscale
}

/// Parameters of ggml's `make_qkx2_quants` scale/min grid search.
pub(crate) struct Qkx2Search {
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    pub use_mad: bool,
}

/// Unsigned levels `0..=nmax` with a scale and a min found by weighted least squares over a
/// grid of candidate scales (ggml `make_qkx2_quants`). Returns `(scale, the_min)` where
/// `the_min` is the positive offset subtracted on dequantization.
pub(crate) fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    search: &Qkx2Search,
) -> (f32, f32) {
    let n = x.len();
    let mut laux = [0u8; 32];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if search.use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min));
        l_out[i] = l.clamp(0, nmax) as u8;
        let diff = scale * l_out[i] as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if search.nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=search.nstep {
        iscale = (search.rmin + search.rdelta * is as f32 + nmax as f32) / (max - min);
        let mut sum_l = 0f32;
        let mut sum_l2 = 0f32;
        let mut sum_xl = 0f32;
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The 6-bit scale and min of group `j` of a Q4_K / Q5_K block (ggml `get_scale_min_k4`).
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The 16 signed 6-bit group scales of a Q3_K block, still biased by 32 (the `aux`/`kmask`
/// unpacking of ggml `dequantize_row_q3_K`).
#[inline]
pub fn unpack_q3k_scales(scales: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |k: usize| u32::from_le_bytes([scales[4 * k], scales[4 * k + 1], scales[4 * k + 2], scales[4 * k + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (k, w) in aux.iter().enumerate() {
        for (b, byte) in w.to_le_bytes().iter().enumerate() {
            out[4 * k + b] = *byte as i8;
        }
    }
    out
}

/// Index of the level in the sorted table `val` nearest to `x` (ggml `best_index_int8`).
#[inline]
pub(crate) fn best_index_int8(val: &[i8], x: f32) -> usize {
    let n = val.len();
    if x <= val[0] as f32 {
        return 0;
    }
    if x >= val[n - 1] as f32 {
        return n - 1;
    }
    let (mut ml, mut mu) = (0usize, n - 1);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < val[mav] as f32 {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - (val[mu - 1] as f32) < val[mu] as f32 - x {
        mu - 1
    } else {
        mu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-2.6), -3);
        assert_eq!(nearest_int(4_194_303.0), 4_194_303);
    }

    #[test]
    fn c_conversions_follow_x86() {
        assert_eq!(c_f32_to_i8(16.9), 16);
        assert_eq!(c_f32_to_i8(-0.9), 0);
        assert_eq!(c_f32_to_u8(300.0), 44);
        assert_eq!(c_trunc_i32(f32::NAN), i32::MIN);
        assert_eq!(c_trunc_i32(3e9), i32::MIN);
    }

    #[test]
    fn q3k_scale_unpacking_matches_bit_layout() {
        // Scale j: low 4 bits at byte j (j<8) or high nibble of byte j-8, high 2 bits in byte 8 + j%4.
        let mut packed = [0u8; 12];
        let want: [u8; 16] = std::array::from_fn(|j| (j as u8 * 7 + 3) & 63);
        for (j, &l) in want.iter().enumerate() {
            if j < 8 {
                packed[j] = l & 0xF;
            } else {
                packed[j - 8] |= (l & 0xF) << 4;
            }
            packed[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
        }
        let got = unpack_q3k_scales(&packed);
        for j in 0..16 {
            assert_eq!(got[j] as u8, want[j], "scale {j}");
        }
    }

    #[test]
    fn best_index_picks_nearest_level() {
        let v = crate::blocks::KVALUES_IQ4NL;
        assert_eq!(best_index_int8(&v, -1000.0), 0);
        assert_eq!(best_index_int8(&v, 1000.0), 15);
        assert_eq!(best_index_int8(&v, 0.0), 8);
        assert_eq!(best_index_int8(&v, -4.5), 8); // equidistant from -10 and 1 -> the upper one
        assert_eq!(best_index_int8(&v, 100.0), 14);
    }
}
