//! Unpacking of the IQ1/IQ2/IQ3 grid types for the k-quant dot loops: each group of 8 weights is a
//! grid entry (a u64 of 8 values, or two u32 of 4) with signs, turned into non-negative levels
//! `u = offset + sign * value` eight bytes at a time in general registers (no carries between
//! bytes: every value is at most the offset), with the offset folded into the `m` term
//! ([`KQuant::FOLD`]), so the sums stay exact integers:
//!
//! * IQ2_XXS / IQ2_XS / IQ2_S: values 8, 25, 43, offset 43, scale `2s + 1`, `d / 8`.
//! * IQ3_XXS: values 4..62, offset 62, scale `2s + 1`, `d / 4`. IQ3_S: values 1..15, offset 15.
//! * IQ1_S / IQ1_M: `8 * value + delta` with value -1, 0, 1 and delta = +-1 (ggml's +-1/8 shift
//!   times 8), offset 9, `d / 8`.
//!
//! Levels reach 124 (IQ3_XXS), so a `vpmaddubsw` pair stays below 2^15 (2 * 124 * 127), but four
//! `vpdpbusd` products do not always fit an i16: these types skip the VNNI kernels, whose packed
//! sums need levels of at most 63 ([`KQuant::VNNI`]).

use super::iq_vbmi;
use super::unpack::{Factors, KQuant, Unpacked};
use std::arch::x86_64::*;
use std::mem::size_of;
use tandem_quant::blocks::{BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS};
use tandem_quant::iq_tables::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};

/// Byte `j` all ones where bit `j` of `b` is set.
const fn byte_mask(b: u8) -> u64 {
    let mut m = 0u64;
    let mut j = 0;
    while j < 8 {
        if b & (1 << j) != 0 {
            m |= 0xFF << (8 * j);
        }
        j += 1;
    }
    m
}

/// [`byte_mask`] of every sign byte.
static SIGN_MASK: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = byte_mask(b as u8);
        b += 1;
    }
    t
};

/// [`byte_mask`] of `ksigns_iq2xs[i]` (7 sign bits and their parity).
static KSIGN_MASK: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = byte_mask(KSIGNS_IQ2XS[i]);
        i += 1;
    }
    t
};

const ONES: u64 = 0x0101_0101_0101_0101;

/// `offset + value` where the mask byte is clear, `offset - value` where it is set.
#[inline(always)]
fn signed(grid: u64, mask: u64, offset: u64) -> u64 {
    ((offset + grid) & !mask) | ((offset - grid) & mask)
}

/// IQ1 levels `8 * (g + 1) + 1 + delta` from a grid entry of signed bytes g in -1..=1.
#[inline(always)]
fn iq1_level(grid: u64, delta_negative: bool) -> u64 {
    let hi = 0x8080_8080_8080_8080u64;
    // g + 1 per byte without carries between bytes.
    let g1 = ((grid & !hi) + ONES) ^ (grid & hi);
    (g1 << 3) + if delta_negative { 0 } else { 2 * ONES }
}

/// The factors of a block: scales per 16 weights, `m = offset * scale`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn factors(sc: &[i16; 16], offset: i16, d: f32) -> Factors {
    // SAFETY: 32 bytes read from a 16 x i16 array.
    let sc = unsafe { _mm256_loadu_si256(sc.as_ptr() as *const __m256i) };
    Factors { sc, m: _mm256_mullo_epi16(sc, _mm256_set1_epi16(offset)), d, dmin: d }
}

/// The 256 levels as 8 ymm (a plain loop: `array::from_fn`'s closure was left as a call).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn levels(u: &[u64; 32]) -> [__m256i; 8] {
    let mut w = [_mm256_setzero_si256(); 8];
    for (k, v) in w.iter_mut().enumerate() {
        // SAFETY: 32 bytes at a time from a 256-byte array.
        *v = unsafe { _mm256_loadu_si256(u.as_ptr().add(4 * k) as *const __m256i) };
    }
    w
}

#[inline(always)]
fn f16(bits: u16) -> f32 {
    tandem_quant::fp16_to_f32(half::f16::from_bits(bits))
}

/// Reads a block (any alignment).
///
/// # Safety
/// `p` points at `size_of::<B>()` readable bytes.
#[inline(always)]
unsafe fn read<B: tandem_quant::blocks::Block>(p: *const u8) -> B {
    // SAFETY: forwarded from the caller; blocks are plain data, valid for any bytes.
    unsafe { std::ptr::read_unaligned(p as *const B) }
}

