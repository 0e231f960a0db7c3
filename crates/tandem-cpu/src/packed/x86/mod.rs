//! The x86-64 group kernels of the packed layouts (AVX-512 VNNI, AVX2 and AVX-VNNI), one file per family as
//! in `super` (`q2k.rs`, `q3k.rs`, `q4k.rs`, `q6k.rs`, `iq4xs.rs`, `q40.rs`, `b32.rs`), and the
//! helpers they share. Each type's layout, its scalar reference and the arithmetic every kernel
//! must reproduce bit for bit are in the family's file of `super`; [`simd_kernels`] is the table
//! `super` dispatches from. Another architecture adds a sibling of this module.

/// Defines `$entry`, a [`GroupFn`] that runs `$name::<.., PF, NY>` with `ny` and the prefetch hint
/// (the processor's, or `$hint`: an index of [`crate::prefetch`]'s hints) as constants, and that
/// kernel, built with `$feat`, with `$body` on the call `$c`. The entry's docs (with `# Safety`)
/// are the invocation's.
macro_rules! group_entry {
    (
        $(#[$doc:meta])* $entry:ident => $name:ident<$(const $g:ident: $gt:ty),*>($feat:literal $(, hint = $hint:expr)?)
        |$c:ident| $body:block
    ) => {
        $(#[$doc])*
        pub(super) unsafe fn $entry<$(const $g: $gt),*>(c: crate::packed::GroupCall) {
            // SAFETY: forwarded from the caller, who checked that the machine runs the kernel.
            unsafe { by_ny_pf!(hint = group_entry!(@hint $($hint)?), c.ny, $name[$($g),*](c)) }
        }

        /// # Safety
        #[doc = concat!("As [`", stringify!($entry), "`] with `ny == NY`.")]
        #[target_feature(enable = $feat)]
        #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
        unsafe fn $name<$(const $g: $gt,)* const PF: u8, const NY: usize>($c: crate::packed::GroupCall) $body
    };
    (@hint) => { crate::prefetch::hint_index() };
    (@hint $hint:expr) => { $hint };
}

/// The two ymm copies of a `$group` kernel (`q8k_group!`, `q8_group!`) from one body: the AVX2
/// one as written (`$entry => $name`), and after `vnni` its AVX-VNNI twin (`$ventry => $vname`),
/// built with `avxvnni` as well. The body sees the constant `VNNI` (true in the twin), where
/// `vpdpbusd` on ymm (VEX) adds the products of four bytes into i32 lanes exactly, in place of
/// the `vpmaddubsw` chains AVX2 keeps within i16.
macro_rules! ymm_pair {
    (
        $group:ident, $regs:tt
        $(#[$attr:meta])*
        $entry:ident => $name:ident, vnni $ventry:ident => $vname:ident
        <$(const $c:ident: $ct:ty),*>("avx2,fma,f16c", $block:expr) $($rest:tt)*
    ) => {
        $group!(@def false $regs $(#[$attr])* $entry => $name<$(const $c: $ct),*>("avx2,fma,f16c", $block) $($rest)*);
        $group!(
            @def true $regs
            #[doc = concat!("[`", stringify!($entry), "`] with AVX-VNNI: `vpdpbusd` on ymm registers where AVX2 chains")]
            #[doc = "`vpmaddubsw`; the same exact integer sums, so the same bits."]
            #[doc = ""]
            #[doc = "# Safety"]
            #[doc = concat!("As [`", stringify!($entry), "`], and the machine has AVX-VNNI.")]
            $ventry => $vname<$(const $c: $ct),*>("avx2,fma,f16c,avxvnni", $block) $($rest)*
        );
    };
}

/// `$v` shifted so that bit `$p` of every byte lands on bit `$to` of that byte (other bits are
/// garbage for the caller to mask off), by `$sll` / `$srl`: the 16-bit lane shifts of its width.
macro_rules! to_bit {
    ($v:expr, $p:expr, $to:literal, $sll:ident, $srl:ident) => {
        match ($p) as i32 - $to {
            -7 => $sll::<7>($v),
            -6 => $sll::<6>($v),
            -5 => $sll::<5>($v),
            -4 => $sll::<4>($v),
            -3 => $sll::<3>($v),
            -2 => $sll::<2>($v),
            -1 => $sll::<1>($v),
            0 => $v,
            1 => $srl::<1>($v),
            2 => $srl::<2>($v),
            3 => $srl::<3>($v),
            4 => $srl::<4>($v),
            5 => $srl::<5>($v),
            6 => $srl::<6>($v),
            _ => $srl::<7>($v),
        }
    };
}

/// Defines `$entry`, a [`GroupFn`] with the docs given, and `$name::<.., PF, NY>`, the kernel it
/// runs (see [`group_entry!`]): against Q8_K activations on registers of `$width`
/// (`zmm`: the 16 rows in one register; `ymm`: two halves of 8, one after the other), in the
/// outline every k-quant layout shares. Per block (`$block` bytes at `$wb`; `$y`, each token's
/// activation block): `block`, then per half `$hf` 8 steps `$i` of `step`, each adding an eighth of
/// the block to the exact integer sums `$isum[t]` and `$imin[t]` of every token (for one token
/// prefetching the weights a part per step, see [`prefetch_part`]); `after`, `finish`, and per
/// token `$t` `acc = value * yd + acc` (fused), `value` the block's value before the activation
/// factor `yd`. The names between the bars are the caller's, bound here.
macro_rules! q8k_group {
    (zmm $($rest:tt)*) => {
        q8k_group!(@def false [1, 16, _mm512_setzero_ps, _mm512_setzero_si512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps] $($rest)*);
    };
    (ymm $($rest:tt)*) => {
        ymm_pair!(q8k_group, [2, 8, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps] $($rest)*);
    };
    // One pass over the rows (`$hf` 0) or a loop over the two halves.
    (@halves 1, $hf:ident, $body:block) => {{
        let $hf = 0usize;
        $body
    }};
    (@halves 2, $hf:ident, $body:block) => {
        for $hf in 0..2 $body
    };
    (
        @def $vnni:literal [$halves:tt, $lanes:literal, $zps:ident, $zsi:ident, $set1:ident, $fmadd:ident, $storeu:ident]
        $(#[$attr:meta])*
        $entry:ident => $name:ident<$(const $c:ident: $ct:ty),*>($feat:literal, $block:expr)
        |$wb:ident, $y:ident, $hf:ident, $i:ident, $isum:ident, $imin:ident, $t:ident|
        setup { $($setup:tt)* }
        block { $($pre:tt)* }
        step { $($step:tt)* }
        after { $($post:tt)* }
        finish { $($finish:tt)* }
        value $value:expr
    ) => {
        group_entry! { $(#[$attr])* $entry => $name<$(const $c: $ct),*>($feat) |call| {
            let crate::packed::GroupCall { nb, w, a, out, ostride, .. } = call;
            let (ys, yb) = (a.ys, a.yb);
            /// Whether this copy has AVX-VNNI (ymm copies only; see [`ymm_pair!`]).
            #[allow(dead_code)]
            const VNNI: bool = $vnni;
            $($setup)*
            let mut acc = [[$zps(); $halves]; NY];
            for b in 0..nb {
                // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
                unsafe {
                    let $wb = w.add(b * $block);
                    let $y: [*const u8; NY] = crate::packed::x86::token_blocks(ys, yb, b, crate::packed::Q8K_BYTES);
                    $($pre)*
                    q8k_group!(@halves $halves, $hf, {
                        let mut $isum = [$zsi(); NY];
                        let mut $imin = [$zsi(); NY];
                        for $i in 0..8 {
                            if NY == 1 {
                                crate::packed::x86::prefetch_part::<PF>($wb, $block, $hf * 8 + $i, $halves * 8);
                            }
                            $($step)*
                        }
                        $($post)*
                        $($finish)*
                        for $t in 0..NY {
                            let yd = $set1(($y[$t] as *const f32).read_unaligned());
                            acc[$t][$hf] = $fmadd($value, yd, acc[$t][$hf]);
                        }
                    });
                }
            }
            q8k_group!(@store $storeu, $lanes, acc, out, ostride);
        }}
    };
    // Each token's 16 results (in one register, or two halves) into `out`, `ostride` floats apart.
    (@store $storeu:ident, $lanes:literal, $acc:ident, $out:ident, $ostride:ident) => {
        for (t, a) in $acc.iter().enumerate() {
            for (h, v) in a.iter().enumerate() {
                // SAFETY: 16 writable floats per token row (see `GroupFn`).
                unsafe { $storeu($out.add(t * $ostride + $lanes * h), *v) };
            }
        }
    };
}

/// Defines `$entry`, a [`GroupFn`] with the docs given (and the prefetch hint `$hint` if given),
/// and `$name::<.., PF, NY>`, the kernel it runs (see [`group_entry!`]): against Q8_0 or Q8_1
/// activations (`$sizes`: the block bytes of [`super::q40::sizes`] / [`super::b32::sizes`]) on
/// registers of `$width` as in [`q8k_group!`], in the outline the layouts of 32-element blocks
/// (Q4_0, IQ4_NL, Q4_1, Q8_0, Q5_0, Q5_1) share. Per block (`$block` weight bytes at `$wb`, for one
/// token prefetched ahead, see [`prefetch_ahead`]) and per half `$hf`: `load` the weights, then per
/// token (`$y`, its activation block, quants at `$qs`) `dot` gives the exact integer sum `sum_e
/// l_e * a_e`; without `$min` less `$off` times the token's block sum, it is `isum`, and
/// `acc = (dw * da) * isum + acc`; with `$min` also `acc = mw * s + acc` (fused), `mw` the
/// minimums after the factors, `s` Q8_1's. The names between the bars are the caller's.
macro_rules! q8_group {
    (zmm $($rest:tt)*) => {
        q8_group!(@def false [1, 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_cvtepi32_ps,
            _mm512_sub_epi32, _mm512_set1_epi32, _mm512_storeu_ps, _mm512_cvtph_ps, _mm256_loadu_si256, __m256i] $($rest)*);
    };
    (ymm $($rest:tt)*) => {
        ymm_pair!(q8_group, [2, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_cvtepi32_ps,
            _mm256_sub_epi32, _mm256_set1_epi32, _mm256_storeu_ps, _mm256_cvtph_ps, _mm_loadu_si128, __m128i] $($rest)*);
    };
    (
        @def $vnni:literal [$halves:tt, $lanes:literal, $zps:ident, $set1:ident, $fmadd:ident, $mul:ident, $cvt:ident,
            $subi:ident, $set1i:ident, $storeu:ident, $cvtph:ident, $phload:ident, $phty:ident]
        $(#[$attr:meta])*
        $entry:ident => $name:ident<$(const $c:ident: $ct:ty),*>($feat:literal, $block:expr $(, hint $hint:expr)?)
        |$wb:ident, $hf:ident, $y:ident, $qs:ident|
        setup { $($setup:tt)* }
        sizes $sizes:expr, off $off:expr, min $min:expr,
        load { $($load:tt)* }
        dot { $($dot:tt)* }
    ) => {
        group_entry! { $(#[$attr])* $entry => $name<$(const $c: $ct),*>($feat $(, hint = $hint)?) |call| {
            let crate::packed::GroupCall { nb, w, a, out, ostride, .. } = call;
            use crate::packed::PACK_ROWS;
            /// Whether this copy has AVX-VNNI (ymm copies only; see [`ymm_pair!`]).
            #[allow(dead_code)]
            const VNNI: bool = $vnni;
            $($setup)*
            let (_, ab, $qs) = const { $sizes };
            let mut acc = [[$zps(); $halves]; NY];
            // SAFETY: the factors follow the weights of all `nb` blocks, the minimums (Q4_1,
            // Q5_1) the factors (see the layouts).
            let factors = unsafe { w.add(nb * $block) };
            let mins = factors.wrapping_add(nb * 2 * PACK_ROWS);
            for b in 0..nb {
                // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
                unsafe {
                    let $wb = w.add(b * $block);
                    if NY == 1 {
                        crate::packed::x86::prefetch_ahead::<PF>($wb, $block);
                    }
                    q8k_group!(@halves $halves, $hf, {
                        $($load)*
                        let fp = b * 2 * PACK_ROWS + 2 * $lanes * $hf;
                        let d = $cvtph($phload(factors.add(fp) as *const $phty));
                        let m = if $min { $cvtph($phload(mins.add(fp) as *const $phty)) } else { d };
                        for t in 0..NY {
                            let $y = a.ys.add(t * a.yb + b * ab);
                            let sum = { $($dot)* };
                            let isum = if $min { sum } else { $subi(sum, $set1i($off * *a.sums.add(t * nb + b))) };
                            let da = crate::packed::x86::half($y);
                            acc[t][$hf] = $fmadd($mul(d, $set1(da)), $cvt(isum), acc[t][$hf]);
                            if $min {
                                let s = crate::packed::x86::half($y.add(crate::packed::b32::Q8_1_S));
                                acc[t][$hf] = $fmadd(m, $set1(s), acc[t][$hf]);
                            }
                        }
                    });
                }
            }
            q8k_group!(@store $storeu, $lanes, acc, out, ostride);
        }}
    };
}

mod b32;
mod iq4xs;
mod q2k;
mod q3k;
mod q40;
mod q4k;
mod q6k;

#[cfg(test)]
pub(super) use q6k::simd_variants as q6k_variants;

use super::GroupFn;
use crate::Isa;
use std::arch::x86_64::*;
use tandem_quant::GgmlType;

/// The fp16 at `p` as f32.
///
/// # Safety
/// `p` points at 2 readable bytes; the machine has F16C.
#[inline(always)]
pub(super) unsafe fn half(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes and F16C.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32))) }
}

/// Block `b` (`bytes` long) of each of the `NY` token rows `yb` bytes apart from `ys`.
///
/// # Safety
/// The blocks are in bounds (see [`super::GroupFn`]).
#[inline(always)]
pub(super) unsafe fn token_blocks<const NY: usize>(
    ys: *const u8,
    yb: usize,
    b: usize,
    bytes: usize,
) -> [*const u8; NY] {
    // SAFETY: the caller guarantees the blocks are in bounds.
    std::array::from_fn(|t| unsafe { ys.add(t * yb + b * bytes) })
}

/// Four bytes at `p` in every 32-bit lane.
///
/// # Safety
/// `p` points at 4 readable bytes.
#[inline(always)]
pub(super) unsafe fn bcast(p: *const u8) -> __m512i {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        // SAFETY: the caller guarantees 4 readable bytes.
        _mm512_set1_epi32((p as *const i32).read_unaligned())
    }
}

/// Prefetch hints for the `len` bytes 4 KiB past `p`, all at once: for the blocks of a few
/// cache lines (Q8_0, Q5_0, Q4_0) that a kernel passes through in a few dozen instructions. A
/// single token streams the weights once, and the hardware prefetchers stop at page
/// boundaries. The hint `PF` is the processor's ([`crate::Prefetch`]: non-temporal on AMD,
/// where it gave 10-20% faster 2-thread decode than `t0`; `t1` on Intel, where non-temporal
/// halved it), passed by [`by_ny_pf!`].
#[inline(always)]
pub(super) fn prefetch_ahead<const PF: u8>(p: *const u8, len: usize) {
    crate::prefetch::prefetch_stream_as::<PF>(p.wrapping_add(4096), len);
}

/// How far ahead [`prefetch_part`] asks for weight bytes.
const PART_AHEAD: usize = 8192;

/// Part `j` of `parts` of the prefetch hints (the processor's, as [`prefetch_ahead`]) for the
/// `len` bytes [`PART_AHEAD`] past `p`: for the k-quant blocks of 2-3 KiB, spread over the
/// kernel's passes through the block. Asked for all at once at the start of the block, the
/// 37-53 lines of a block stalled the kernel: a 2-thread product of a large Q4_K matrix ran at
/// 64-67 GB/s against 78-83 spread (Q6_K: 43 against 82), 8 KiB ahead a little better than
/// 4 or 6 (docs/perf/HISTORY.md).
///
/// Every part has the same number of lines, so the last reaches up to `parts - 1` lines past
/// the block (the next block asks for them again; a prefetch never faults). Clipping the last
/// part to the block cost more than the extra hints: over a matrix in L2 the packed Q4_K
/// kernel ran at 24.7 against 33.2 GB/s, and decode was 3-5% slower, token by token.
#[inline(always)]
pub(super) fn prefetch_part<const PF: u8>(p: *const u8, len: usize, j: usize, parts: usize) {
    let lines = len.div_ceil(64);
    let per = lines.div_ceil(parts);
    crate::prefetch::prefetch_stream_as::<PF>(p.wrapping_add(PART_AHEAD + 64 * j * per), 64 * per);
}

/// Four bytes at `p` in every 32-bit lane of a ymm register.
///
/// # Safety
/// `p` points at 4 readable bytes.
#[inline(always)]
pub(super) unsafe fn bcast8(p: *const u8) -> __m256i {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        // SAFETY: the caller guarantees 4 readable bytes.
        _mm256_set1_epi32((p as *const i32).read_unaligned())
    }
}

/// The eight 4-byte words of the 32 bytes at `p`, word `k` in every 32-bit lane of register `k`
/// (as [`bcast8`] of `p + 4 k`): words 0..4 by `vpshufd` from one 128-bit broadcast, words 4..8
/// by broadcast loads. On AMD Zen 3 a core ran 1.33 ymm loads (broadcasts included) a cycle
/// against 2 shuffles, so eight broadcast loads bounded the packed Q4_K kernel's token loop;
/// the split balances the two (8 tokens: 98 -> 106 G MAC/s, 1 thread). The other AVX2
/// kernels keep [`bcast8`]: Q5_K, Q6_K, Q4_0, Q8_0 and IQ4_NL ran at the same speed with it,
/// Q4_1 22% slower.
///
/// # Safety
/// `p` points at 32 readable bytes; the machine has AVX2.
#[inline(always)]
pub(super) unsafe fn words8(p: *const u8) -> [__m256i; 8] {
    // SAFETY: the caller guarantees 32 readable bytes and AVX2.
    unsafe {
        let w = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
        [
            _mm256_shuffle_epi32::<0x00>(w),
            _mm256_shuffle_epi32::<0x55>(w),
            _mm256_shuffle_epi32::<0xAA>(w),
            _mm256_shuffle_epi32::<0xFF>(w),
            bcast8(p.add(16)),
            bcast8(p.add(20)),
            bcast8(p.add(24)),
            bcast8(p.add(28)),
        ]
    }
}

/// The low and the high nibble of every byte of `v` (`u = lo + 16 * hi`).
#[inline(always)]
pub(super) unsafe fn nibbles8(v: __m256i) -> [__m256i; 2] {
    // SAFETY: only called from functions enabling AVX2.
    unsafe {
        let nib = _mm256_set1_epi8(0x0F);
        [_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib)]
    }
}

