//! Packed Q4_0 and IQ4_NL against Q8_0 activations (the two share ggml's block layout: an fp16
//! factor and 16 bytes of 4-bit codes), and Q4_1 (a factor, a minimum and the same codes) against
//! Q8_1. The codes stay nibbles (the packed matrix is as large as
//! the original). Q4_0's code `u = q + 8` is its level plus 8; IQ4_NL's is an index that a byte
//! shuffle turns into its non-linear level plus 128 (`KVALUES_IQ4NL[u] + 128`, 1..=241, as
//! `iq4xs.rs` does). Either way `vpdpbusd` takes the unsigned bytes, and per (row, token, block)
//! the integer sum `isum = sum_e l_e * a_e - off * sum_e a_e` (`off` 8 or 128) is exact, then `acc
//! = (dw * da) * isum + acc`: the arithmetic of the Q8_0 / Q5_0 layouts (`b32.rs`). Q4_1's code is
//! its level (no offset); its minimum comes in through the activations' `s = da * sum_e a_e`, `acc
//! = mw * s + acc` (fused), as ggml's `vec_dot_q4_1_q8_1` adds `m * s` (Q5_1's arithmetic).
//!
//! Layout of one group of 16 rows: first every block's codes, `[block][4][16 rows][4 bytes]` (byte
//! `k` of row `r` in vector `v` is byte `4v + k` of the row's ggml block: element `4v + k` in its
//! low nibble, `16 + 4v + k` in its high one), then every block's factors `d[block][16]` (fp16),
//! then for Q4_1 every block's minimums `m[block][16]` (fp16): as large as ggml's blocks.
//!
//! Kernels (`x86/q40.rs`): AVX-512 VNNI and AVX2 for all three (AVX2: `vpmaddubsw` on the codes; for IQ4_NL on
//! the two nibbles of each level, which two byte shuffles of the codes give).

use super::b32::{Q8_0_BYTES, Q8_1_BYTES};
use super::{GroupCall, PACK_ROWS};
use tandem_quant::blocks::{BlockQ4_0, KVALUES_IQ4NL};

/// Bytes of one block's codes in a group (16 rows x 16 bytes).
pub(super) const CODES: usize = 16 * PACK_ROWS;
/// Bytes of one block of one group: codes and factor.
pub(super) const GROUP_BLOCK: usize = CODES + 2 * PACK_ROWS;
/// Bytes of one Q4_1 block of one group: codes, factors and minimums.
pub(super) const GROUP_BLOCK_Q4_1: usize = CODES + 4 * PACK_ROWS;
const Q4_0_BYTES: usize = std::mem::size_of::<BlockQ4_0>();
const Q8_0_QS: usize = 2;
/// Q8_1 (Q4_1's activations): fp16 d, fp16 s = d * sum(qs) (at `b32::Q8_1_S`), i8 qs[32].
const Q8_1_QS: usize = 4;

/// Bytes of one packed block of a group, of one activation block, and where the activations'
/// quants start: Q4_0 / IQ4_NL, or with `MIN` Q4_1.
pub(super) const fn sizes(min: bool) -> (usize, usize, usize) {
    if min {
        (GROUP_BLOCK_Q4_1, Q8_1_BYTES, Q8_1_QS)
    } else {
        (GROUP_BLOCK, Q8_0_BYTES, Q8_0_QS)
    }
}
const _: () = assert!(Q4_0_BYTES == std::mem::size_of::<tandem_quant::blocks::BlockIQ4NL>());

/// IQ4_NL's (and IQ4_XS's) levels plus 128, by code: the table of their byte shuffles.
pub(super) const NL_LEVELS: [u8; 16] = {
    let mut l = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        l[i] = (KVALUES_IQ4NL[i] as i32 + 128) as u8;
        i += 1;
    }
    l
};

/// The low and the high nibbles of [`NL_LEVELS`]: the tables of the AVX2 kernels' two byte
/// shuffles, which give a code's level plus 128 split as `vpmaddubsw` takes it exactly (see
/// `nibble_dot8` in `x86/mod.rs`).
pub(super) const NL_LEVELS_LO: [u8; 16] = split_levels(0);
pub(super) const NL_LEVELS_HI: [u8; 16] = split_levels(4);

/// The nibble at bit `shift` of each of [`NL_LEVELS`].
const fn split_levels(shift: u32) -> [u8; 16] {
    let mut l = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        l[i] = (NL_LEVELS[i] >> shift) & 0x0F;
        i += 1;
    }
    l
}

