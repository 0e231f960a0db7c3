//! How the single-token kernels ask for the weights they stream next (one software prefetch per
//! 64 bytes, a few KiB ahead). The best hint depends on the processor:
//!
//! * AMD Zen 5: non-temporal (`nta`). The weights are read once per token and need not pass
//!   through L2; against `t0`, 10-20% faster 2-thread decode (docs/perf/HISTORY.md).
//! * Intel (a 2-vCPU Emerald Rapids): `t1`. Non-temporal prefetches there halve a streaming
//!   read (a plain read loop, 1 thread: 5 GB/s with `nta` 4-16 KiB ahead, 11 GB/s without any
//!   prefetch, 12-13 GB/s with `t0` or `t1`). Decode of the Q4_K_M bench model with `--repack`,
//!   2 threads, alternating: 30-32 t/s with `nta`, 23-31 with none, 40-46 with `t0`, 45-51 with
//!   `t1`; without `--repack` 15 t/s with `nta` against 27-28 with `t1`.
//!
//! * AMD CPU family 25 (Zen 4, Zen 3): `nta`, except for the packed Q8_0 kernel, which does the
//!   least work per byte of all and streams faster with `t1` on Zen 4: decode of the Q8_0 bench
//!   model, the hint switched token by token in one process, 10-14% faster with 2 threads and 12%
//!   with 1; the Q4_K_M model's kernels were 6-10% faster with 1 thread on `nta` and within 2%
//!   either way with 2. On Zen 3 (AVX2 only), Q4_K_M decode with 2 threads, 3 alternating
//!   rounds: 65-70 t/s with `nta`, 63-64 with `t0`, 60-65 with `t1`, 43-49 with none
//!   (docs/perf/HISTORY.md).
//!
//! `TANDEM_PREFETCH` (`nta`, `t0`, `t1`, `off`) overrides the choice for every kernel; it is read
//! once.

use std::sync::atomic::{AtomicU8, Ordering};

/// A prefetch hint for streamed weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefetch {
    /// Non-temporal: into the first-level cache, bypassing what it can of the others.
    Nta,
    /// Into every level.
    T0,
    /// Into the second level and beyond.
    T1,
    /// No software prefetch (the hardware prefetchers alone).
    Off,
}

impl Prefetch {
    const ALL: [Prefetch; 4] = [Prefetch::Nta, Prefetch::T0, Prefetch::T1, Prefetch::Off];

    /// The name `TANDEM_PREFETCH` takes.
    pub fn name(self) -> &'static str {
        match self {
            Prefetch::Nta => "nta",
            Prefetch::T0 => "t0",
            Prefetch::T1 => "t1",
            Prefetch::Off => "off",
        }
    }

    /// The hint named `s` (as [`Prefetch::name`] spells it, any case).
    pub fn parse(s: &str) -> Option<Prefetch> {
        Prefetch::ALL.into_iter().find(|p| p.name().eq_ignore_ascii_case(s.trim()))
    }

    /// The hint for this processor: `TANDEM_PREFETCH` when it names one, else `nta` on AMD and
    /// `t1` elsewhere. Read once; an unknown `TANDEM_PREFETCH` is reported on stderr and ignored.
    pub fn detected() -> Prefetch {
        Prefetch::ALL[(state() & 0xF) as usize]
    }

    /// The hint of the packed Q8_0 kernel, the single-token kernel with the least work per byte:
    /// `t1` on AMD family 25 (Zen 4) unless `TANDEM_PREFETCH` is set, else [`Prefetch::detected`].
    pub fn detected_light() -> Prefetch {
        Prefetch::ALL[(state() >> 4) as usize]
    }

    /// The default hints (most kernels, the packed Q8_0 kernel) for a processor of this vendor
    /// and CPU family.
    fn defaults(amd: bool, family: u32) -> (Prefetch, Prefetch) {
        match (amd, family) {
            (true, 25) => (Prefetch::Nta, Prefetch::T1),
            (true, _) => (Prefetch::Nta, Prefetch::Nta),
            (false, _) => (Prefetch::T1, Prefetch::T1),
        }
    }
}

impl std::fmt::Display for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// The discriminants of [`Prefetch`], for kernels compiled once per hint ([`prefetch_stream_as`]).
#[cfg(target_arch = "x86_64")]
pub(crate) const PF_NTA: u8 = Prefetch::Nta as u8;
#[cfg(target_arch = "x86_64")]
pub(crate) const PF_T0: u8 = Prefetch::T0 as u8;
#[cfg(target_arch = "x86_64")]
pub(crate) const PF_T1: u8 = Prefetch::T1 as u8;
#[cfg(target_arch = "x86_64")]
pub(crate) const PF_OFF: u8 = Prefetch::Off as u8;

/// [`Prefetch::detected`] as its discriminant (one of the `PF_*`).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn hint_index() -> u8 {
    state() & 0xF
}

/// [`Prefetch::detected_light`] as its discriminant (one of the `PF_*`).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn light_hint_index() -> u8 {
    state() >> 4
}

/// Sets the hint every kernel uses (a `PF_*`) until the guard it returns is dropped, which puts
/// back the hints it replaced. For tests that run the kernels compiled for each hint: one such
/// test at a time (the guard holds a lock), as the hint is the whole process's.
#[cfg(test)]
pub(crate) fn set_hint(h: u8) -> HintGuard {
    let lock = hints_held();
    let old = state();
    MODE.store(h | (h << 4), Ordering::Relaxed);
    HintGuard { old, _lock: lock }
}

