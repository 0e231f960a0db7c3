//! A SIGBUS from a mapped model file (truncated, or its storage gone, while mapped) does not
//! dump core. With [`Mode::Exit`] it becomes one line naming the file and exit status 1. With
//! [`Mode::Recover`] (the server) the rest of the mapping is replaced by zero pages, the read goes
//! on, and [`faults`] counts it: the engine then throws that batch's results away and stops
//! taking requests, and the server stays up to say why. Servers also check
//! [`crate::GgufModel::check_unchanged`] before touching the pages; this catches what slips in
//! between a check and a read.
//!
//! Mapped files register their address ranges in a fixed table of atomics, which the signal
//! handler reads without locking or allocating. A SIGBUS outside every registered range is not
//! ours: the handler puts the default action back and returns, so the fault repeats and the
//! process dies as it would have.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

const SLOTS: usize = 1024;

struct Region {
    start: AtomicUsize,
    /// 0 = a free slot.
    len: AtomicUsize,
    /// The file's name, leaked (a few bytes per mapped file, for the life of the process).
    name: AtomicPtr<u8>,
    name_len: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Region = Region {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    name: AtomicPtr::new(std::ptr::null_mut()),
    name_len: AtomicUsize::new(0),
};

static REGIONS: [Region; SLOTS] = [FREE; SLOTS];

/// Records a mapping of `name` (best effort: with every slot taken it goes unguarded).
pub(crate) fn register(start: usize, len: usize, name: &str) {
    if len == 0 {
        return;
    }
    // printable, so that the handler's line stays one line
    let printable: String = name.chars().map(|c| if c.is_control() { '?' } else { c }).collect();
    let leaked: &'static mut [u8] = Box::leak(printable.into_bytes().into_boxed_slice());
    for r in &REGIONS {
        if r.len.load(Ordering::Acquire) == 0
            && r.start.compare_exchange(0, start, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            r.name.store(leaked.as_mut_ptr(), Ordering::Release);
            r.name_len.store(leaked.len(), Ordering::Release);
            r.len.store(len, Ordering::Release);
            return;
        }
    }
}

/// Forgets the mapping at `start` (before it is unmapped).
pub(crate) fn unregister(start: usize) {
    for r in &REGIONS {
        if r.len.load(Ordering::Acquire) != 0 && r.start.load(Ordering::Acquire) == start {
            r.len.store(0, Ordering::Release);
            r.start.store(0, Ordering::Release);
            return;
        }
    }
}

/// What the handler does about a fault in a mapped model file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One line naming the file, exit status 1.
    Exit,
    /// Zero pages in place of the rest of the mapping; [`faults`] counts it.
    Recover,
}

static RECOVER: AtomicBool = AtomicBool::new(false);
static FAULTS: AtomicUsize = AtomicUsize::new(0);

/// Faults recovered from since the start ([`Mode::Recover`]).
pub fn faults() -> usize {
    FAULTS.load(Ordering::Acquire)
}

/// Installs the SIGBUS handler (once per process) and sets its mode.
pub fn install(mode: Mode) {
    RECOVER.store(mode == Mode::Recover, Ordering::Release);
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction with a valid handler and flags; sigaction(2) copies it.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        }
    });
}

/// Maps zero pages over `[addr rounded down to a page, end)`: the faulting read then reads zeros.
fn zero_from(addr: usize, end: usize) -> bool {
    // SAFETY: sysconf and mmap are plain system calls here. MAP_FIXED replaces pages of a
    // mapping this process owns (a registered model file), with the same protection, so every
    // pointer into it stays valid; munmap of the whole mapping later unmaps these too.
    unsafe {
        let page = libc::sysconf(libc::_SC_PAGESIZE).max(4096) as usize;
        let from = addr & !(page - 1);
        let p = libc::mmap(
            from as *mut libc::c_void,
            end - from,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        );
        p as usize == from
    }
}

/// Writes `bytes` to stderr (async-signal-safe).
fn say(bytes: &[u8]) {
    // SAFETY: write(2) of a live buffer; a short or failed write only shortens the message.
    unsafe {
        libc::write(2, bytes.as_ptr().cast(), bytes.len());
    }
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers; si_addr is the fault.
    let addr = unsafe { (*info).si_addr() } as usize;
    for r in &REGIONS {
        let len = r.len.load(Ordering::Acquire);
        let start = r.start.load(Ordering::Acquire);
        if len != 0 && addr >= start && addr < start + len {
            if RECOVER.load(Ordering::Acquire) && zero_from(addr, start + len) {
                FAULTS.fetch_add(1, Ordering::AcqRel);
                return;
            }
            let name = r.name.load(Ordering::Acquire);
            let name_len = r.name_len.load(Ordering::Acquire);
            say(b"tandem: error: model file ");
            if !name.is_null() {
                // SAFETY: a leaked, never freed buffer of name_len bytes.
                say(unsafe { std::slice::from_raw_parts(name, name_len) });
            }
            say(b" changed or was truncated while mapped (SIGBUS reading it); replace model files atomically (write a new file, then rename it over the old)\n");
            // SAFETY: _exit(2) is async-signal-safe and ends the process at once.
            unsafe { libc::_exit(1) };
        }
    }
    // not a model file: let the fault kill the process as it would have
    // SAFETY: restoring the default action; the faulting instruction runs again and faults.
    unsafe {
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
}
