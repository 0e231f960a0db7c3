//! AVX-512 VBMI unpacking of the IQ2/IQ3 grid types: the grid entries of a whole block are looked
//! up at once in a table of their value codes (2 bits per value for IQ2, 3 for IQ3: 16 bits per
//! entry, 32 entries per zmm, `vpermi2w` over 64 entries at a time), spread to one code per byte
//! (`vpermw`, `vpmultishiftqb`) and turned into levels `offset + value` or `offset - value` by a
//! 64-byte table (`vpermb`, the negated table under the group's sign mask). Sign masks come from
//! the sign bytes (`vpermb`, `vptestmb`); the IQ2_XXS / IQ2_XS / IQ3_XXS 7-bit sign fields get
//! their parity bit from `vpopcntb`. Same levels and factors as the AVX2 unpacking in `iq.rs`.

use super::unpack::Factors;
use std::arch::x86_64::*;
use tandem_quant::iq_tables::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// A 64-byte aligned value (to load as zmm).
#[repr(C, align(64))]
struct A64<T>(T);

/// Entry `i` of `grid` (`per` values of one byte each) as codes: the index of each value in
/// `vals`, `bits` bits per value; entries past the grid's (`N` may exceed it) are 0.
const fn codes<const N: usize>(grid: &[u64], per: usize, vals: &[u8], bits: usize) -> A64<[u16; N]> {
    let mut t = [0u16; N];
    let mut i = 0;
    while i < grid.len() {
        let mut j = 0;
        while j < per {
            let v = (grid[i] >> (8 * j)) as u8;
            let mut c = 0;
            while vals[c] != v {
                c += 1;
            }
            t[i] |= (c << (bits * j)) as u16;
            j += 1;
        }
        i += 1;
    }
    A64(t)
}

const fn widen<const N: usize>(g: &[u32; N]) -> [u64; N] {
    let mut t = [0u64; N];
    let mut i = 0;
    while i < N {
        t[i] = g[i] as u64;
        i += 1;
    }
    t
}

const V2: [u8; 3] = [8, 25, 43];
const V3XXS: [u8; 8] = [4, 12, 20, 28, 36, 44, 52, 62];
const V3S: [u8; 8] = [1, 3, 5, 7, 9, 11, 13, 15];

static IQ2XXS_CODES: A64<[u16; 256]> = codes(&IQ2XXS_GRID, 8, &V2, 2);
static IQ2XS_CODES: A64<[u16; 512]> = codes(&IQ2XS_GRID, 8, &V2, 2);
static IQ2S_CODES: A64<[u16; 1025]> = codes(&IQ2S_GRID, 8, &V2, 2);
static IQ3XXS_CODES: A64<[u16; 256]> = codes(&widen(&IQ3XXS_GRID), 4, &V3XXS, 3);
static IQ3S_CODES: A64<[u16; 512]> = codes(&widen(&IQ3S_GRID), 4, &V3S, 3);
/// IQ1S_GRID's codes (0, 1, 2 for -1, 0, 1). The gathered tables (IQ1S, IQ2S) have one entry
/// more: a gather reads 4 bytes.
static IQ1S_CODES: A64<[u16; 2049]> = codes(&IQ1S_GRID, 8, &[0xFF, 0, 1], 2);

