//! f32 vector math shared by the attention ([`mod@crate::attention`]), the decompressed MLA prefill
//! ([`crate::mla`]), the f32 matrix product ([`crate::gemm`]) and the element-wise ops
//! ([`crate::ops`]): the [`Level`] of vector kernels the machine runs, the softmax's maximum and
//! exponentials ([`max_of`], [`exp_sub`]), and in [`x86`] ggml's vector exp (`ggml_v_expf`, on
//! 16 lanes with AVX-512 and with the same bits on 8 with AVX2) and SwiGLU.

use crate::kernels::Isa;

/// Which kernels run: AVX-512, AVX2 (with FMA and F16C) or the scalar code. Each level has its
/// own arithmetic (lane counts); within a level a head's result depends only on its query and the
/// cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Scalar,
    Avx2,
    Avx512,
}

impl Level {
    pub(crate) fn detected() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            let isa = Isa::detected();
            if isa >= Isa::Avx512 {
                return Level::Avx512;
            }
            if isa >= Isa::Avx2 {
                return Level::Avx2;
            }
        }
        Level::Scalar
    }
}

/// The largest of `r` (`f32::max`'s: NaN ignored), in sixteen lanes: the same value as a fold
/// in order (the lanes can differ from it only by the sign of a zero maximum, which no
/// `exp(s - max)` sees), without its chain of one dependent comparison per score.
pub(crate) fn max_of(r: &[f32], level: Level) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 {
        // SAFETY: AVX-512 is present.
        return unsafe { x86::max_of(r) };
    }
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        // SAFETY: AVX2 is present.
        return unsafe { x86::max_of_avx2(r) };
    }
    max_lanes(r)
}

#[inline(always)]
fn max_lanes(r: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let mut c = r.chunks_exact(16);
    for ch in &mut c {
        for (m, v) in m.iter_mut().zip(ch) {
            *m = m.max(*v);
        }
    }
    for (m, v) in m.iter_mut().zip(c.remainder()) {
        *m = m.max(*v);
    }
    m.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `r[i] = exp(r[i] - max)`, returning their sum.
pub(crate) fn exp_sub(r: &mut [f32], max: f32, level: Level) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 {
        // SAFETY: AVX-512 is present.
        return unsafe { x86::exp_sub(r, max) };
    }
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { x86::exp_sub_avx2(r, max) };
    }
    let mut sum = 0f64;
    for v in r.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uniform;

    /// Whether this machine runs AVX-512; if not, says that `what` is not checked here.
    #[cfg(target_arch = "x86_64")]
    fn avx512_here(what: &str) -> bool {
        let here = Isa::Avx512.supported();
        if !here {
            println!("AVX-512 not on this machine: {what} not checked");
        }
        here
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_swiglu_is_close_to_libm_and_independent_of_position() {
        if !avx512_here("vector SwiGLU") {
            return;
        }
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).chain([0.0, -90.0, 90.0, -0.0]).collect();
        let up: Vec<f32> = (0..x.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut got = x.clone();
        // SAFETY: AVX-512 checked above.
        unsafe { super::x86::swiglu(&mut got, &up) };
        for ((x, u), g) in x.iter().zip(&up).zip(&got) {
            let want = x / (1.0 + (-x).exp()) * u;
            assert!(
                (g - want).abs() <= 4.0 * f32::EPSILON * want.abs() + f32::MIN_POSITIVE,
                "silu({x}) * {u} = {g}, libm {want}"
            );
        }
        if Isa::Avx2.supported() {
            let mut got2 = x.clone();
            // SAFETY: AVX2 and FMA checked.
            unsafe { super::x86::swiglu_avx2(&mut got2, &up) };
            assert!(got2.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "AVX2 differs from AVX-512");
        }
        // The same element at another offset (in the masked tail or not) gets the same bits.
        for start in [1usize, 5, 17, 990] {
            let mut part = x[start..].to_vec();
            // SAFETY: as above.
            unsafe { super::x86::swiglu(&mut part, &up[start..]) };
            assert!(part.iter().zip(&got[start..]).all(|(a, b)| a.to_bits() == b.to_bits()), "offset {start}");
        }
    }

    /// The softmax's maximum in lanes, at every level the machine has, is the ordered fold's
    /// value, with NaNs among the scores and at every length of the tail.
    #[test]
    fn the_lane_maximum_is_the_ordered_fold() {
        let mut u = uniform(77);
        for len in (0..70).chain([255, 256, 257, 3072]) {
            for nans in [0, 1, 3] {
                let mut r: Vec<f32> = (0..len).map(|_| u() * 50.0).collect();
                for k in 0..nans.min(len) {
                    r[(k * 7919) % len] = f32::NAN;
                }
                let want = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for level in [Level::Scalar, Level::Avx2, Level::Avx512] {
                    if level > Level::detected() {
                        println!("SKIPPED the {level:?} maximum: this machine lacks it");
                        continue;
                    }
                    let got = max_of(&r, level);
                    assert_eq!(got.to_bits(), want.to_bits(), "len {len}, {nans} NaN, {level:?}: {got} != {want}");
                }
            }
        }
        // All NaN or none: minus infinity, as the fold gives.
        assert_eq!(max_of(&[f32::NAN; 20], Level::detected()), f32::NEG_INFINITY);
        assert_eq!(max_of(&[], Level::detected()), f32::NEG_INFINITY);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_matches_libm_to_a_few_ulp() {
        if !avx512_here("vector exp") {
            return;
        }
        let xs: Vec<f32> =
            (0..40_000).map(|i| -150.0 + i as f32 * 0.00397).chain([0.0, -0.0, -1e-30, -200.0, -90.0]).collect();
        let mut got = xs.clone();
        // SAFETY: AVX-512 checked above.
        let sum = unsafe { super::x86::exp_sub(&mut got, 0.0) };
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        for ((x, g), w) in xs.iter().zip(&got).zip(&want) {
            assert!((g - w).abs() <= 4.0 * f32::EPSILON * w.abs() + f32::MIN_POSITIVE, "exp({x}) = {g}, libm {w}");
        }
        let want_sum: f64 = want.iter().map(|&v| v as f64).sum();
        assert!((sum - want_sum).abs() <= 1e-5 * want_sum);
    }
}
