//! Packed Q8_0 and Q5_0 (32-element blocks) against Q8_0 activations, and Q5_1 against Q8_1. Each
//! level is stored as an unsigned byte `u = q + OFF` (Q8_0: `q + 128`, Q5_0: the 5-bit code, `OFF
//! = 16`; Q5_1: the 5-bit code, its level), so `vpdpbusd` takes it as it is. Per (row, token,
//! block) the integer sum `isum = sum_e u_e * a_e - OFF * sum_e a_e` is exact, then `acc = (dw *
//! da) * isum + acc` (the factor product rounded, the rest fused); Q5_1 then adds its minimum
//! against the activations' `s = da * sum_e a_e`, `acc = mw * s + acc` (fused), as ggml's
//! `vec_dot_q5_1_q8_1` adds `m * s`.
//!
//! Layout of one group of 16 rows: first every block's levels, `[block][8 quads][16 rows][4]`
//! (element `4q + k` of row `r` at byte `64q + 4r + k`), then every block's factors `d[block][16]`
//! (fp16), then for Q5_1 every block's minimums `m[block][16]` (fp16). Q8_0 keeps its 34 bytes per
//! row and block; Q5_0 grows from 22 to 34, Q5_1 from 24 to 36.
//!
//! Kernels (`x86/b32.rs`): AVX-512 VNNI and AVX2 for all three (AVX2: `vpmaddubsw` on Q5_0's and Q5_1's levels
//! <= 31, on the two nibbles of Q8_0's).

use super::{GroupCall, PACK_ROWS};
use tandem_quant::blocks::{BlockQ8_0, BlockQ8_1};
use tandem_quant::GgmlType;

/// Bytes of one block of one group of 16 rows: 512 of levels, 32 of factors.
pub(super) const GROUP_BLOCK: usize = LEVELS + 2 * PACK_ROWS;
/// Bytes of one Q5_1 block of one group of 16 rows: 512 of levels, 32 of factors, 32 of minimums.
pub(super) const GROUP_BLOCK_Q5_1: usize = LEVELS + 4 * PACK_ROWS;
pub(super) const LEVELS: usize = 32 * PACK_ROWS;
/// ggml block_q8_0 (the activations): fp16 d, i8 qs[32].
pub(super) const Q8_0_BYTES: usize = std::mem::size_of::<BlockQ8_0>();
const Q8_0_QS: usize = std::mem::offset_of!(BlockQ8_0, qs);
/// ggml block_q8_1 (Q5_1's activations): fp16 d, fp16 s = d * sum(qs), i8 qs[32].
pub(super) const Q8_1_BYTES: usize = std::mem::size_of::<BlockQ8_1>();
const Q8_1_QS: usize = std::mem::offset_of!(BlockQ8_1, qs);
pub(super) const Q8_1_S: usize = std::mem::offset_of!(BlockQ8_1, s);

/// One group: 16 rows of `nb` blocks of `ty` (`rb` bytes per row) into `dst`.
pub(super) fn pack_group(ty: GgmlType, src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    let bs = ty.type_size();
    for r in 0..PACK_ROWS {
        for b in 0..nb {
            let blk = &src[r * rb + b * bs..r * rb + (b + 1) * bs];
            let d = nb * LEVELS + b * 2 * PACK_ROWS + 2 * r;
            dst[d..d + 2].copy_from_slice(&blk[0..2]);
            if ty == GgmlType::Q5_1 {
                let m = d + nb * 2 * PACK_ROWS;
                dst[m..m + 2].copy_from_slice(&blk[2..4]);
            }
            let lv = levels(ty, blk);
            for i in 0..8 {
                // Elements 4i..4i + 4 are the four bytes of row r's lane in load i.
                let at = b * LEVELS + level_at(r, 4 * i);
                dst[at..at + 4].copy_from_slice(&lv[4 * i..4 * i + 4]);
            }
        }
    }
}