/// The control vectors (64 bytes each).
#[repr(C, align(64))]
struct Ctl {
    /// u16 lane `m` <- byte `m` / byte `32 + m` (with the zero mask on odd bytes).
    lanes_lo: [u8; 64],
    lanes_hi: [u8; 64],
    /// IQ2_XXS: u16 lane `m` <- the byte of grid index `m` (4 per 8 bytes).
    iq2xxs_idx: [u8; 64],
    /// Byte `j` of each qword <- its bits `2j..` (2-bit codes of one u16 entry).
    ms2: [u8; 64],
    /// Byte `j` of each qword <- bits `3j..` (j < 4) or `16 + 3(j - 4)..` (3-bit codes of two entries).
    ms3: [u8; 64],
    /// Bytes 0..4 of each qword <- the 7-bit fields at bits `32 + 7l` / at bits `7l`.
    fields_hi: [u8; 64],
    fields_lo: [u8; 64],
    /// Byte `8j + b` = `1 << b`.
    bits: [u8; 64],
    /// Zmm `k`: u16 lane `4j` <- entry lane `8k + j` (one entry per group of 8).
    sel1: [[u16; 32]; 4],
    /// Zmm `k`: u16 lanes `4j`, `4j + 1` <- entry lanes `16 (k % 2) + 2j`, `+ 1` (two per group).
    sel2: [[u16; 32]; 4],
    /// Zmm `k`, every byte of qword `j` <- the sign byte of group `8k + j`, where sign bytes sit
    /// 4 per qword (`four`), one per u16 lane (`lanes`), or in a row from byte `o` (`row[o / 8]`).
    bcast_four: [[u8; 64]; 4],
    bcast_lanes: [[u8; 64]; 4],
    bcast_row: [[[u8; 64]; 4]; 5],
    /// u16 lane `g` <- byte `g / 2` (IQ2_XS / IQ2_S scales), byte `40 + g / 4` (IQ3_S scales).
    half: [u8; 64],
    quarter40: [u8; 64],
    /// u16 lane `g` <- byte `8 (g / 2) + 7` / `8 (g / 2) + 3`.
    last7: [u8; 64],
    last3: [u8; 64],
    /// u16 lane shifts: `4 (g % 2)`, `4 ((g / 2) % 2)`, `2 (m % 4)`, `m % 8`.
    sh_nib: [u16; 32],
    sh_nib2: [u16; 32],
    sh2: [u16; 32],
    sh1: [u16; 32],
    /// IQ2_S: u16 lane `m` <- byte `m / 4` (the `qh` byte of index `m`).
    qh4: [u8; 64],
    /// IQ3_S: u16 lane `m` <- byte `m / 8` / `4 + m / 8` (`qh` of entries `m`, `32 + m`).
    qh8_lo: [u8; 64],
    qh8_hi: [u8; 64],
    /// IQ1_S: u16 lane `m` <- u16 `qh[m / 4]` (bytes from 32); shifts `3 (m % 4)`.
    iq1s_qh: [u8; 64],
    sh3: [u16; 32],
    /// IQ1_M: u16 lane `m` <- byte `32 + m / 2` (its `qh` byte); shifts `4 (m % 2)`.
    iq1m_qh: [u8; 64],
    /// IQ1_M: zmm `k`, qword `j` <- `qh` byte `4k + j / 2` (from 32) in every byte, tested
    /// against the group's shift-sign bit `0x08 << 4 (j % 2)`.
    iq1m_bcast: [[u8; 64]; 4],
    iq1m_bits: [u8; 64],
    /// IQ1_M: u16 lane `g` <- scale word `g / 4` (bytes from 48); shifts `6 ((g / 2) % 2) + 3 (g % 2)`.
    iq1m_sc: [u8; 64],
    iq1m_shift: [u16; 32],
    /// u16 lane `g` <- lane `2g` (g < 16).
    dbl: [u16; 32],
}

