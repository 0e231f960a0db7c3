//! Packed Q4_K and Q5_K against Q8_K activations (`HIGH`: the fifth bit of Q5_K's levels). Per
//! (row, token, block) the integer sums `isum = sum_j sc_j * sum_e q_e * a_e` and `imin = sum_j
//! m_j * bsum_j` are exact, then `v = isum * d - imin * dmin` (one fused multiply-add) and `acc = v
//! * yd + acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] (Q4_K) or
//! [`GROUP_BLOCK_Q5K`] bytes: `qs[8 groups of 32][4][16 rows][4 bytes]` (byte `k` of lane `r` in
//! load `l` of group `j` holds element `8l + k` in its low nibble and `8l + 4 + k` in its high
//! one); for Q5_K then `qh[8 groups][16 rows][4 bytes]`, the fifth bits: bit `2l + n` of byte `k`
//! of lane `r` in group `j` is the fifth bit of the level in nibble `n` of that byte of load `l`
//! (one vector per group: shifted to bit 4 and merged into each nibble vector); then `sc[8][16]`
//! (the 6-bit scales, one byte each), `m[4][16][2]` (the 6-bit mins of groups `2k` and `2k + 1`
//! side by side for each row: one `vpmovzxbw` gives every row's pair, for one `vpdpwssd` per two
//! groups against the pair of their activation sums), then `d[16]` and `dmin[16]` (fp16).

use super::{f16_at, GroupActs, GroupFn, PACK_ROWS, Q8K_BSUMS, Q8K_BYTES, Q8K_QS};
use tandem_quant::blocks::{BlockQ4K, BlockQ5K};
use tandem_quant::{get_scale_min_k4, QK_K};

const SUBS: usize = QK_K / 32;
const QS: usize = 0;

/// Where the parts of a packed block lie, without (Q4_K) or with (Q5_K) the fifth bits.
struct Layout {
    qh: usize,
    sc: usize,
    mn: usize,
    d: usize,
    dmin: usize,
    size: usize,
}

const fn layout(high: bool) -> Layout {
    let qh = QS + QK_K / 2 * PACK_ROWS;
    let sc = qh + if high { QK_K / 8 * PACK_ROWS } else { 0 };
    let mn = sc + SUBS * PACK_ROWS;
    let d = mn + SUBS * PACK_ROWS;
    let dmin = d + 2 * PACK_ROWS;
    Layout { qh, sc, mn, d, dmin, size: dmin + 2 * PACK_ROWS }
}

/// Bytes of one Q4_K block of one group of 16 rows (2368, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = layout(false).size;
/// Bytes of one Q5_K block of one group of 16 rows (2880, a whole number of cache lines).
pub(super) const GROUP_BLOCK_Q5K: usize = layout(true).size;
const _: () = assert!(GROUP_BLOCK == 2368 && GROUP_BLOCK_Q5K == 2880 && GROUP_BLOCK_Q5K.is_multiple_of(64));

const Q4K_BYTES: usize = std::mem::size_of::<BlockQ4K>();
const Q5K_BYTES: usize = std::mem::size_of::<BlockQ5K>();
const Q5K_QH: usize = std::mem::offset_of!(BlockQ5K, qh);
const Q5K_QS: usize = std::mem::offset_of!(BlockQ5K, qs);

/// One group: 16 rows of `nb` Q4_K (or, with `HIGH`, Q5_K) blocks (`rb` bytes each) into `dst`
/// (zeroed).
pub(super) fn pack_group<const HIGH: bool>(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    let l = layout(HIGH);
    let (bs, qs_at_src) = if HIGH { (Q5K_BYTES, Q5K_QS) } else { (Q4K_BYTES, 16) };
    for b in 0..nb {
        let out = &mut dst[b * l.size..(b + 1) * l.size];
        for r in 0..PACK_ROWS {
            let blk = &src[r * rb + b * bs..r * rb + (b + 1) * bs];
            out[l.d + 2 * r..l.d + 2 * r + 2].copy_from_slice(&blk[0..2]);
            out[l.dmin + 2 * r..l.dmin + 2 * r + 2].copy_from_slice(&blk[2..4]);
            let scales: &[u8; 12] = blk[4..16].try_into().expect("12 bytes");
            let qs = &blk[qs_at_src..bs];
            for j in 0..SUBS {
                let (sc, m) = get_scale_min_k4(j, scales);
                out[l.sc + PACK_ROWS * j + r] = sc;
                out[l.mn + mn_at(j, r)] = m;
                for ld in 0..4 {
                    // Elements 8ld..8ld + 8 of the group, one nibble per byte: the four bytes of
                    // the load take the first four in their low nibbles, the next four in the high.
                    let at = 32 * (j / 2) + 8 * ld;
                    let x = u64::from_le_bytes(qs[at..at + 8].try_into().expect("8 bytes"));
                    let n = (x >> (4 * (j % 2))) & 0x0F0F_0F0F_0F0F_0F0F;
                    let word = n as u32 | ((n >> 32) as u32) << 4;
                    let to = qs_at(j, r, 8 * ld);
                    out[to..to + 4].copy_from_slice(&word.to_le_bytes());
                }
                if HIGH {
                    for e in 0..32 {
                        if (blk[Q5K_QH + e] >> j) & 1 == 1 {
                            let (byte, bit) = qh_at(j, r, e);
                            out[l.qh + byte] |= 1 << bit;
                        }
                    }
                }
            }
        }
    }
}

