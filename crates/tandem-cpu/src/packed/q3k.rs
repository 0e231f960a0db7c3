//! Packed Q3_K against Q8_K activations. Each level is stored as `u = q + 4` (0..=7: the two low
//! bits and ggml's `hmask` bit, which is set where ggml does not subtract 4). Per (row, token,
//! block) the integer sums `isum = sum_s (sc_s - 32) * sum_e u_e * a_e` and `ibias = sum_s (sc_s -
//! 32) * bsum_s` (16 groups of 16) are exact, then `v = (isum - 4 * ibias) * d` and `acc = v * yd +
//! acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes:
//! `qs[16 groups][16 rows][4 bytes]` (bits `2p..2p + 2` of byte `k` of lane `r` in vector `s`: the
//! low bits of element `16s + 4p + k`), then `qh[8 pairs of groups][16 rows][4 bytes]` (bit `4h +
//! p` of byte `k` of lane `r` in vector `i`: the third bit of element `4p + k` of group `2i + h`),
//! then `sc[16 groups][16 rows]` (the 6-bit scales, biased by 32), then `d[16]` (fp16), then 32
//! bytes of padding to a whole number of cache lines.

use super::{f16_at, GroupCall, PACK_ROWS};
use tandem_quant::blocks::BlockQ3K;
use tandem_quant::{unpack_q3k_scales, QK_K};

pub(super) const SUBS: usize = QK_K / 16;
pub(super) const QS: usize = 0;
pub(super) const QH: usize = QS + QK_K / 4 * PACK_ROWS;
pub(super) const SC: usize = QH + QK_K / 8 * PACK_ROWS;
pub(super) const D: usize = SC + SUBS * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (1856, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = (D + 2 * PACK_ROWS).next_multiple_of(64);
const _: () = assert!(GROUP_BLOCK == 1856);
const Q3K_BYTES: usize = std::mem::size_of::<BlockQ3K>();
const Q3K_HMASK: usize = std::mem::offset_of!(BlockQ3K, hmask);
const Q3K_QS: usize = std::mem::offset_of!(BlockQ3K, qs);
const Q3K_SCALES: usize = std::mem::offset_of!(BlockQ3K, scales);
const Q3K_D: usize = std::mem::offset_of!(BlockQ3K, d);

/// One group: 16 rows of `nb` Q3_K blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    super::pack_blocks(src, rb, nb, dst, (Q3K_BYTES, GROUP_BLOCK), |out, r, blk| {
        out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[Q3K_D..Q3K_D + 2]);
        let scales = unpack_q3k_scales(blk[Q3K_SCALES..Q3K_SCALES + 12].try_into().expect("12 bytes"));
        for s in 0..SUBS {
            out[SC + PACK_ROWS * s + r] = scales[s] as u8;
            // ggml: group s = 8n + 2j + h reads bits 2j of qs[32n + 16h + l] and bit 4n + j of
            // hmask[16h + l], l = 0..16.
            let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
            for l in 0..16 {
                let q = (blk[Q3K_QS + 32 * n + 16 * h + l] >> (2 * j)) & 3;
                let hb = (blk[Q3K_HMASK + 16 * h + l] >> (4 * n + j)) & 1;
                out[QS + 64 * s + 4 * r + l % 4] |= q << (2 * (l / 4));
                out[QH + 64 * (s / 2) + 4 * r + l % 4] |= hb << (4 * (s % 2) + l / 4);
            }
        }
    });
}

/// Level `e` (0..16) of group `s` of row `r` in a packed block, as `u = q + 4`.
#[inline]
fn level(blk: &[u8], s: usize, r: usize, e: usize) -> i32 {
    let low = (blk[QS + 64 * s + 4 * r + e % 4] >> (2 * (e / 4))) & 3;
    let high = (blk[QH + 64 * (s / 2) + 4 * r + e % 4] >> (4 * (s % 2) + e / 4)) & 1;
    (low | high << 2) as i32
}

/// The scalar reference: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`] (Q8_K activations).
pub(super) unsafe fn group_scalar(c: GroupCall) {
    // SAFETY: forwarded from the caller.
    unsafe {
        super::q8k_scalar(c, GROUP_BLOCK, |blk, y, r| {
            let (mut isum, mut ibias) = (0i32, 0i32);
            for s in 0..SUBS {
                let sum: i32 = (0..16).map(|e| level(blk, s, r, e) * y.q(16 * s + e)).sum();
                let sc = blk[SC + PACK_ROWS * s + r] as i32 - 32;
                isum += sc * sum;
                ibias += sc * y.bsum(s);
            }
            (isum - 4 * ibias) as f32 * f16_at(blk, D + 2 * r)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::each_packed_block;
    use super::*;

    #[test]
    fn the_layout_keeps_every_level_scale_and_factor() {
        // Unpacking the packed bytes by the layout gives back ggml's dequantized rows exactly.
        each_packed_block(tandem_quant::GgmlType::Q3_K, 37, GROUP_BLOCK, |r, blk, want, at| {
            for s in 0..SUBS {
                let dl = f16_at(blk, D + 2 * r) * (blk[SC + 16 * s + r] as i32 - 32) as f32;
                for e in 0..16 {
                    assert_eq!(dl * (level(blk, s, r, e) - 4) as f32, want[16 * s + e], "{at} group {s} element {e}");
                }
            }
        });
    }
}