static CTL: Ctl = {
    let mut t = Ctl {
        lanes_lo: [0; 64],
        lanes_hi: [0; 64],
        iq2xxs_idx: [0; 64],
        ms2: [0; 64],
        ms3: [0; 64],
        fields_hi: [0; 64],
        fields_lo: [0; 64],
        bits: [0; 64],
        sel1: [[0; 32]; 4],
        sel2: [[0; 32]; 4],
        bcast_four: [[0; 64]; 4],
        bcast_lanes: [[0; 64]; 4],
        bcast_row: [[[0; 64]; 4]; 5],
        half: [0; 64],
        quarter40: [0; 64],
        last7: [0; 64],
        last3: [0; 64],
        sh_nib: [0; 32],
        sh_nib2: [0; 32],
        sh2: [0; 32],
        sh1: [0; 32],
        qh4: [0; 64],
        qh8_lo: [0; 64],
        qh8_hi: [0; 64],
        iq1s_qh: [0; 64],
        sh3: [0; 32],
        iq1m_qh: [0; 64],
        iq1m_bcast: [[0; 64]; 4],
        iq1m_bits: [0; 64],
        iq1m_sc: [0; 64],
        iq1m_shift: [0; 32],
        dbl: [0; 32],
    };
    let mut i = 0;
    while i < 64 {
        let (q, b) = (i / 8, i % 8);
        let m = i / 2;
        if i % 2 == 0 {
            t.lanes_lo[i] = m as u8;
            t.lanes_hi[i] = (32 + m) as u8;
            t.iq2xxs_idx[i] = (8 * (m / 4) + m % 4) as u8;
            t.half[i] = (m / 2) as u8;
            t.quarter40[i] = (40 + m / 4) as u8;
            t.last7[i] = (8 * (m / 2) + 7) as u8;
            t.last3[i] = (8 * (m / 2) + 3) as u8;
            t.qh4[i] = (m / 4) as u8;
            t.qh8_lo[i] = (m / 8) as u8;
            t.qh8_hi[i] = (4 + m / 8) as u8;
            t.iq1m_qh[i] = (32 + m / 2) as u8;
        }
        t.iq1s_qh[i] = (32 + 2 * (m / 4) + i % 2) as u8;
        t.iq1m_sc[i] = (48 + 2 * (m / 4) + i % 2) as u8;
        t.iq1m_bits[i] = 0x08 << (4 * (q % 2));
        t.ms2[i] = (2 * b) as u8;
        t.ms3[i] = if b < 4 { 3 * b } else { 16 + 3 * (b - 4) } as u8;
        t.fields_hi[i] = if b < 4 { 32 + 7 * b } else { 0 } as u8;
        t.fields_lo[i] = if b < 4 { 7 * b } else { 0 } as u8;
        t.bits[i] = 1 << b;
        let mut k = 0;
        while k < 4 {
            let g = 8 * k + q;
            t.bcast_four[k][i] = (8 * (g / 4) + g % 4) as u8;
            t.bcast_lanes[k][i] = (2 * g) as u8;
            let mut o = 0;
            while o < 5 {
                t.bcast_row[o][k][i] = (8 * o + g) as u8;
                o += 1;
            }
            t.iq1m_bcast[k][i] = (32 + 4 * k + q / 2) as u8;
            if i < 32 {
                t.sel1[k][i] = (8 * k + i / 4) as u16;
                t.sel2[k][i] = (16 * (k % 2) + 2 * (i / 4) + (i % 4) % 2) as u16;
            }
            k += 1;
        }
        if i < 32 {
            t.sh_nib[i] = (4 * (i % 2)) as u16;
            t.sh_nib2[i] = (4 * ((i / 2) % 2)) as u16;
            t.sh2[i] = (2 * (i % 4)) as u16;
            t.sh1[i] = (i % 8) as u16;
            t.sh3[i] = (3 * (i % 4)) as u16;
            t.iq1m_shift[i] = (6 * ((i / 2) % 2) + 3 * (i % 2)) as u16;
            t.dbl[i] = ((2 * i) % 32) as u16;
        }
        i += 1;
    }
    t
};

/// `offset + value` and `offset - value` by code (the low bits of a `vpermb` index).
#[repr(C, align(64))]
struct Lut {
    pos: [u8; 64],
    neg: [u8; 64],
}

const fn lut(vals: &[u8], offset: u8) -> Lut {
    let mut t = Lut { pos: [0; 64], neg: [0; 64] };
    let n = if vals.len() > 4 { 8 } else { 4 };
    let mut i = 0;
    while i < 64 {
        let c = i % n;
        let v = if c < vals.len() { vals[c] } else { 0 };
        t.pos[i] = offset + v;
        t.neg[i] = offset - v;
        i += 1;
    }
    t
}

static LUT2: Lut = lut(&V2, 43);
static LUT3XXS: Lut = lut(&V3XXS, 62);
static LUT3S: Lut = lut(&V3S, 15);
/// IQ1 levels `8 (value + 1) + 1 + delta` by code: delta +1 (`pos`) or -1 (`neg`).
static LUT1: Lut = {
    let mut t = Lut { pos: [0; 64], neg: [0; 64] };
    let mut i = 0;
    while i < 64 {
        let c = (i % 4) as u8;
        t.pos[i] = 8 * c + 2;
        t.neg[i] = 8 * c;
        i += 1;
    }
    t
};

