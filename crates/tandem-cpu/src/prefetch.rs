//! How the single-token kernels ask for the weights they stream next (one software prefetch per
//! 64 bytes, a few KiB ahead). The best hint depends on the processor:
//!
//! * AMD Zen 5: non-temporal (`nta`). The weights are read once per token and need not pass
//!   through L2; against `t0`, 10-20% faster 2-thread decode (docs/PERFORMANCE.md).
//! * Intel (a 2-vCPU Emerald Rapids): `t1`. Non-temporal prefetches there halve a streaming
//!   read (a plain read loop, 1 thread: 5 GB/s with `nta` 4-16 KiB ahead, 11 GB/s without any
//!   prefetch, 12-13 GB/s with `t0` or `t1`). Decode of the Q4_K_M bench model with `--repack`,
//!   2 threads, alternating: 30-32 t/s with `nta`, 23-31 with none, 40-46 with `t0`, 45-51 with
//!   `t1`; without `--repack` 15 t/s with `nta` against 27-28 with `t1`.
//!
//! `TANDEM_PREFETCH` (`nta`, `t0`, `t1`, `off`) overrides the choice; it is read once.

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
        let m = MODE.load(Ordering::Relaxed);
        match Prefetch::ALL.get(m as usize) {
            Some(&p) => p,
            None => {
                let p = choose();
                MODE.store(p as u8, Ordering::Relaxed);
                p
            }
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
    match MODE.load(Ordering::Relaxed) {
        UNSET => Prefetch::detected() as u8,
        m => m,
    }
}

/// Sets the hint every kernel uses from now on (a `PF_*`); returns the one it replaces. For tests
/// that run the kernels compiled for each hint.
#[cfg(test)]
pub(crate) fn set_hint(h: u8) -> u8 {
    let old = Prefetch::detected() as u8;
    MODE.store(h, Ordering::Relaxed);
    old
}

/// [`Prefetch::detected`] as its discriminant, or `UNSET` before the first call.
static MODE: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = u8::MAX;

fn choose() -> Prefetch {
    if let Ok(s) = std::env::var("TANDEM_PREFETCH") {
        match Prefetch::parse(&s) {
            Some(p) => return p,
            None => eprintln!("tandem: TANDEM_PREFETCH={s:?} is not one of nta, t0, t1, off; ignored"),
        }
    }
    if vendor() == *b"AuthenticAMD" {
        Prefetch::Nta
    } else {
        Prefetch::T1
    }
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
        let p = Prefetch::detected();
        assert_eq!(Prefetch::detected(), p, "read once");
        #[cfg(target_arch = "x86_64")]
        {
            // Every hint (and a null address: a prefetch never faults).
            let data = vec![1u8; 4096];
            for h in [0, 1, 2, 3] {
                MODE.store(h, Ordering::Relaxed);
                prefetch_stream(data.as_ptr(), data.len());
                prefetch_stream(std::ptr::null(), 256);
            }
            MODE.store(p as u8, Ordering::Relaxed);
        }
    }
}
