//! Packed Q6_K against Q8_K activations. Per (row, token, block) the integer sums
//! `isum = sum_g sc_g * sum_{e in g} u_e * a_e` (`u` the 6-bit code, 0..=63) and
//! `imin = 32 * sum_g sc_g * bsum_g` are exact, then `v = (isum - imin) * d` and
//! `acc = v * yd + acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes (the
//! 16 rows' own 3360): the low four bits as Q4_K's levels (`ql[8 groups of 32][4][16 rows][4]`,
//! element `8l + k` in the low nibble of byte `k` of load `l`, `8l + 4 + k` in the high one), the
//! high two bits `qh[8][2][16 rows][4]` (load `h`, byte `k`, bits `2l..2l+2`: element
//! `8l + 4h + k`), the scales `sc[8][16 rows][2]` (groups `2j`, `2j + 1` of 16 elements, i8), then
//! `d[16]` (fp16).

use super::{f16_at, GroupCall, PACK_ROWS};
use std::mem::{offset_of, size_of};
use tandem_quant::blocks::BlockQ6K;
use tandem_quant::QK_K;

pub(super) const SUBS: usize = QK_K / 32;
pub(super) const QL: usize = 0;
pub(super) const QH: usize = QL + QK_K / 2 * PACK_ROWS;
pub(super) const SC: usize = QH + QK_K / 4 * PACK_ROWS;
pub(super) const D: usize = SC + QK_K / 16 * PACK_ROWS;
/// Bytes of one block of one group of 16 rows.
pub(super) const GROUP_BLOCK: usize = D + 2 * PACK_ROWS;
const _: () = assert!(GROUP_BLOCK == PACK_ROWS * size_of::<BlockQ6K>());

const Q6K_BYTES: usize = size_of::<BlockQ6K>();
const Q6K_QH: usize = offset_of!(BlockQ6K, qh);
const Q6K_SC: usize = offset_of!(BlockQ6K, scales);
const Q6K_D: usize = offset_of!(BlockQ6K, d);

/// Element `e` of a Q6_K block as its 6-bit code (ggml `dequantize_row_q6_K`: 128-element halves,
/// `ql` low nibbles for elements `l` and `l + 32`, high nibbles for `l + 64`, `l + 96`; `qh` two
/// bits each).
#[cfg(test)]
fn code(blk: &[u8], e: usize) -> u8 {
    let (half, i) = (e / 128, e % 128);
    let (quarter, l) = (i / 32, i % 32);
    let ql = blk[64 * half + l + 32 * (quarter % 2)];
    let low = if quarter < 2 { ql & 0x0F } else { ql >> 4 };
    let high = (blk[Q6K_QH + 32 * half + l] >> (2 * quarter)) & 3;
    low | (high << 4)
}

/// The 256 6-bit codes of a Q6_K block, in element order (as ggml's `dequantize_row_q6_K` reads
/// them: four elements per pair of a `ql` and a `qh` byte).
fn codes(blk: &[u8]) -> [u8; QK_K] {
    let mut u = [0u8; QK_K];
    for half in 0..2 {
        let (ql, qh) = (&blk[64 * half..64 * half + 64], &blk[Q6K_QH + 32 * half..Q6K_QH + 32 * half + 32]);
        let u = &mut u[128 * half..128 * half + 128];
        for l in 0..32 {
            u[l] = (ql[l] & 0x0F) | (qh[l] & 3) << 4;
            u[l + 32] = (ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4;
            u[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
            u[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
        }
    }
    u
}

/// One group: 16 rows of `nb` Q6_K blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    super::pack_blocks(src, rb, nb, dst, (Q6K_BYTES, GROUP_BLOCK), |out, r, blk| {
        out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[Q6K_D..Q6K_D + 2]);
        let u = codes(blk);
        for j in 0..SUBS {
            out[SC + 32 * j + 2 * r] = blk[Q6K_SC + 2 * j];
            out[SC + 32 * j + 2 * r + 1] = blk[Q6K_SC + 2 * j + 1];
            let u = &u[32 * j..32 * j + 32];
            for l in 0..4 {
                for k in 0..4 {
                    // Low nibbles: elements 8l + k and 8l + 4 + k share byte k of load l.
                    out[QL + 256 * j + 64 * l + 4 * r + k] = (u[8 * l + k] & 0x0F) | (u[8 * l + 4 + k] & 0x0F) << 4;
                }
            }
            for h in 0..2 {
                for k in 0..4 {
                    // High bits: element 8l + 4h + k in bits 2l..2l + 2 of byte k of load h.
                    out[QH + 128 * j + 64 * h + 4 * r + k] =
                        (0..4).fold(0, |b, l| b | (u[8 * l + 4 * h + k] >> 4) << (2 * l));
                }
            }
        }
    });
}

/// Where element `e` of group `j` of row `r` lives: (byte, shift) of its low four bits and of its
/// high two bits.
#[inline]
fn at(j: usize, r: usize, e: usize) -> ((usize, u32), (usize, u32)) {
    let (l, h, k) = (e / 8, (e % 8) / 4, e % 4);
    ((QL + 256 * j + 64 * l + 4 * r + k, 4 * h as u32), (QH + 128 * j + 64 * h + 4 * r + k, 2 * l as u32))
}

/// The scalar reference: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`] (Q8_K activations).
pub(super) unsafe fn group_scalar(c: GroupCall) {
    // SAFETY: forwarded from the caller.
    unsafe {
        super::q8k_scalar(c, GROUP_BLOCK, |blk, y, r| {
            let (mut isum, mut imin) = (0i32, 0i32);
            for j in 0..SUBS {
                for half in 0..2 {
                    let sc = blk[SC + 32 * j + 2 * r + half] as i8 as i32;
                    let mut s = 0i32;
                    for e in 16 * half..16 * half + 16 {
                        let (lo, hi) = at(j, r, e);
                        let u = ((blk[lo.0] >> lo.1) & 0x0F) | (((blk[hi.0] >> hi.1) & 3) << 4);
                        s += u as i32 * y.q(32 * j + e);
                    }
                    isum += sc * s;
                    imin += sc * y.bsum(2 * j + half);
                }
            }
            (isum - 32 * imin) as f32 * f16_at(blk, D + 2 * r)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{each_packed_block, random_rows, Rng};
    use super::*;
    use tandem_quant::GgmlType;

    #[test]
    fn a_block_s_codes_are_its_elements_codes() {
        let mut rng = Rng(5);
        for blk in random_rows(GgmlType::Q6_K, 8, QK_K, &mut rng).chunks_exact(Q6K_BYTES) {
            for (e, &u) in codes(blk).iter().enumerate() {
                assert_eq!(u, code(blk, e), "element {e}");
            }
        }
    }

    #[test]
    fn the_layout_keeps_every_code_scale_and_factor() {
        // (code - 32) * scale * d, read back by the layout, is ggml's dequantized value exactly.
        each_packed_block(GgmlType::Q6_K, 3, GROUP_BLOCK, |r, blk, want, at| {
            let d = f16_at(blk, D + 2 * r);
            for j in 0..SUBS {
                for e in 0..32 {
                    let (lo, hi) = super::at(j, r, e);
                    let u = ((blk[lo.0] >> lo.1) & 0x0F) | (((blk[hi.0] >> hi.1) & 3) << 4);
                    let sc = blk[SC + 32 * j + 2 * r + e / 16] as i8 as f32;
                    assert_eq!(d * sc * (u as i32 - 32) as f32, want[32 * j + e], "{at} element {}", 32 * j + e);
                }
            }
        });
    }
}