#[inline(always)]
unsafe fn ld<T>(p: *const T) -> __m512i {
    // SAFETY: the caller passes a 64-byte aligned 64-byte table.
    unsafe { _mm512_load_si512(p as *const __m512i) }
}

/// The u16 codes of the 32 entries whose indices are `idx`'s u16 lanes (below `table.len()`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
fn lookup<const N: usize>(table: &A64<[u16; N]>, idx: __m512i) -> __m512i {
    let t = table.0.as_ptr();
    let pair = |k: usize| {
        // SAFETY: N is a multiple of 64, each pair of zmm is 64 entries of the table (every load).
        unsafe { _mm512_permutex2var_epi16(ld(t.add(64 * k)), idx, ld(t.add(64 * k + 32))) }
    };
    let mut r = pair(0);
    let hi = _mm512_srli_epi16(idx, 6);
    for k in 1..N / 64 {
        r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(hi, _mm512_set1_epi16(k as i16)), pair(k));
    }
    r
}

/// Sign bytes from 7-bit fields (bytes): bit 7 = the fields' parity (ggml's `ksigns_iq2xs`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
fn with_parity(s7: __m512i) -> __m512i {
    let parity = _mm512_and_si512(_mm512_popcnt_epi8(s7), _mm512_set1_epi8(1));
    _mm512_or_si512(s7, _mm512_slli_epi16(parity, 7))
}

/// The levels of zmm `k`: the codes `ck` (one per byte) through `lut`, negated where `sb`'s sign
/// bit of the weight is set (`bcast`: the sign byte of each weight's group to every byte).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
fn levels(ck: __m512i, lut: &Lut, sb: __m512i, bcast: &[u8; 64]) -> __m512i {
    // SAFETY: aligned 64-byte tables.
    let (pos, neg, bc, bits) =
        unsafe { (ld(lut.pos.as_ptr()), ld(lut.neg.as_ptr()), ld(bcast.as_ptr()), ld(CTL.bits.as_ptr())) };
    let neg_k = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(bc, sb), bits);
    _mm512_mask_permutexvar_epi8(_mm512_permutexvar_epi8(ck, pos), neg_k, ck, neg)
}

/// Factors from the 4-bit scales `s` (u16 lanes 0..16): scale `2s + 1`, `m = offset * scale`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
fn factors(s: __m512i, offset: i16, d: f32) -> Factors {
    let s = _mm512_and_si512(s, _mm512_set1_epi16(0xF));
    let sc = _mm512_add_epi16(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
    let m = _mm512_mullo_epi16(sc, _mm512_set1_epi16(offset));
    Factors { sc: _mm512_castsi512_si256(sc), m: _mm512_castsi512_si256(m), d, dmin: d }
}

/// The fp16 at `p`, as f32 (ggml's conversion).
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller passes two readable bytes.
    tandem_quant::fp16_to_f32(half::f16::from_bits(u16::from_le_bytes(unsafe { [*p, *p.add(1)] })))
}

const ODD_ZERO: __mmask64 = 0x5555_5555_5555_5555;

/// IQ2_XXS: d, then per group of 32 four index bytes and a u32 of sign fields and scale.
///
/// # Safety
/// `p` points at a whole block; the machine has the features named.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
pub(super) unsafe fn iq2xxs(p: *const u8) -> ([__m512i; 4], Factors) {
    let c = &CTL;
    // SAFETY: the 64 bytes after the scale are the block's; the tables are aligned.
    unsafe {
        let q = _mm512_loadu_si512(p.add(2) as *const __m512i);
        let codes = lookup(&IQ2XXS_CODES, _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.iq2xxs_idx.as_ptr()), q));
        let sb = with_parity(_mm512_and_si512(
            _mm512_multishift_epi64_epi8(ld(c.fields_hi.as_ptr()), q),
            _mm512_set1_epi8(0x7F),
        ));
        let mut w = [_mm512_setzero_si512(); 4];
        for (k, v) in w.iter_mut().enumerate() {
            let ck = _mm512_multishift_epi64_epi8(
                ld(c.ms2.as_ptr()),
                _mm512_permutexvar_epi16(ld(c.sel1[k].as_ptr()), codes),
            );
            *v = levels(ck, &LUT2, sb, &c.bcast_four[k]);
        }
        let s = _mm512_srli_epi16(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.last7.as_ptr()), q), 4);
        (w, factors(s, 43, 0.125 * f16_at(p)))
    }
}