/// The exact `sum_e u_e * a_e` of each 32-bit lane (4 elements of one row per vector) over
/// eight vectors of unsigned bytes `u = lo + 16 * hi` (0..=255, given as the nibble vectors
/// `lo` and `hi`), vector `i` against the four activation bytes at `q + 4 i`, each lane's sum
/// times the i16 pair of its lane in `f` (ones, or a scale twice). Where AVX2 has no
/// `vpdpbusd`: `vpmaddubsw` of nibbles (<= 15) against any bytes gives i16 pair sums within
/// +-3840, so the eight of each nibble add up exactly in i16 (within +-30720) before a
/// `vpmaddwd` by `f` (the low ones) and by `16 f` (the high ones) widens them. Whole bytes
/// would not do: 255 * -128 twice overflows the pair sum (and the sign trick fails on -128).
///
/// # Safety
/// `q` points at 32 readable bytes; `16 f` fits in i16; the machine has AVX2.
#[inline(always)]
pub(super) unsafe fn nibble_dot8(lo: &[__m256i; 8], hi: &[__m256i; 8], q: *const u8, f: __m256i) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes and AVX2.
    unsafe {
        let [mut l0, mut l1, mut h0, mut h1] = [_mm256_setzero_si256(); 4];
        for i in 0..4 {
            let (a0, a1) = (bcast8(q.add(4 * i)), bcast8(q.add(16 + 4 * i)));
            l0 = _mm256_add_epi16(l0, _mm256_maddubs_epi16(lo[i], a0));
            h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(hi[i], a0));
            l1 = _mm256_add_epi16(l1, _mm256_maddubs_epi16(lo[i + 4], a1));
            h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(hi[i + 4], a1));
        }
        _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_add_epi16(l0, l1), f),
            _mm256_madd_epi16(_mm256_add_epi16(h0, h1), _mm256_slli_epi16::<4>(f)),
        )
    }
}

