//! Block-quant kernels on 256-bit vectors: Q4_0, Q5_0, Q8_0, IQ4_NL (Q8_0 activations), Q4_1, Q5_1
//! (Q8_1 activations) and IQ4_XS (Q8_K activations), after ggml-cpu/arch/x86/quants.c.
//!
//! Signed weights use ggml's sign trick: `|x|` (unsigned) times `y * sign(x)` (signed) feeds
//! `maddubs`, exact because activations lie in [-127, 127]. These are the AVX2 kernels; `zmm`
//! builds the AVX-512 ones from the same block unpackers.

// Block and row indices address several arrays at once (weights, rows, scales, accumulators).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use tandem_quant::blocks::KVALUES_IQ4NL;

pub(super) const Q8_0_BYTES: usize = 34;
pub(super) const Q8_1_BYTES: usize = 36;
pub(super) const Q8_K_BYTES: usize = 292;
pub(super) const IQ4_XS_BYTES: usize = 136;
pub(super) const QK: usize = 32;
pub(super) const QK_K: usize = 256;

/// The f16 at `p` (unaligned) in all 8 lanes as f32. (Converting a scalar with `vcvtph2ps`
/// lets LLVM insert it into a live register, a false dependency that serializes the loop.)
#[inline(always)]
pub(super) unsafe fn f16_splat(p: *const u8) -> __m256 {
    // SAFETY: the caller passes a readable pointer and runs with AVX2 + F16C.
    unsafe { _mm256_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned())) }
}

/// The f16 at `p` (unaligned) as f32.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: as `f16_splat`.
    unsafe { _mm256_cvtss_f32(f16_splat(p)) }
}

#[inline(always)]
pub(super) unsafe fn hsum_ps(v: __m256) -> f32 {
    // SAFETY: register-only AVX ops; the caller runs with AVX2.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

/// 16 bytes at `p` as the 32 nibbles of a Q4-style block: low nibbles in lanes 0..16, high in 16..32.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller passes 16 readable bytes and runs with AVX2.
    unsafe {
        let q = _mm_loadu_si128(p as *const __m128i);
        let b = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
        _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
    }
}

/// The 32 bits at `p` as 32 bytes, 0xFF where the bit is set (ggml `bytes_from_bits_32`).
#[inline(always)]
unsafe fn bytes_from_bits(p: *const u8) -> __m256i {
    // SAFETY: the caller passes 4 readable bytes and runs with AVX2.
    unsafe {
        let x32 = (p as *const u32).read_unaligned() as i32;
        let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf);
        let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
    }
}

/// `KVALUES_IQ4NL` in both 128-bit lanes, for `shuffle_epi8` lookups.
#[inline(always)]
pub(super) unsafe fn iq4nl_table() -> __m256i {
    // SAFETY: reads the 16-byte constant; the caller runs with AVX2.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i)) }
}

/// The 8 sub-block scales `ls - 32` of the IQ4_XS block at `xb` as i16 (6 bits each: the low 4 in
/// `scales_l`, the high 2 in `scales_h`), computed in registers.
#[inline(always)]
pub(super) unsafe fn iq4_xs_scales(xb: *const u8) -> __m128i {
    // SAFETY: the caller passes a whole block and runs with AVX2.
    unsafe {
        let sl = _mm_cvtsi32_si128((xb.add(4) as *const i32).read_unaligned());
        let m4 = _mm_set1_epi8(0x0F);
        // Sub-block 2k takes the low nibble of scales_l[k], 2k+1 the high one.
        let low =
            _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(sl, m4), _mm_and_si128(_mm_srli_epi16::<4>(sl), m4)));
        let sh = _mm256_set1_epi32((xb.add(2) as *const u16).read_unaligned() as i32);
        let h = _mm256_srlv_epi32(sh, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        let h = _mm256_slli_epi32::<4>(_mm256_and_si256(h, _mm256_set1_epi32(3)));
        let high = _mm_packs_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        _mm_sub_epi16(_mm_or_si128(low, high), _mm_set1_epi16(32))
    }
}