/// The 32 elements of a block of `ty` as the unsigned bytes `q + OFF`.
fn levels(ty: GgmlType, blk: &[u8]) -> [u8; 32] {
    let mut lv = [0u8; 32];
    match ty {
        GgmlType::Q8_0 => lv.iter_mut().zip(&blk[2..34]).for_each(|(l, &q)| *l = q ^ 0x80),
        _ => {
            // Q5_0: fp16 d, qh (bit e = high bit of element e), qs (low nibbles of 0..16, high of
            // 16..32); Q5_1 the same after fp16 d and m. Eight elements at a time: their low
            // nibbles are a mask (and a shift) of a word of qs, their high bits a byte of qh spread
            // over the word by [`SPREAD`].
            let h = if ty == GgmlType::Q5_1 { 4 } else { 2 };
            let qh = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
            let w = |i: usize| u64::from_le_bytes(blk[h + 4 + 8 * i..h + 12 + 8 * i].try_into().unwrap());
            let (w0, w1, m) = (w(0), w(1), 0x0F0F_0F0F_0F0F_0F0Fu64);
            let low = [w0 & m, w1 & m, (w0 >> 4) & m, (w1 >> 4) & m];
            for (i, (l, low)) in lv.chunks_exact_mut(8).zip(low).enumerate() {
                let high = SPREAD[(qh >> (8 * i)) as usize & 0xFF];
                l.copy_from_slice(&(low | high).to_le_bytes());
            }
        }
    }
    lv
}

/// For each byte `b`, the word whose byte `k` is 16 if bit `k` of `b` is set, else 0: eight
/// Q5_0 high bits in place above their low nibbles.
const SPREAD: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut k = 0;
        while k < 8 {
            t[b] |= (((b >> k) & 1) as u64) << (8 * k + 4);
            k += 1;
        }
        b += 1;
    }
    t
};

/// The byte of a block's levels holding element `e` of row `r`.
#[inline]
fn level_at(r: usize, e: usize) -> usize {
    64 * (e / 4) + 4 * r + e % 4
}

/// The sum of the 32 quants of the Q8_0 block at the start of `y`.
pub(super) fn block_sum(y: &[u8]) -> i32 {
    y[Q8_0_QS..Q8_0_QS + 32].iter().map(|&q| q as i8 as i32).sum()
}

/// `OFF` for Q5_1, which has no offset: its levels are unsigned and its minimum comes in through
/// the activations' `s` instead of their block sums.
pub(super) const Q5_1_OFF: i32 = 0;

/// Bytes of one packed block (group of 16 rows) and of one activation block, and where the
/// activations' quants start, for `OFF` (Q8_0, Q5_0 or [`Q5_1_OFF`]).
pub(super) const fn sizes(off: i32) -> (usize, usize, usize) {
    if off == Q5_1_OFF {
        (GROUP_BLOCK_Q5_1, Q8_1_BYTES, Q8_1_QS)
    } else {
        (GROUP_BLOCK, Q8_0_BYTES, Q8_0_QS)
    }
}

/// The scalar reference: the arithmetic of the module docs, spelled out (`OFF` 128 for Q8_0, 16
/// for Q5_0, [`Q5_1_OFF`] for Q5_1). Computes the block sums itself (`a.sums` is not read).
///
/// # Safety
/// As [`GroupFn`] (Q8_0 activations; Q8_1 for Q5_1).
pub(super) unsafe fn group_scalar<const OFF: i32>(c: GroupCall) {
    let level = |w: &[u8], b: usize, r: usize, e: usize| w[b * LEVELS + level_at(r, e)] as i32;
    // SAFETY: forwarded from the caller.
    unsafe { super::q8_scalar(c, sizes(OFF), LEVELS, OFF == Q5_1_OFF, OFF, level) }
}

#[cfg(test)]
mod tests {
    use super::super::tests::each_packed_row;
    use super::*;
    use crate::packed::f16_at;

    #[test]
    fn the_layout_keeps_every_level_and_factor() {
        // level - OFF times d, read back by the layout, is ggml's dequantized value exactly.
        for (ty, off) in [(GgmlType::Q8_0, 128i32), (GgmlType::Q5_0, 16), (GgmlType::Q5_1, 0)] {
            let (n, nb) = (128, 4);
            each_packed_row(ty, 5, n, |r, grp, want, at| {
                for b in 0..nb {
                    let d = f16_at(grp, nb * LEVELS + b * 2 * PACK_ROWS + 2 * r);
                    // Q5_1: d * q + m, ggml's order.
                    let m = if ty == GgmlType::Q5_1 {
                        f16_at(grp, nb * LEVELS + (nb + b) * 2 * PACK_ROWS + 2 * r)
                    } else {
                        0.0
                    };
                    for e in 0..32 {
                        let q = grp[b * LEVELS + level_at(r, e)] as i32 - off;
                        assert_eq!(q as f32 * d + m, want[b * 32 + e], "{at} block {b} element {e}");
                    }
                }
            });
        }
    }
}