/// `acc` plus, in each 32-bit lane, the exact sum of the products of its four unsigned bytes in `u`
/// with the four (signed) activation bytes at `q`: AVX-VNNI's `vpdpbusd` on ymm.
///
/// # Safety
/// `q` points at 4 readable bytes; the machine has AVX-VNNI (the caller is built with `avxvnni`).
#[inline(always)]
pub(super) unsafe fn dpbusd8(acc: __m256i, u: __m256i, q: *const u8) -> __m256i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_dpbusd_avx_epi32(acc, u, bcast8(q)) }
}

/// The exact `sum_e u_e * a_e` of each 32-bit lane over eight vectors of unsigned bytes `u`
/// (0..=255) laid out as [`nibble_dot8`] takes their nibbles (vector `i < 4` against the four
/// activation bytes at `q + 4 i`, vector `i + 4` against those at `q + 16 + 4 i`), in i32 by
/// `vpdpbusd`: whole bytes, no split.
///
/// # Safety
/// `q` points at 32 readable bytes; the machine has AVX-VNNI.
#[inline(always)]
pub(super) unsafe fn byte_dot8(u: &[__m256i; 8], q: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes and AVX-VNNI.
    unsafe {
        let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for i in 0..4 {
            s0 = dpbusd8(s0, u[i], q.add(4 * i));
            s1 = dpbusd8(s1, u[i + 4], q.add(16 + 4 * i));
        }
        _mm256_add_epi32(s0, s1)
    }
}