/// Sub-blocks `2k` and `2k + 1` of the IQ4_XS block at `xb` as their signed levels (`table`:
/// [`iq4nl_table`]): the 16 bytes of each hold its low nibbles, then its high ones.
#[inline(always)]
pub(super) unsafe fn iq4_xs_pair(xb: *const u8, k: usize, table: __m256i) -> [__m256i; 2] {
    // SAFETY: the caller passes a whole block and runs with AVX2.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let q = _mm256_loadu_si256(xb.add(8 + 32 * k) as *const __m256i);
        let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, m4));
        let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4));
        [_mm256_permute2x128_si256::<0x20>(lo, hi), _mm256_permute2x128_si256::<0x31>(lo, hi)]
    }
}

/// Bytes selecting i16 lane `i` of a 128-bit lane in every i16 lane, for `shuffle_epi8`.
#[inline(always)]
pub(super) unsafe fn word_splat_idx(i: i32) -> __m256i {
    // SAFETY: register-only; the caller runs with AVX.
    unsafe { _mm256_set1_epi16((((2 * i + 1) << 8) | (2 * i)) as i16) }
}

/// A 256-bit integer register.
pub(super) type Ymm = __m256i;

/// The integer dot product of one level on vectors `V` ([`Ymm`] or `__m512i`).
pub(super) trait Dot<V> {
    /// Lane i: the sum of `a[4i..4i+4] * b[4i..4i+4]`, `a` unsigned and `b` signed bytes.
    unsafe fn dot(a: V, b: V) -> V;
    /// `acc` plus, in lane i, `s[2i] * (a*b over bytes 4i, 4i+1) + s[2i+1] * (bytes 4i+2, 4i+3)`.
    unsafe fn dot_scaled(acc: V, a: V, b: V, s: V) -> V;
}

/// [`Dot`] for `$level` on `$v` through `maddubs` then `madd`, the given width's intrinsics.
macro_rules! maddubs_dot {
    ($level:ident, $v:ty, $madd:ident, $maddubs:ident, $set1:ident, $add:ident) => {
        impl Dot<$v> for $level {
            #[inline(always)]
            unsafe fn dot(a: $v, b: $v) -> $v {
                // SAFETY: register-only; the caller runs with the level's ISA.
                unsafe { $madd($maddubs(a, b), $set1(1)) }
            }
            #[inline(always)]
            unsafe fn dot_scaled(acc: $v, a: $v, b: $v, s: $v) -> $v {
                // SAFETY: register-only; the caller runs with the level's ISA.
                unsafe { $add(acc, $madd($maddubs(a, b), s)) }
            }
        }
    };
}
pub(super) use maddubs_dot;

/// AVX2: `maddubs` then `madd`.
pub(super) struct Avx2;
maddubs_dot!(Avx2, __m256i, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_set1_epi16, _mm256_add_epi32);

/// A 32-element weight block that starts with its f16 scale `d`.
pub(super) trait Block32 {
    const BYTES: usize;
    /// Unsigned levels with a minimum, against Q8_1 activations (else signed, against Q8_0).
    const MIN: bool = false;
    /// The block's 32 weight levels as bytes: signed for Q8_0 activations, unsigned (0..32) for
    /// the Q8_1 ones.
    unsafe fn unpack(p: *const u8) -> __m256i;
}

pub(super) struct Q4_0;
impl Block32 for Q4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: a whole block is readable at `p`; AVX2.
        unsafe { _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)) }
    }
}

pub(super) struct Q5_0;
impl Block32 for Q5_0 {
    const BYTES: usize = 22;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: a whole block is readable at `p`; AVX2.
        unsafe {
            // (q | h << 4) - 16: keep q where the high bit is set, else q | 0xF0 (= q - 16).
            let hi = _mm256_andnot_si256(bytes_from_bits(p.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles(p.add(6)), hi)
        }
    }
}

