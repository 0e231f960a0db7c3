//! Packed Q2_K against Q8_K activations. Per (row, token, block) the integer sums `isum = sum_s
//! sc_s * sum_e q_e * a_e` and `imin = sum_s m_s * bsum_s` (16 groups of 16) are exact, then `v =
//! isum * d - imin * dmin` (one fused multiply-add) and `acc = v * yd + acc` (fused): the
//! arithmetic of the Q4_K layout (`q4k.rs`) with groups of 16.
//!
//! Layout of one group of 16 rows, as large as the original: its blocks one after another, each
//! [`GROUP_BLOCK`] bytes: `qs[16 groups][16 rows][4 bytes]` (bits `2p..2p + 2` of byte `k` of lane
//! `r` in vector `s` hold element `16s + 4p + k`), then `sm[16 groups][16 rows]` (ggml's scale
//! byte: scale in the low nibble, min in the high one), then `d[16]` and `dmin[16]` (fp16).

use super::{f16_at, GroupCall, PACK_ROWS};
use tandem_quant::blocks::BlockQ2K;
use tandem_quant::QK_K;

pub(super) const SUBS: usize = QK_K / 16;
pub(super) const QS: usize = 0;
pub(super) const SM: usize = QS + QK_K / 4 * PACK_ROWS;
pub(super) const D: usize = SM + SUBS * PACK_ROWS;
pub(super) const DMIN: usize = D + 2 * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (1344, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = DMIN + 2 * PACK_ROWS;
const _: () = assert!(GROUP_BLOCK == 1344 && GROUP_BLOCK.is_multiple_of(64));
const Q2K_BYTES: usize = std::mem::size_of::<BlockQ2K>();
const Q2K_QS: usize = std::mem::offset_of!(BlockQ2K, qs);
const Q2K_D: usize = std::mem::offset_of!(BlockQ2K, d);

/// One group: 16 rows of `nb` Q2_K blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    super::pack_blocks(src, rb, nb, dst, (Q2K_BYTES, GROUP_BLOCK), |out, r, blk| {
        out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[Q2K_D..Q2K_D + 2]);
        out[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&blk[Q2K_D + 2..Q2K_D + 4]);
        for s in 0..SUBS {
            out[SM + PACK_ROWS * s + r] = blk[s];
            // ggml: group s = 8n + 2j + h reads bits 2j of qs[32n + 16h + l], l = 0..16.
            let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
            for l in 0..16 {
                let q = (blk[Q2K_QS + 32 * n + 16 * h + l] >> (2 * j)) & 3;
                out[QS + 64 * s + 4 * r + l % 4] |= q << (2 * (l / 4));
            }
        }
    });
}

/// Level `e` (0..16) of group `s` of row `r` in a packed block.
#[inline]
fn level(blk: &[u8], s: usize, r: usize, e: usize) -> i32 {
    ((blk[QS + 64 * s + 4 * r + e % 4] >> (2 * (e / 4))) & 3) as i32
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
            for s in 0..SUBS {
                let sum: i32 = (0..16).map(|e| level(blk, s, r, e) * y.q(16 * s + e)).sum();
                let sm = blk[SM + PACK_ROWS * s + r];
                isum += (sm & 0x0F) as i32 * sum;
                imin += (sm >> 4) as i32 * y.bsum(s);
            }
            let (d, dmin) = (f16_at(blk, D + 2 * r), f16_at(blk, DMIN + 2 * r));
            (-(imin as f32)).mul_add(dmin, isum as f32 * d)
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
        assert_eq!(GROUP_BLOCK, PACK_ROWS * Q2K_BYTES, "as large as the original");
        each_packed_block(tandem_quant::GgmlType::Q2_K, 31, GROUP_BLOCK, |r, blk, want, at| {
            for s in 0..SUBS {
                let sm = blk[SM + 16 * s + r];
                let d = f16_at(blk, D + 2 * r) * (sm & 0x0F) as f32;
                let m = f16_at(blk, DMIN + 2 * r) * (sm >> 4) as f32;
                for e in 0..16 {
                    assert_eq!(d * level(blk, s, r, e) as f32 - m, want[16 * s + e], "{at} group {s} element {e}");
                }
            }
        });
    }
}