/// IQ2_XS: d, 32 u16 (9-bit index, 7 sign bits), 8 bytes of scale nibbles.
///
/// # Safety
/// As [`iq2xxs`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
pub(super) unsafe fn iq2xs(p: *const u8) -> ([__m512i; 4], Factors) {
    let c = &CTL;
    // SAFETY: bytes 2..74 are the block's; the tables are aligned.
    unsafe {
        let q = _mm512_loadu_si512(p.add(2) as *const __m512i);
        let codes = lookup(&IQ2XS_CODES, _mm512_and_si512(q, _mm512_set1_epi16(511)));
        let sb = with_parity(_mm512_srli_epi16(q, 9));
        let mut w = [_mm512_setzero_si512(); 4];
        for (k, v) in w.iter_mut().enumerate() {
            let ck = _mm512_multishift_epi64_epi8(
                ld(c.ms2.as_ptr()),
                _mm512_permutexvar_epi16(ld(c.sel1[k].as_ptr()), codes),
            );
            *v = levels(ck, &LUT2, sb, &c.bcast_lanes[k]);
        }
        let sc = _mm512_castsi128_si512(_mm_loadl_epi64(p.add(66) as *const __m128i));
        let s =
            _mm512_srlv_epi16(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.half.as_ptr()), sc), ld(c.sh_nib.as_ptr()));
        (w, factors(s, 43, 0.125 * f16_at(p)))
    }
}

/// IQ2_S: d, 32 index low bytes, 32 sign bytes, 8 bytes of index high bits, 8 of scale nibbles.
///
/// # Safety
/// As [`iq2xxs`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
pub(super) unsafe fn iq2s(p: *const u8) -> ([__m512i; 4], Factors) {
    let c = &CTL;
    // SAFETY: bytes 2..82 are the block's; the tables are aligned.
    unsafe {
        let q = _mm512_loadu_si512(p.add(2) as *const __m512i);
        let h = _mm512_castsi128_si512(_mm_loadu_si128(p.add(66) as *const __m128i));
        let lo = _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.lanes_lo.as_ptr()), q);
        let qh = _mm512_srlv_epi16(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.qh4.as_ptr()), h), ld(c.sh2.as_ptr()));
        let idx = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi16(3)), 8));
        let codes = gather_codes(&IQ2S_CODES, idx);
        let mut w = [_mm512_setzero_si512(); 4];
        for (k, v) in w.iter_mut().enumerate() {
            let ck = _mm512_multishift_epi64_epi8(
                ld(c.ms2.as_ptr()),
                _mm512_permutexvar_epi16(ld(c.sel1[k].as_ptr()), codes),
            );
            *v = levels(ck, &LUT2, q, &c.bcast_row[4][k]);
        }
        let sc = _mm512_castsi128_si512(_mm_srli_si128(_mm512_castsi512_si128(h), 8));
        let s =
            _mm512_srlv_epi16(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.half.as_ptr()), sc), ld(c.sh_nib.as_ptr()));
        (w, factors(s, 43, 0.125 * f16_at(p)))
    }
}