pub(crate) struct IQ2XXS;
pub(crate) struct IQ2XS;
pub(crate) struct IQ2S;
pub(crate) struct IQ3XXS;
pub(crate) struct IQ3S;
pub(crate) struct IQ1S;
pub(crate) struct IQ1M;

const OFF2: u64 = 43 * ONES;
const OFF3XXS: u64 = 62 * ONES;
const OFF3S: u64 = 15 * ONES;

impl IQ2XXS {
    /// The two u32 of group of 32 `ib`: 4 grid indices, then 4 x 7 sign bits and the scale.
    #[inline(always)]
    fn aux(x: &BlockIQ2XXS, ib: usize) -> (u32, u32) {
        let aux0 = x.qs[4 * ib] as u32 | (x.qs[4 * ib + 1] as u32) << 16;
        let aux1 = x.qs[4 * ib + 2] as u32 | (x.qs[4 * ib + 3] as u32) << 16;
        (aux0, aux1)
    }

    #[inline(always)]
    fn scales(x: &BlockIQ2XXS) -> [i16; 16] {
        let mut sc = [0i16; 16];
        for (g, v) in sc.iter_mut().enumerate() {
            *v = 2 * (Self::aux(x, g / 2).1 >> 28) as i16 + 1;
        }
        sc
    }
}

/// Scales `2s + 1` from one 4-bit `s` per 16 weights (IQ2_XS, IQ2_S).
#[inline(always)]
fn nibble_scales(scales: &[u8; 8]) -> [i16; 16] {
    let mut sc = [0i16; 16];
    for (g, v) in sc.iter_mut().enumerate() {
        *v = 2 * ((scales[g / 2] >> (4 * (g % 2))) & 0xf) as i16 + 1;
    }
    sc
}

/// The `KQuant` impl of a grid type: its block, whether its levels fit the VNNI kernels, its
/// `iq_vbmi` unpacking, and the AVX2 unpacking of `x` (the block) as the body.
macro_rules! grid_type {
    ($t:ident, $block:ident, vnni: $vnni:expr, vbmi: $vbmi:ident, |$x:ident| $body:block) => {
        impl KQuant for $t {
            const BYTES: usize = size_of::<$block>();
            const FOLD: bool = true;
            const VNNI: bool = $vnni;
            const OWN_VBMI: bool = true;
            const TILES: bool = false;

            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
            unsafe fn unpack_vbmi(p: *const u8) -> ([__m512i; 4], Factors) {
                // SAFETY: forwarded from the caller.
                unsafe { iq_vbmi::$vbmi(p) }
            }

            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn unpack(p: *const u8) -> Unpacked {
                // SAFETY: forwarded from the caller.
                let $x: $block = unsafe { read(p) };
                $body
            }
        }
    };
}

grid_type!(IQ2XXS, BlockIQ2XXS, vnni: false, vbmi: iq2xxs, |x| {
    let mut u = [0u64; 32];
    for ib in 0..8 {
        let (aux0, aux1) = Self::aux(&x, ib);
        for l in 0..4 {
            let grid = IQ2XXS_GRID[((aux0 >> (8 * l)) & 0xFF) as usize];
            u[4 * ib + l] = signed(grid, KSIGN_MASK[((aux1 >> (7 * l)) & 127) as usize], OFF2);
        }
    }
    Unpacked { w: levels(&u), f: factors(&Self::scales(&x), 43, 0.125 * f16(x.d.to_bits())) }
});

grid_type!(IQ2XS, BlockIQ2XS, vnni: false, vbmi: iq2xs, |x| {
    let mut u = [0u64; 32];
    for (k, v) in u.iter_mut().enumerate() {
        let q = x.qs[k];
        *v = signed(IQ2XS_GRID[(q & 511) as usize], KSIGN_MASK[(q >> 9) as usize], OFF2);
    }
    Unpacked { w: levels(&u), f: factors(&nibble_scales(&x.scales), 43, 0.125 * f16(x.d.to_bits())) }
});

grid_type!(IQ2S, BlockIQ2S, vnni: false, vbmi: iq2s, |x| {
    let mut u = [0u64; 32];
    for (k, v) in u.iter_mut().enumerate() {
        let (ib, l) = (k / 4, k % 4);
        let idx = x.qs[k] as usize | (((x.qh[ib] as usize) << (8 - 2 * l)) & 0x300);
        *v = signed(IQ2S_GRID[idx], SIGN_MASK[x.qs[32 + k] as usize], OFF2);
    }
    Unpacked { w: levels(&u), f: factors(&nibble_scales(&x.scales), 43, 0.125 * f16(x.d.to_bits())) }
});