pub(super) struct Q8_0;
impl Block32 for Q8_0 {
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: a whole block is readable at `p`; AVX.
        unsafe { _mm256_loadu_si256(p.add(2) as *const __m256i) }
    }
}

pub(super) struct IQ4NL;
impl Block32 for IQ4NL {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: a whole block is readable at `p`; AVX2.
        unsafe { _mm256_shuffle_epi8(iq4nl_table(), nibbles(p.add(2))) }
    }
}

pub(super) struct Q4_1;
impl Block32 for Q4_1 {
    const BYTES: usize = 20;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: a whole block is readable at `p`; AVX2.
        unsafe { nibbles(p.add(4)) }
    }
}

pub(super) struct Q5_1;
impl Block32 for Q5_1 {
    const BYTES: usize = 24;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: a whole block is readable at `p`; AVX2.
        unsafe {
            let hi = _mm256_and_si256(bytes_from_bits(p.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles(p.add(8)), hi)
        }
    }
}

/// Blocks per group: the f16 scales of a group are converted 8 at a time, and their products
/// kept in a stack array that the block loop broadcasts from (a converted scalar f16 would carry
/// a false dependency on whatever register LLVM inserts it into).
pub(super) const G: usize = 8;

/// The f16 scales at the start of 8 blocks `stride` bytes apart, as f32. (Eight inserts beat
/// `vpgatherdd` by 2x on Zen 4.)
#[inline(always)]
unsafe fn scales8(p: *const u8, stride: usize) -> __m256 {
    // SAFETY: the caller passes 8 readable blocks and runs with AVX2 + F16C.
    unsafe {
        let h = |i: usize| (p.add(i * stride) as *const i16).read_unaligned();
        _mm256_cvtph_ps(_mm_set_epi16(h(7), h(6), h(5), h(4), h(3), h(2), h(1), h(0)))
    }
}

/// `d[j][b]` = (scale of weight block `b`) * (scale at `at` of activation block `b` of row `j`),
/// for the `cnt` (1..=G) blocks from `b0`.
#[inline(always)]
pub(super) unsafe fn group_scales<const NY: usize>(
    d: &mut [[f32; G]; NY],
    (w, wstride): (*const u8, usize),
    (ys, ystride, yrow, at): (*const u8, usize, usize, usize),
    b0: usize,
    cnt: usize,
) {
    // SAFETY: the caller passes `cnt` readable blocks from `b0` in `w` and each activation row.
    unsafe {
        if cnt == G {
            let dx = scales8(w.add(b0 * wstride), wstride);
            for (j, dj) in d.iter_mut().enumerate() {
                let dy = scales8(ys.add(j * yrow + b0 * ystride + at), ystride);
                _mm256_storeu_ps(dj.as_mut_ptr(), _mm256_mul_ps(dx, dy));
            }
        } else {
            for b in 0..cnt {
                let dx = f16_at(w.add((b0 + b) * wstride));
                for (j, dj) in d.iter_mut().enumerate() {
                    dj[b] = dx * f16_at(ys.add(j * yrow + (b0 + b) * ystride + at));
                }
            }
        }
    }
}