/// IQ3_XXS: d, 64 index bytes (4 values each), 8 u32 of sign fields and scale.
///
/// # Safety
/// As [`iq2xxs`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
pub(super) unsafe fn iq3xxs(p: *const u8) -> ([__m512i; 4], Factors) {
    let c = &CTL;
    // SAFETY: bytes 2..98 are the block's; the tables are aligned.
    unsafe {
        let q = _mm512_loadu_si512(p.add(2) as *const __m512i);
        let gas = _mm512_cvtepu32_epi64(_mm256_loadu_si256(p.add(66) as *const __m256i));
        let codes = [
            lookup(&IQ3XXS_CODES, _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.lanes_lo.as_ptr()), q)),
            lookup(&IQ3XXS_CODES, _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.lanes_hi.as_ptr()), q)),
        ];
        let sb = with_parity(_mm512_and_si512(
            _mm512_multishift_epi64_epi8(ld(c.fields_lo.as_ptr()), gas),
            _mm512_set1_epi8(0x7F),
        ));
        let mut w = [_mm512_setzero_si512(); 4];
        for (k, v) in w.iter_mut().enumerate() {
            let qk = _mm512_permutexvar_epi16(ld(c.sel2[k].as_ptr()), codes[k / 2]);
            *v = levels(_mm512_multishift_epi64_epi8(ld(c.ms3.as_ptr()), qk), &LUT3XXS, sb, &c.bcast_four[k]);
        }
        let s = _mm512_srli_epi16(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.last3.as_ptr()), gas), 4);
        (w, factors(s, 62, 0.25 * f16_at(p)))
    }
}

/// IQ3_S: d, 64 index low bytes, 8 bytes of index high bits, 32 sign bytes, 4 bytes of scales.
///
/// # Safety
/// As [`iq2xxs`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
pub(super) unsafe fn iq3s(p: *const u8) -> ([__m512i; 4], Factors) {
    let c = &CTL;
    // SAFETY: bytes 2..110 are the block's (the second load masked to its 44 bytes); aligned tables.
    unsafe {
        let q = _mm512_loadu_si512(p.add(2) as *const __m512i);
        let r = _mm512_maskz_loadu_epi8((1u64 << 44) - 1, p.add(66) as *const i8);
        let one = _mm512_set1_epi16(1);
        let hi_bit = |t: &[u8; 64]| {
            let qh = _mm512_srlv_epi16(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(t.as_ptr()), r), ld(c.sh1.as_ptr()));
            _mm512_slli_epi16(_mm512_and_si512(qh, one), 8)
        };
        let idx_lo =
            _mm512_or_si512(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.lanes_lo.as_ptr()), q), hi_bit(&c.qh8_lo));
        let idx_hi =
            _mm512_or_si512(_mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.lanes_hi.as_ptr()), q), hi_bit(&c.qh8_hi));
        let codes = [lookup(&IQ3S_CODES, idx_lo), lookup(&IQ3S_CODES, idx_hi)];
        let mut w = [_mm512_setzero_si512(); 4];
        for (k, v) in w.iter_mut().enumerate() {
            let qk = _mm512_permutexvar_epi16(ld(c.sel2[k].as_ptr()), codes[k / 2]);
            *v = levels(_mm512_multishift_epi64_epi8(ld(c.ms3.as_ptr()), qk), &LUT3S, r, &c.bcast_row[1][k]);
        }
        let s = _mm512_srlv_epi16(
            _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.quarter40.as_ptr()), r),
            ld(c.sh_nib2.as_ptr()),
        );
        (w, factors(s, 15, f16_at(p)))
    }
}

/// The codes of the 32 entries of a code table of `N - 1` entries (plus one: a gather reads 4
/// bytes) whose indices are `idx`'s u16 lanes: two gathers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
fn gather_codes<const N: usize>(table: &A64<[u16; N]>, idx: __m512i) -> __m512i {
    let base = table.0.as_ptr() as *const i32;
    let half = |v: __m256i| {
        // SAFETY: indices below N - 1, each reading 4 bytes of the N-entry table.
        let g = unsafe { _mm512_i32gather_epi32::<2>(_mm512_cvtepu16_epi32(v), base) };
        _mm512_cvtepi32_epi16(g)
    };
    _mm512_inserti64x4(
        _mm512_castsi256_si512(half(_mm512_castsi512_si256(idx))),
        half(_mm512_extracti64x4_epi64(idx, 1)),
        1,
    )
}