/// The byte of a packed block holding element `e` of group `j` of row `r` (nibble `(e % 8) / 4`).
#[inline]
fn qs_at(j: usize, r: usize, e: usize) -> usize {
    QS + 256 * j + 64 * (e / 8) + 4 * r + e % 4
}

/// The byte (from the start of `m`) holding the min of group `j` of row `r`.
#[inline]
fn mn_at(j: usize, r: usize) -> usize {
    2 * PACK_ROWS * (j / 2) + 2 * r + j % 2
}

/// The byte (from the start of `qh`) and bit holding the fifth bit of element `e` of group `j` of
/// row `r`: the byte of [`qs_at`]'s within its load, bit `2 * load + nibble`.
#[inline]
fn qh_at(j: usize, r: usize, e: usize) -> (usize, usize) {
    (64 * j + 4 * r + e % 4, 2 * (e / 8) + (e % 8) / 4)
}

/// Level `e` (0..32) of group `j` of row `r` in a packed block.
#[inline]
fn level<const HIGH: bool>(blk: &[u8], j: usize, r: usize, e: usize) -> i32 {
    let q = (blk[qs_at(j, r, e)] >> (4 * ((e % 8) / 4))) & 0x0F;
    let h = if HIGH {
        let (byte, bit) = qh_at(j, r, e);
        (blk[layout(true).qh + byte] >> bit) & 1
    } else {
        0
    };
    (q | h << 4) as i32
}

x86_kernels! {
    /// The AVX-512 VNNI kernels, where this build has them.
    SIMD = x86::group_vnni::<false>;
    SIMD_Q5K = x86::group_vnni::<true>;
    /// The AVX2 kernel of Q4_K, where this build has one.
    AVX2 = x86::group_avx2::<false>;
    /// The AVX2 kernel of Q5_K, where this build has one.
    AVX2_Q5K = x86::group_avx2::<true>;
}