/// IQ4_NL's levels plus 128 ([`super::q40::NL_LEVELS`]) of the 4-bit codes in `codes` (one a
/// byte), whole, by one byte shuffle: as [`byte_dot8`] takes them.
#[inline(always)]
pub(super) unsafe fn nl_levels8(codes: __m256i) -> __m256i {
    // SAFETY: only called from functions enabling AVX2; the table is 16 readable bytes.
    unsafe {
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(super::q40::NL_LEVELS.as_ptr() as *const __m128i));
        _mm256_shuffle_epi8(table, codes)
    }
}

/// `sc * sum_e u_e * a_e` in each 32-bit lane over one group of 16 levels held as four vectors
/// `u` (vector `p`: elements `4p..4p + 4` of each row, unsigned bytes), against the 16 activation
/// bytes at `q`; exact while the sums fit i32.
///
/// # Safety
/// `q` points at 16 readable bytes; the machine has AVX-512 VNNI.
#[inline(always)]
pub(super) unsafe fn planes_dot(u: &[__m512i; 4], q: *const u8, sc: __m512i) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes and AVX-512 VNNI.
    unsafe {
        let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        s0 = _mm512_dpbusd_epi32(s0, u[0], bcast(q));
        s1 = _mm512_dpbusd_epi32(s1, u[1], bcast(q.add(4)));
        s0 = _mm512_dpbusd_epi32(s0, u[2], bcast(q.add(8)));
        s1 = _mm512_dpbusd_epi32(s1, u[3], bcast(q.add(12)));
        _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc)
    }
}