/// IQ1_S: d, 32 index low bytes, 8 u16 (4 x 3 high index bits, 3-bit scale, shift sign).
///
/// # Safety
/// As [`iq2xxs`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
pub(super) unsafe fn iq1s(p: *const u8) -> ([__m512i; 4], Factors) {
    let c = &CTL;
    // SAFETY: bytes 2..50 are the block's (a load masked to them); aligned tables.
    unsafe {
        let q = _mm512_maskz_loadu_epi8((1u64 << 48) - 1, p.add(2) as *const i8);
        let lo = _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.lanes_lo.as_ptr()), q);
        let qh = _mm512_permutexvar_epi8(ld(c.iq1s_qh.as_ptr()), q);
        let hi = _mm512_and_si512(_mm512_srlv_epi16(qh, ld(c.sh3.as_ptr())), _mm512_set1_epi16(7));
        let codes = gather_codes(&IQ1S_CODES, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 8)));
        let neg = _mm512_movepi16_mask(qh); // lane m: the shift sign of group of 32 m / 4
        let mut w = [_mm512_setzero_si512(); 4];
        let (pos_t, neg_t) = (ld(LUT1.pos.as_ptr()), ld(LUT1.neg.as_ptr()));
        for (k, v) in w.iter_mut().enumerate() {
            let ck = _mm512_multishift_epi64_epi8(
                ld(c.ms2.as_ptr()),
                _mm512_permutexvar_epi16(ld(c.sel1[k].as_ptr()), codes),
            );
            // Groups of 32 2k and 2k + 1: the lower and upper 32 bytes.
            let (a, b) = ((neg >> (8 * k)) & 1, (neg >> (8 * k + 4)) & 1);
            let nk = (a as u64).wrapping_neg() & 0xFFFF_FFFF | ((b as u64).wrapping_neg() << 32);
            *v = _mm512_mask_permutexvar_epi8(_mm512_permutexvar_epi8(ck, pos_t), nk, ck, neg_t);
        }
        // u16 lane g <- qh[g / 2]: the lanes 4 (g / 2) of `qh`.
        let s = _mm512_srli_epi16(_mm512_permutexvar_epi16(ld(c.dbl.as_ptr()), qh), 12);
        (w, factors(_mm512_and_si512(s, _mm512_set1_epi16(7)), 9, 0.125 * f16_at(p)))
    }
}

/// IQ1_M: 32 index low bytes, 16 bytes of high index bits and shift signs, 4 u16 of 3-bit scales
/// whose top nibbles hold d.
///
/// # Safety
/// As [`iq2xxs`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
pub(super) unsafe fn iq1m(p: *const u8) -> ([__m512i; 4], Factors) {
    let c = &CTL;
    // SAFETY: bytes 0..56 are the block's (a load masked to them); aligned tables.
    unsafe {
        let q = _mm512_maskz_loadu_epi8((1u64 << 56) - 1, p as *const i8);
        let lo = _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.lanes_lo.as_ptr()), q);
        let qh = _mm512_maskz_permutexvar_epi8(ODD_ZERO, ld(c.iq1m_qh.as_ptr()), q);
        let hi = _mm512_and_si512(_mm512_srlv_epi16(qh, ld(c.sh_nib.as_ptr())), _mm512_set1_epi16(7));
        let codes = gather_codes(&IQ1S_CODES, _mm512_or_si512(lo, _mm512_slli_epi16(hi, 8)));
        let mut w = [_mm512_setzero_si512(); 4];
        let (pos_t, neg_t, bits) = (ld(LUT1.pos.as_ptr()), ld(LUT1.neg.as_ptr()), ld(c.iq1m_bits.as_ptr()));
        for (k, v) in w.iter_mut().enumerate() {
            let ck = _mm512_multishift_epi64_epi8(
                ld(c.ms2.as_ptr()),
                _mm512_permutexvar_epi16(ld(c.sel1[k].as_ptr()), codes),
            );
            let nk = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(ld(c.iq1m_bcast[k].as_ptr()), q), bits);
            *v = _mm512_mask_permutexvar_epi8(_mm512_permutexvar_epi8(ck, pos_t), nk, ck, neg_t);
        }
        let sc = _mm512_srlv_epi16(_mm512_permutexvar_epi8(ld(c.iq1m_sc.as_ptr()), q), ld(c.iq1m_shift.as_ptr()));
        let mut scales = [0u8; 8];
        std::ptr::copy_nonoverlapping(p.add(48), scales.as_mut_ptr(), 8);
        (w, factors(_mm512_and_si512(sc, _mm512_set1_epi16(7)), 9, 0.125 * tandem_quant::iq1m_scale(&scales)))
    }
}