/// The lock of the tests that set or read the hints: held, no other test changes them.
#[cfg(test)]
pub(crate) fn hints_held() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// See [`set_hint`].
#[cfg(test)]
pub(crate) struct HintGuard {
    old: u8,
    _lock: std::sync::MutexGuard<'static, ()>,
}

#[cfg(test)]
impl Drop for HintGuard {
    fn drop(&mut self) {
        MODE.store(self.old, Ordering::Relaxed);
    }
}

/// The two hints, [`Prefetch::detected`] in the low four bits and [`Prefetch::detected_light`] in
/// the high four (one atomic, so no thread sees one without the other), or `UNSET` before the
/// first use.
static MODE: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = u8::MAX;

#[inline]
fn state() -> u8 {
    match MODE.load(Ordering::Relaxed) {
        UNSET => {
            let (p, l) = choose();
            let m = p as u8 | ((l as u8) << 4);
            MODE.store(m, Ordering::Relaxed);
            m
        }
        m => m,
    }
}

fn choose() -> (Prefetch, Prefetch) {
    if let Ok(s) = std::env::var("TANDEM_PREFETCH") {
        match Prefetch::parse(&s) {
            Some(p) => return (p, p),
            None => tracing::warn!("TANDEM_PREFETCH={s:?} is not one of nta, t0, t1, off; ignored"),
        }
    }
    Prefetch::defaults(vendor() == *b"AuthenticAMD", family())
}

/// The processor's CPU family (CPUID leaf 1: the base family, plus the extended family when the
/// base is 15), 0 where there is no CPUID.
fn family() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        let eax = std::arch::x86_64::__cpuid(1).eax;
        let base = (eax >> 8) & 0xF;
        if base == 0xF {
            base + ((eax >> 20) & 0xFF)
        } else {
            base
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// The processor's vendor string.
fn vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    [0u8; 12]
}

/// Prefetch hints ([`Prefetch::detected`]) for the `len` bytes from `p`, one per 64 bytes: what
/// every single-token kernel asks for the weights it will stream next.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_stream(p: *const u8, len: usize) {
    // The hint chosen once per call, not per line.
    match hint_index() {
        PF_NTA => prefetch_stream_as::<PF_NTA>(p, len),
        PF_T0 => prefetch_stream_as::<PF_T0>(p, len),
        PF_T1 => prefetch_stream_as::<PF_T1>(p, len),
        _ => {}
    }
}

/// [`prefetch_stream`] with the hint `PF` (one of the `PF_*`) fixed at compile time: for kernels
/// that look the processor's hint up once per call ([`by_ny_pf!`]) rather than at every block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_stream_as<const PF: u8>(p: *const u8, len: usize) {
    use std::arch::x86_64::{_MM_HINT_NTA, _MM_HINT_T0, _MM_HINT_T1};
    match PF {
        PF_NTA => lines::<_MM_HINT_NTA>(p, len),
        PF_T0 => lines::<_MM_HINT_T0>(p, len),
        PF_T1 => lines::<_MM_HINT_T1>(p, len),
        _ => {}
    }
}

/// One prefetch with hint `H` per 64 bytes of the `len` bytes from `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lines<const H: i32>(p: *const u8, len: usize) {
    for l in (0..len).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<H>(p.wrapping_add(l) as *const i8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_parse_by_name_and_one_is_chosen() {
        for p in Prefetch::ALL {
            assert_eq!(Prefetch::parse(p.name()), Some(p));
            assert_eq!(Prefetch::parse(&p.name().to_uppercase()), Some(p));
            assert_eq!(Prefetch::ALL[p as usize], p);
        }
        assert_eq!(Prefetch::parse("t2"), None);
        assert_eq!(Prefetch::parse(""), None);
        let held = hints_held();
        let (p, l) = (Prefetch::detected(), Prefetch::detected_light());
        assert_eq!((Prefetch::detected(), Prefetch::detected_light()), (p, l), "read once");
        drop(held);
        #[cfg(target_arch = "x86_64")]
        {
            // Every hint (and a null address: a prefetch never faults).
            let data = vec![1u8; 4096];
            for h in [0, 1, 2, 3] {
                let _hint = set_hint(h);
                assert_eq!((hint_index(), light_hint_index()), (h, h));
                prefetch_stream(data.as_ptr(), data.len());
                prefetch_stream(std::ptr::null(), 256);
            }
            let _held = hints_held();
            assert_eq!((Prefetch::detected(), Prefetch::detected_light()), (p, l));
        }
    }

    #[test]
    fn the_light_hint_differs_only_on_zen_4() {
        use Prefetch::*;
        assert_eq!(Prefetch::defaults(true, 25), (Nta, T1), "Zen 4 (and Zen 3)");
        assert_eq!(Prefetch::defaults(true, 26), (Nta, Nta), "Zen 5");
        assert_eq!(Prefetch::defaults(true, 23), (Nta, Nta), "Zen 2");
        assert_eq!(Prefetch::defaults(false, 6), (T1, T1), "Intel");
    }
}