/// [`planes_dot`] on a ymm register, the scale as the i16 pair `(sc, sc)` of each lane: `vpmaddubsw`
/// of the four vectors (levels <= 7, so their i16 pair sums add up far below 2^15), one `vpmaddwd`;
/// with `VNNI`, `vpdpbusd`.
///
/// # Safety
/// `q` points at 16 readable bytes; the machine has AVX2, and with `VNNI` AVX-VNNI.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // k picks the vector and its activation bytes
pub(super) unsafe fn planes_dot8<const VNNI: bool>(u: &[__m256i; 4], q: *const u8, scsc: __m256i) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes and AVX2 (with `VNNI`, AVX-VNNI).
    unsafe {
        if VNNI {
            // The same sums in i32 (|.| <= 16 * 7 * 128: an i16 as its low half), times the pair
            // (sc, 0): `vpmaddwd` gives sc * s exactly.
            let mut s = _mm256_setzero_si256();
            for k in 0..4 {
                s = dpbusd8(s, u[k], q.add(4 * k));
            }
            return _mm256_madd_epi16(s, _mm256_and_si256(scsc, _mm256_set1_epi32(0xFFFF)));
        }
        let mut s = _mm256_maddubs_epi16(u[0], bcast8(q));
        for k in 1..4 {
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[k], bcast8(q.add(4 * k))));
        }
        _mm256_madd_epi16(s, scsc)
    }
}