/// The unsigned level of code `u` (0..16) and the offset taken back through the block sums: Q4_0
/// (`NL` false), IQ4_NL, or with `MIN` Q4_1 (no offset).
#[inline]
fn level<const NL: bool, const MIN: bool>(u: u8) -> (i32, i32) {
    if NL {
        (NL_LEVELS[u as usize] as i32, 128)
    } else if MIN {
        (u as i32, 0)
    } else {
        (u as i32, 8)
    }
}

/// One group: 16 rows of `nb` Q4_0 or IQ4_NL blocks, or with `MIN` Q4_1 blocks (`rb` bytes per
/// row), into `dst`.
pub(super) fn pack_group<const MIN: bool>(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    // ggml's blocks: fp16 d (and for Q4_1 fp16 m), then the 16 bytes of codes
    let (bs, qs) = if MIN { (Q4_0_BYTES + 2, 4) } else { (Q4_0_BYTES, 2) };
    for r in 0..PACK_ROWS {
        for b in 0..nb {
            let blk = &src[r * rb + b * bs..r * rb + (b + 1) * bs];
            let d = nb * CODES + b * 2 * PACK_ROWS + 2 * r;
            dst[d..d + 2].copy_from_slice(&blk[0..2]);
            if MIN {
                let m = d + nb * 2 * PACK_ROWS;
                dst[m..m + 2].copy_from_slice(&blk[2..4]);
            }
            for v in 0..4 {
                let at = b * CODES + 64 * v + 4 * r;
                dst[at..at + 4].copy_from_slice(&blk[qs + 4 * v..qs + 4 * v + 4]);
            }
        }
    }
}

/// Element `e` (0..32) of row `r` in a block's codes: the 4-bit code.
#[inline]
fn code(codes: &[u8], r: usize, e: usize) -> u8 {
    let byte = codes[64 * ((e % 16) / 4) + 4 * r + e % 4];
    if e < 16 {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

/// The scalar reference: the arithmetic of the module docs, spelled out (Q4_0, with `NL` IQ4_NL,
/// with `MIN` Q4_1). Computes the block sums itself (`a.sums` is not read).
///
/// # Safety
/// As [`GroupFn`] (Q8_0 activations; Q8_1 for Q4_1).
pub(super) unsafe fn group_scalar<const NL: bool, const MIN: bool>(c: GroupCall) {
    // the codes of every block come first, as in Q4_0's layout
    let off = level::<NL, MIN>(0).1;
    let at = |w: &[u8], b: usize, r: usize, e: usize| level::<NL, MIN>(code(&w[b * CODES..], r, e)).0;
    // SAFETY: forwarded from the caller.
    unsafe { super::q8_scalar(c, sizes(MIN), CODES, MIN, off, at) }
}

#[cfg(test)]
mod tests {
    use super::super::group_bytes;
    use super::super::tests::each_packed_row;
    use super::*;
    use crate::packed::f16_at;
    use tandem_quant::{row_size, GgmlType};

    #[test]
    fn the_layout_keeps_every_code_and_factor() {
        // Each code's level (q - 8 for Q4_0, KVALUES_IQ4NL[q] for IQ4_NL) times d, read back by
        // the layout, is ggml's dequantized value exactly.
        for (ty, nl) in [(GgmlType::Q4_0, false), (GgmlType::IQ4_NL, true), (GgmlType::Q4_1, false)] {
            let (n, nb) = (128, 4);
            assert_eq!(group_bytes(ty, n), PACK_ROWS * row_size(ty, n).unwrap(), "{ty}: as large as the original");
            each_packed_row(ty, 23, n, |r, grp, want, at| {
                for b in 0..nb {
                    let d = f16_at(grp, nb * CODES + b * 2 * PACK_ROWS + 2 * r);
                    let q41 = ty == GgmlType::Q4_1;
                    // Q4_1: d * q + m, ggml's order
                    let m = if q41 { f16_at(grp, nb * CODES + (nb + b) * 2 * PACK_ROWS + 2 * r) } else { 0.0 };
                    for e in 0..32 {
                        let u = code(&grp[b * CODES..(b + 1) * CODES], r, e);
                        let q = match (nl, q41) {
                            (true, _) => level::<true, false>(u).0 - 128,
                            (false, true) => level::<false, true>(u).0,
                            (false, false) => level::<false, false>(u).0 - 8,
                        };
                        assert_eq!(q as f32 * d + m, want[b * 32 + e], "{at} block {b} element {e}");
                    }
                }
            });
        }
    }
}
