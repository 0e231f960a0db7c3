//! Packed IQ4_XS against Q8_K activations. The 4-bit indices stay nibbles; a byte shuffle turns
//! them into the non-linear levels plus 128 (`KVALUES_IQ4NL[i] + 128`, 1..=241, unsigned for
//! `vpdpbusd`). Per (row, token, block) the integer sums `isum = sum_j (ls_j - 32) * sum_e (k_e +
//! 128) * a_e` and `ibias = sum_j (ls_j - 32) * bsum_j` are exact, then `v = (isum - 128 * ibias)
//! * d` and `acc = v * yd + acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes:
//! `qs[8 groups of 32][4][16 rows][4 bytes]` (byte `k` of row `r` in vector `v` of group `j` is
//! byte `4v + k` of the row's group: element `4v + k` in its low nibble, `16 + 4v + k` in its
//! high one), then `ls[8][16]` (the 6-bit group scales, one byte each), then `d[16]` (fp16), then
//! 32 bytes of padding to a whole number of cache lines.
//!
//! Kernels (`x86/iq4xs.rs`): AVX-512 VNNI and AVX2 (two byte shuffles give each level's two nibbles, which
//! `vpmaddubsw` takes without overflowing its i16 pair sums; see `nibble_dot8` in `x86/mod.rs`).

use super::{f16_at, GroupCall, PACK_ROWS};
use tandem_quant::blocks::{BlockIQ4XS, KVALUES_IQ4NL};
use tandem_quant::QK_K;

pub(super) const SUBS: usize = QK_K / 32;
pub(super) const QS: usize = 0;
pub(super) const LS: usize = QS + QK_K / 2 * PACK_ROWS;
pub(super) const D: usize = LS + SUBS * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (2240, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = (D + 2 * PACK_ROWS).next_multiple_of(64);
const _: () = assert!(GROUP_BLOCK == 2240);
const IQ4XS_BYTES: usize = std::mem::size_of::<BlockIQ4XS>();
const IQ4XS_QS: usize = std::mem::offset_of!(BlockIQ4XS, qs);

/// One group: 16 rows of `nb` IQ4_XS blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    super::pack_blocks(src, rb, nb, dst, (IQ4XS_BYTES, GROUP_BLOCK), |out, r, blk| {
        out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[0..2]);
        let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
        for j in 0..SUBS {
            let low = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
            out[LS + PACK_ROWS * j + r] = low | ((((scales_h >> (2 * j)) & 3) as u8) << 4);
            for v in 0..4 {
                let at = QS + 256 * j + 64 * v + 4 * r;
                let from = IQ4XS_QS + 16 * j + 4 * v;
                out[at..at + 4].copy_from_slice(&blk[from..from + 4]);
            }
        }
    });
}

/// The level index (0..16) of element `e` of group `j` of row `r` in a packed block.
#[inline]
fn index(blk: &[u8], j: usize, r: usize, e: usize) -> usize {
    let byte = blk[QS + 256 * j + 64 * ((e % 16) / 4) + 4 * r + e % 4];
    (if e < 16 { byte & 0x0F } else { byte >> 4 }) as usize
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
            for j in 0..SUBS {
                let s: i32 = (0..32).map(|e| (KVALUES_IQ4NL[index(blk, j, r, e)] as i32 + 128) * y.q(32 * j + e)).sum();
                let ls = blk[LS + PACK_ROWS * j + r] as i32 - 32;
                isum += ls * s;
                ibias += ls * (y.bsum(2 * j) + y.bsum(2 * j + 1));
            }
            (isum - 128 * ibias) as f32 * f16_at(blk, D + 2 * r)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::each_packed_block;
    use super::*;

    #[test]
    fn the_layout_keeps_every_level_scale_and_factor() {
        // Levels, group scales and factors read back by the layout give ggml's dequantized rows.
        each_packed_block(tandem_quant::GgmlType::IQ4_XS, 29, GROUP_BLOCK, |r, blk, want, at| {
            for j in 0..SUBS {
                let dl = f16_at(blk, D + 2 * r) * (blk[LS + 16 * j + r] as i32 - 32) as f32;
                for e in 0..32 {
                    let k = KVALUES_IQ4NL[index(blk, j, r, e)] as f32;
                    assert_eq!(dl * k, want[32 * j + e], "{at} group {j} element {e}");
                }
            }
        });
    }
}