/// IQ4_NL's levels plus 128 ([`super::q40::NL_LEVELS`]) of the 4-bit codes in `codes` (one a
/// byte), split into nibbles as [`nibble_dot8`] takes them: a byte shuffle of each nibble's
/// table.
#[inline(always)]
pub(super) unsafe fn nl_nibbles8(codes: __m256i) -> [__m256i; 2] {
    // SAFETY: only called from functions enabling AVX2; the tables are 16 readable bytes.
    unsafe {
        let table = |t: &[u8; 16]| _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr() as *const __m128i));
        [
            _mm256_shuffle_epi8(table(&super::q40::NL_LEVELS_LO), codes),
            _mm256_shuffle_epi8(table(&super::q40::NL_LEVELS_HI), codes),
        ]
    }
}

/// The SIMD group kernels of `ty` in this build, best first, each with its level: AVX-512 VNNI
/// (for Q6_K the copy this machine runs, see `q6k::simd`), AVX-VNNI, AVX2.
pub(super) fn simd_kernels(ty: GgmlType) -> [Option<(Isa, GroupFn)>; 3] {
    let (vnni, avx_vnni, avx2): (GroupFn, GroupFn, GroupFn) = match ty {
        GgmlType::Q2_K => (q2k::group_vnni, q2k::group_avxvnni, q2k::group_avx2),
        GgmlType::Q3_K => (q3k::group_vnni, q3k::group_avxvnni, q3k::group_avx2),
        GgmlType::Q4_K => {
            // No AVX-VNNI copy: `vpdpbusd` in place of the `vpmaddubsw` chains measured 3-5% slower
            // than the AVX2 kernel (packed_speedup, 2048 x 2048 x 256 tokens, Xeon with AVX-VNNI).
            return [
                Some((Isa::Avx512Vnni, q4k::group_vnni::<false>)),
                None,
                Some((Isa::Avx2, q4k::group_avx2::<false>)),
            ];
        }
        GgmlType::Q5_K => (q4k::group_vnni::<true>, q4k::group_avxvnni::<true>, q4k::group_avx2::<true>),
        GgmlType::Q6_K => (q6k::simd(), q6k::group_avxvnni, q6k::group_avx2),
        GgmlType::IQ4_XS => (iq4xs::group_vnni, iq4xs::group_avxvnni, iq4xs::group_avx2),
        GgmlType::Q4_0 => {
            (q40::group_vnni::<false, false>, q40::group_avxvnni::<false, false>, q40::group_avx2::<false, false>)
        }
        GgmlType::IQ4_NL => {
            (q40::group_vnni::<true, false>, q40::group_avxvnni::<true, false>, q40::group_avx2::<true, false>)
        }
        GgmlType::Q4_1 => {
            (q40::group_vnni::<false, true>, q40::group_avxvnni::<false, true>, q40::group_avx2::<false, true>)
        }
        GgmlType::Q5_0 => (b32::group_vnni::<16>, b32::group_avxvnni::<16>, b32::group_avx2::<16>),
        GgmlType::Q5_1 => {
            const OFF: i32 = super::b32::Q5_1_OFF;
            (b32::group_vnni::<OFF>, b32::group_avxvnni::<OFF>, b32::group_avx2::<OFF>)
        }
        GgmlType::Q8_0 => (b32::group_vnni::<128>, b32::group_avxvnni::<128>, b32::group_avx2::<128>),
        _ => return [None; 3],
    };
    [Some((Isa::Avx512Vnni, vnni)), Some((Isa::AvxVnni, avx_vnni)), Some((Isa::Avx2, avx2))]
}