grid_type!(IQ3XXS, BlockIQ3XXS, vnni: false, vbmi: iq3xxs, |x| {
    let mut u = [0u64; 32];
    let mut sc = [0i16; 16];
    for ib in 0..8 {
        let aux = u32::from_le_bytes([x.qs[64 + 4 * ib], x.qs[65 + 4 * ib], x.qs[66 + 4 * ib], x.qs[67 + 4 * ib]]);
        let ls = 2 * (aux >> 28) as i16 + 1;
        sc[2 * ib] = ls;
        sc[2 * ib + 1] = ls;
        for l in 0..4 {
            let q = &x.qs[8 * ib + 2 * l..];
            let grid = IQ3XXS_GRID[q[0] as usize] as u64 | (IQ3XXS_GRID[q[1] as usize] as u64) << 32;
            u[4 * ib + l] = signed(grid, KSIGN_MASK[((aux >> (7 * l)) & 127) as usize], OFF3XXS);
        }
    }
    Unpacked { w: levels(&u), f: factors(&sc, 62, 0.25 * f16(x.d.to_bits())) }
});

grid_type!(IQ3S, BlockIQ3S, vnni: true, vbmi: iq3s, |x| {
    let mut u = [0u64; 32];
    for (k, v) in u.iter_mut().enumerate() {
        let (g, l) = (k / 4, k % 4);
        let qh = x.qh[g] as usize;
        let i1 = x.qs[2 * k] as usize | ((qh << (8 - 2 * l)) & 256);
        let i2 = x.qs[2 * k + 1] as usize | ((qh << (7 - 2 * l)) & 256);
        let grid = IQ3S_GRID[i1] as u64 | (IQ3S_GRID[i2] as u64) << 32;
        *v = signed(grid, SIGN_MASK[x.signs[k] as usize], OFF3S);
    }
    let mut sc = [0i16; 16];
    for (g, v) in sc.iter_mut().enumerate() {
        *v = 2 * ((x.scales[g / 4] >> (4 * ((g / 2) % 2))) & 0xf) as i16 + 1;
    }
    Unpacked { w: levels(&u), f: factors(&sc, 15, f16(x.d.to_bits())) }
});

grid_type!(IQ1S, BlockIQ1S, vnni: true, vbmi: iq1s, |x| {
    let mut u = [0u64; 32];
    let mut sc = [0i16; 16];
    for ib in 0..8 {
        let qh = x.qh[ib];
        let ls = 2 * ((qh >> 12) & 7) as i16 + 1;
        sc[2 * ib] = ls;
        sc[2 * ib + 1] = ls;
        for l in 0..4 {
            let grid = IQ1S_GRID[x.qs[4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8)];
            u[4 * ib + l] = iq1_level(grid, qh & 0x8000 != 0);
        }
    }
    Unpacked { w: levels(&u), f: factors(&sc, 9, 0.125 * f16(x.d.to_bits())) }
});

grid_type!(IQ1M, BlockIQ1M, vnni: true, vbmi: iq1m, |x| {
    let mut u = [0u64; 32];
    for (k, v) in u.iter_mut().enumerate() {
        let (ib, l) = (k / 4, k % 4);
        let qh = x.qh[2 * ib + l / 2];
        let idx = x.qs[k] as usize | (((qh as usize) << (8 - 4 * (l % 2))) & 0x700);
        *v = iq1_level(IQ1S_GRID[idx], qh & (0x08 << (4 * (l % 2))) != 0);
    }
    let mut words = [0u16; 4];
    for (k, v) in words.iter_mut().enumerate() {
        *v = u16::from_le_bytes([x.scales[2 * k], x.scales[2 * k + 1]]);
    }
    // Group of 16 g: group of 32 g / 2, its first or second half.
    let mut sc = [0i16; 16];
    for (g, v) in sc.iter_mut().enumerate() {
        let ib = g / 2;
        *v = 2 * ((words[ib / 2] >> (6 * (ib % 2) + 3 * (g % 2))) & 0x7) as i16 + 1;
    }
    Unpacked { w: levels(&u), f: factors(&sc, 9, 0.125 * tandem_quant::iq1m_scale(&x.scales)) }
});