/// The scalar reference: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`].
pub(super) unsafe fn group_scalar<const HIGH: bool>(
    nb: usize,
    w: *const u8,
    a: GroupActs,
    ny: usize,
    out: *mut f32,
    ostride: usize,
) {
    let l = layout(HIGH);
    // SAFETY: forwarded from the caller.
    unsafe {
        super::q8k_scalar(nb, w, l.size, a, ny, out, ostride, |blk, y, r| {
            let (mut isum, mut imin) = (0i32, 0i32);
            for j in 0..SUBS {
                let s: i32 = (0..32).map(|e| level::<HIGH>(blk, j, r, e) * y.q(32 * j + e)).sum();
                isum += blk[l.sc + PACK_ROWS * j + r] as i32 * s;
                imin += blk[l.mn + mn_at(j, r)] as i32 * (y.bsum(2 * j) + y.bsum(2 * j + 1));
            }
            let (d, dmin) = (f16_at(blk, l.d + 2 * r), f16_at(blk, l.dmin + 2 * r));
            (-(imin as f32)).mul_add(dmin, isum as f32 * d)
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::{bcast, bcast8, prefetch_part, token_blocks};
    use super::{layout, GroupActs, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, SUBS};
    use std::arch::x86_64::*;

    /// `vpshufb` control: 32-bit lane `r` gets byte `r` of its 128-bit lane twice, as two u16.
    static PAIRS: [u8; 64] = {
        let mut c = [0x80u8; 64];
        let mut r = 0;
        while r < 16 {
            c[4 * r] = r as u8;
            c[4 * r + 2] = r as u8;
            r += 1;
        }
        c
    };
    /// The low 16 bits of every 32-bit lane.
    const LOW_HALVES: i32 = 0xFFFF;

    /// The sums of the quants of the 8 groups of 32 of a Q8_K block (`y`), as the i16 pairs
    /// `(sum_2k, sum_2k + 1)` in `pairs[k]`, for `vpdpwssd` against the mins' pairs.
    ///
    /// # Safety
    /// `y` points at a Q8_K block; the machine has AVX2.
    #[inline(always)]
    unsafe fn group_sum_pairs(y: *const u8) -> [i32; 4] {
        // SAFETY: as the caller guarantees. The sums of 32 quants (|.| <= 4064) fit an i16.
        unsafe {
            let bs = _mm256_madd_epi16(_mm256_loadu_si256(y.add(Q8K_BSUMS) as *const __m256i), _mm256_set1_epi16(1));
            // Per 128-bit lane: the four i32 sums packed to i16 twice; dwords 0, 1, 4, 5 are the pairs.
            let mut both = [0i32; 8];
            _mm256_storeu_si256(both.as_mut_ptr() as *mut __m256i, _mm256_packs_epi32(bs, bs));
            [both[0], both[1], both[4], both[5]]
        }
    }

    /// The 16 bytes at `p` (one per row), each as the u16 pair (b, b) in its row's lane.
    ///
    /// # Safety
    /// 16 readable bytes at `p`; the machine has AVX-512 BW.
    #[inline(always)]
    unsafe fn pairs_of(p: *const u8, pairs: __m512i) -> __m512i {
        // SAFETY: as the caller guarantees.
        unsafe { _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i)), pairs) }
    }

    group_entry! {
        /// A [`super::GroupFn`] for AVX-512 VNNI (Q4_K, or with `HIGH` Q5_K).
        ///
        /// # Safety
        /// As [`super::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
        group_vnni<const HIGH: bool> => group, q8k
    }

    /// # Safety
    /// As [`super::GroupFn`] with `ny == NY`, and the machine has AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
    unsafe fn group<const HIGH: bool, const PF: u8, const NY: usize>(
        nb: usize,
        w: *const u8,
        ys: *const u8,
        yb: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let lay = const { layout(HIGH) };
            let nib = _mm512_set1_epi8(0x0F);
            let bit4 = _mm512_set1_epi8(0x10);
            let pairs = _mm512_loadu_si512(PAIRS.as_ptr() as *const __m512i);
            let low = _mm512_set1_epi32(LOW_HALVES);
            let mut acc = [_mm512_setzero_ps(); NY];
            for b in 0..nb {
                // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
                {
                    let wb = w.add(b * lay.size);
                    let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                    let mut isum = [_mm512_setzero_si512(); NY];
                    for j in 0..SUBS {
                        if NY == 1 {
                            prefetch_part::<PF>(wb, lay.size, j, SUBS);
                        }
                        // The levels of the group's four loads, low and high nibbles. Q4_K keeps its
                        // high nibbles in place: 16 times the level, at no shift.
                        let mut lo = [_mm512_setzero_si512(); 4];
                        let mut hi = [_mm512_setzero_si512(); 4];
                        let fifth =
                            if HIGH { _mm512_loadu_si512(wb.add(lay.qh + 64 * j) as *const __m512i) } else { nib };
                        for l in 0..4 {
                            let raw = _mm512_loadu_si512(wb.add(256 * j + 64 * l) as *const __m512i);
                            lo[l] = _mm512_and_si512(raw, nib);
                            hi[l] = if HIGH {
                                // level | (bit 2l (+1) of `fifth`, moved to bit 4 of its byte)
                                lo[l] = _mm512_ternarylogic_epi32::<0xF8>(lo[l], to_bit4(fifth, 2 * l), bit4);
                                let h = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
                                _mm512_ternarylogic_epi32::<0xF8>(h, to_bit4(fifth, 2 * l + 1), bit4)
                            } else {
                                _mm512_andnot_si512(nib, raw)
                            };
                        }
                        let scales = wb.add(lay.sc + 16 * j);
                        let (sc, scsc) = match HIGH {
                            true => (_mm512_cvtepu8_epi32(_mm_loadu_si128(scales as *const __m128i)), nib),
                            false => (nib, pairs_of(scales, pairs)),
                        };
                        for t in 0..NY {
                            let q = y[t].add(Q8K_QS + 32 * j);
                            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                            for l in 0..4 {
                                s0 = _mm512_dpbusd_epi32(s0, lo[l], bcast(q.add(8 * l)));
                                s1 = _mm512_dpbusd_epi32(s1, hi[l], bcast(q.add(8 * l + 4)));
                            }
                            isum[t] = if HIGH {
                                // Levels up to 31: the sums of 16 need not fit an i16.
                                _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc))
                            } else {
                                // s0 and s1 / 16 are sums of 16 products of a level <= 15 and an i8:
                                // |.| <= 30720, exact as i16. As the pair (s0, s1 / 16) per lane,
                                // `vpdpwssd` against (sc, sc) adds sc * (s0 + s1 / 16) exactly. s1
                                // is a multiple of 16, so s1 << 12 is s1 / 16 in the high half.
                                let both = _mm512_ternarylogic_epi32::<0xD8>(_mm512_slli_epi32::<12>(s1), s0, low);
                                _mm512_dpwssd_epi32(isum[t], both, scsc)
                            };
                        }
                    }
                    // The mins, once per block: (m_2k, m_2k+1) per row against the pair of the two
                    // groups' activation sums.
                    let sums: [[i32; 4]; NY] = std::array::from_fn(|t| group_sum_pairs(y[t]));
                    let mut imin = [_mm512_setzero_si512(); NY];
                    for k in 0..SUBS / 2 {
                        let mm = _mm512_cvtepu8_epi16(_mm256_loadu_si256(wb.add(lay.mn + 32 * k) as *const __m256i));
                        for t in 0..NY {
                            imin[t] = _mm512_dpwssd_epi32(imin[t], mm, _mm512_set1_epi32(sums[t][k]));
                        }
                    }
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(lay.d) as *const __m256i));
                    let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(lay.dmin) as *const __m256i));
                    for t in 0..NY {
                        let v = _mm512_fnmadd_ps(
                            _mm512_cvtepi32_ps(imin[t]),
                            dmin,
                            _mm512_mul_ps(_mm512_cvtepi32_ps(isum[t]), d),
                        );
                        let yd = _mm512_set1_ps((y[t] as *const f32).read_unaligned());
                        acc[t] = _mm512_fmadd_ps(v, yd, acc[t]);
                    }
                }
            }
            // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
            super::super::x86::store(&acc, out, ostride);
        }
    }

    group_entry! {
        /// A [`super::GroupFn`] for Q4_K (or with `HIGH` Q5_K) on AVX2: each half of the 16 rows in
        /// a ymm register; `vpmaddubsw` (Q4_K's levels <= 15, so the i16 pair sums of the eight of a
        /// group stay below 2^15; Q5_K's <= 31, so four at a time) and `vpmaddwd` against the group's
        /// scale give the exact integer sums of the VNNI kernel.
        ///
        /// # Safety
        /// As [`super::GroupFn`] (Q8_K activations), and the machine has AVX2.
        group_avx2<const HIGH: bool> => group2, q8k
    }

    /// # Safety
    /// As [`group_avx2`] with `ny == NY`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
    unsafe fn group2<const HIGH: bool, const PF: u8, const NY: usize>(
        nb: usize,
        w: *const u8,
        ys: *const u8,
        yb: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let lay = const { layout(HIGH) };
        let nib = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
        let mut acc = [[_mm256_setzero_ps(); 2]; NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * lay.size);
                let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                let sums: [[i32; 4]; NY] = std::array::from_fn(|t| group_sum_pairs(y[t]));
                for hf in 0..2 {
                    let mut isum = [_mm256_setzero_si256(); NY];
                    for j in 0..SUBS {
                        if NY == 1 {
                            prefetch_part::<PF>(wb, lay.size, hf * SUBS + j, 2 * SUBS);
                        }
                        let sc =
                            _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(lay.sc + 16 * j + 8 * hf) as *const __m128i));
                        // (sc, sc) as an i16 pair per lane: `vpmaddwd` of the i16 pair sums of
                        // `vpmaddubsw` with it is sc times their sum, exactly.
                        let scsc = _mm256_or_si256(sc, _mm256_slli_epi32::<16>(sc));
                        let mut lo = [_mm256_setzero_si256(); 4];
                        let mut hi = [_mm256_setzero_si256(); 4];
                        let fifth = if HIGH {
                            _mm256_loadu_si256(wb.add(lay.qh + 64 * j + 32 * hf) as *const __m256i)
                        } else {
                            nib
                        };
                        for l in 0..4 {
                            let raw = _mm256_loadu_si256(wb.add(256 * j + 64 * l + 32 * hf) as *const __m256i);
                            lo[l] = _mm256_and_si256(raw, nib);
                            hi[l] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
                            if HIGH {
                                // level | (bit 2l (+1) of `fifth`, moved to bit 4 of its byte)
                                lo[l] = _mm256_or_si256(lo[l], _mm256_and_si256(to_bit4_256(fifth, 2 * l), bit4));
                                hi[l] = _mm256_or_si256(hi[l], _mm256_and_si256(to_bit4_256(fifth, 2 * l + 1), bit4));
                            }
                        }
                        for t in 0..NY {
                            let q = y[t].add(Q8K_QS + 32 * j);
                            if HIGH {
                                // levels up to 31: four pair sums per i16 at most
                                let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                                for l in 0..4 {
                                    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(lo[l], bcast8(q.add(8 * l))));
                                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(hi[l], bcast8(q.add(8 * l + 4))));
                                }
                                let s = _mm256_add_epi32(_mm256_madd_epi16(s0, scsc), _mm256_madd_epi16(s1, scsc));
                                isum[t] = _mm256_add_epi32(isum[t], s);
                            } else {
                                let mut s = _mm256_setzero_si256();
                                for l in 0..4 {
                                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[l], bcast8(q.add(8 * l))));
                                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[l], bcast8(q.add(8 * l + 4))));
                                }
                                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, scsc));
                            }
                        }
                    }
                    // The mins of this half's 8 rows, once per block (see `group`).
                    let mut imin = [_mm256_setzero_si256(); NY];
                    for k in 0..SUBS / 2 {
                        let at = wb.add(lay.mn + 32 * k + 16 * hf);
                        let mm = _mm256_cvtepu8_epi16(_mm_loadu_si128(at as *const __m128i));
                        for t in 0..NY {
                            imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(mm, _mm256_set1_epi32(sums[t][k])));
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(lay.d + 16 * hf) as *const __m128i));
                    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(lay.dmin + 16 * hf) as *const __m128i));
                    for t in 0..NY {
                        let v = _mm256_fnmadd_ps(
                            _mm256_cvtepi32_ps(imin[t]),
                            dmin,
                            _mm256_mul_ps(_mm256_cvtepi32_ps(isum[t]), d),
                        );
                        let yd = _mm256_set1_ps((y[t] as *const f32).read_unaligned());
                        acc[t][hf] = _mm256_fmadd_ps(v, yd, acc[t][hf]);
                    }
                }
            }
        }
        // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
        unsafe { super::super::x86::store_halves(&acc, out, ostride) };
    }

    /// [`to_bit4`] on a ymm register.
    #[inline(always)]
    unsafe fn to_bit4_256(v: __m256i, p: usize) -> __m256i {
        // SAFETY: only called from functions enabling AVX2.
        unsafe { to_bit!(v, p, 4, _mm256_slli_epi16, _mm256_srli_epi16) }
    }

    /// `v` shifted so that bit `p` of every byte lands on bit 4 of that byte (other bits are
    /// garbage for the caller to mask off).
    #[inline(always)]
    unsafe fn to_bit4(v: __m512i, p: usize) -> __m512i {
        // SAFETY: only called from functions enabling AVX-512 BW.
        unsafe { to_bit!(v, p, 4, _mm512_slli_epi16, _mm512_srli_epi16) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{random_rows, Rng};
    use super::super::{group_bytes, pack};
    use super::*;
    use tandem_quant::{row_size, GgmlType};

    #[test]
    fn the_layout_keeps_every_level_scale_and_factor() {
        // Unpacking the packed bytes by the layout gives back ggml's dequantized rows exactly.
        fn check<const HIGH: bool>(ty: GgmlType) {
            let (rows, n) = (32, 512);
            let mut rng = Rng(7);
            let w = random_rows(ty, rows, n, &mut rng);
            let p = pack(ty, rows, n, &w).unwrap();
            let (rb, gb, l) = (row_size(ty, n).unwrap(), group_bytes(ty, n), layout(HIGH));
            assert_eq!(gb, n / QK_K * l.size);
            for row in 0..rows {
                let mut want = vec![0f32; n];
                tandem_quant::dequantize_row(ty, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
                let (g, r) = (row / PACK_ROWS, row % PACK_ROWS);
                for b in 0..n / QK_K {
                    let blk = &p.bytes()[g * gb + b * l.size..g * gb + (b + 1) * l.size];
                    let f16 = |at: usize| half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32();
                    for j in 0..SUBS {
                        let d = f16(l.d + 2 * r) * blk[l.sc + 16 * j + r] as f32;
                        let m = f16(l.dmin + 2 * r) * blk[l.mn + mn_at(j, r)] as f32;
                        for e in 0..32 {
                            assert_eq!(
                                d * level::<HIGH>(blk, j, r, e) as f32 - m,
                                want[b * QK_K + 32 * j + e],
                                "{ty} row {row} block {b} group {j} element {e}"
                            );
                        }
                    }
                }
            }
        }
        check::<false>(GgmlType::Q4_K);
        check::<true>(GgmlType::Q5_K);
    }
}