/// 32-element weights against Q8_0 activations, per block `d_x d_y sum(x y)`; with `W::MIN`
/// unsigned ones with a min against Q8_1 activations, per block `d_x d_y sum(x y) + m_x s_y`
/// (`s_y` = `d_y sum(y)`, stored in the activation block).
#[inline(always)]
unsafe fn q8_act<W: Block32, D: Dot<Ymm>, const NY: usize>(n: usize, w: *const u8, ys: *const u8, out: &mut [f32]) {
    let (ab, qs) = if W::MIN { (Q8_1_BYTES, 4) } else { (Q8_0_BYTES, 2) };
    let nb = n / QK;
    let yrow = nb * ab;
    // SAFETY: `Kernel::run` checked `w` holds `nb` blocks and `ys` holds `NY` rows of `nb` blocks.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); NY];
        let mut mins = [_mm256_setzero_ps(); NY];
        let mut d = [[0f32; G]; NY];
        let mut m = [[0f32; G]; NY];
        for b0 in (0..nb).step_by(G) {
            let cnt = G.min(nb - b0);
            group_scales(&mut d, (w, W::BYTES), (ys, ab, yrow, 0), b0, cnt);
            if W::MIN {
                // m_x s_y, summed per group in one vector (lanes past `cnt` hold zeros).
                group_scales(&mut m, (w.add(2), W::BYTES), (ys, ab, yrow, 2), b0, cnt);
                for (mj, mn) in m.iter_mut().zip(mins.iter_mut()) {
                    mj[cnt..].fill(0.0);
                    *mn = _mm256_add_ps(*mn, _mm256_loadu_ps(mj.as_ptr()));
                }
            }
            for b in 0..cnt {
                let x = W::unpack(w.add((b0 + b) * W::BYTES));
                // Signed levels: |x| against y with x's signs (`maddubs` takes unsigned bytes first).
                let ax = if W::MIN { x } else { _mm256_sign_epi8(x, x) };
                for (j, a) in acc.iter_mut().enumerate() {
                    let y = _mm256_loadu_si256(ys.add(j * yrow + (b0 + b) * ab + qs) as *const __m256i);
                    let p = D::dot(ax, if W::MIN { y } else { _mm256_sign_epi8(y, x) });
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&d[j][b]), *a);
                }
            }
        }
        for j in 0..NY {
            out[j] = hsum_ps(if W::MIN { _mm256_add_ps(acc[j], mins[j]) } else { acc[j] });
        }
    }
}

/// IQ4_XS against Q8_K: per super-block of 256, `d_x d_y sum_k (ls_k - 32) sum(x y over sub-block k)`,
/// the integer part exact (|sum| < 2^31).
#[inline(always)]
unsafe fn iq4_xs<D: Dot<Ymm>, const NY: usize>(n: usize, w: *const u8, ys: *const u8, out: &mut [f32]) {
    let nb = n / QK_K;
    let yrow = nb * Q8_K_BYTES;
    // SAFETY: `Kernel::run` checked `w` holds `nb` blocks and `ys` holds `NY` rows of `nb` blocks.
    unsafe {
        let table = iq4nl_table();
        let mut acc = [_mm256_setzero_ps(); NY];
        for b in 0..nb {
            // Block: f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128].
            let xb = w.add(b * IQ4_XS_BYTES);
            let sc = _mm256_broadcastsi128_si256(iq4_xs_scales(xb));
            let mut isum = [_mm256_setzero_si256(); NY];
            for k in 0..4 {
                let s0 = _mm256_shuffle_epi8(sc, word_splat_idx(2 * k as i32));
                let s1 = _mm256_shuffle_epi8(sc, word_splat_idx(2 * k as i32 + 1));
                let [x0, x1] = iq4_xs_pair(xb, k, table);
                let (ax0, ax1) = (_mm256_sign_epi8(x0, x0), _mm256_sign_epi8(x1, x1));
                for (j, s) in isum.iter_mut().enumerate() {
                    let yq = ys.add(j * yrow + b * Q8_K_BYTES + 4 + 64 * k);
                    let y0 = _mm256_loadu_si256(yq as *const __m256i);
                    let y1 = _mm256_loadu_si256(yq.add(32) as *const __m256i);
                    *s = D::dot_scaled(*s, ax0, _mm256_sign_epi8(y0, x0), s0);
                    *s = D::dot_scaled(*s, ax1, _mm256_sign_epi8(y1, x1), s1);
                }
            }
            let dx = f16_splat(xb);
            for (j, a) in acc.iter_mut().enumerate() {
                let dy = _mm256_broadcast_ss(&*(ys.add(j * yrow + b * Q8_K_BYTES) as *const f32));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(dx, dy), *a);
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = hsum_ps(a);
        }
    }
}

block_entries!("avx2,fma,f16c" Avx2 => q8_0_avx2 q4_0_avx2 q5_0_avx2 iq4_nl_avx2 q4_1_avx2 q5_1_avx2 iq4_xs_avx2);
