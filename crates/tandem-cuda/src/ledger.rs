//! What a device did, counted as it happened (DESIGN.md "Backends own their tensors").

use std::sync::atomic::{AtomicU64, Ordering};

/// Kernel launches (ops, on a host device), copies from the host to the device and back with
/// their bytes, and the times the host waited for the device.
#[derive(Debug, Default)]
pub struct Ledger {
    launches: AtomicU64,
    h2d: AtomicU64,
    h2d_bytes: AtomicU64,
    d2h: AtomicU64,
    d2h_bytes: AtomicU64,
    syncs: AtomicU64,
    busy_ns: AtomicU64,
}

/// A [`Ledger`] read at one moment; the difference of two is what happened in between.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub launches: u64,
    /// Copies host -> device, and their bytes.
    pub h2d: u64,
    pub h2d_bytes: u64,
    /// Copies device -> host, and their bytes.
    pub d2h: u64,
    pub d2h_bytes: u64,
    /// Times the host waited for the device.
    pub syncs: u64,
    /// Nanoseconds a host device spent in its ops (0 for a GPU, whose ops run asynchronously).
    pub busy_ns: u64,
}

impl Ledger {
    pub fn launch(&self, n: u64) {
        self.launches.fetch_add(n, Ordering::Relaxed);
    }
    pub fn h2d(&self, bytes: usize) {
        self.h2d.fetch_add(1, Ordering::Relaxed);
        self.h2d_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn d2h(&self, bytes: usize) {
        self.d2h.fetch_add(1, Ordering::Relaxed);
        self.d2h_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn sync(&self, n: u64) {
        self.syncs.fetch_add(n, Ordering::Relaxed);
    }
    pub fn busy(&self, d: std::time::Duration) {
        self.busy_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
    pub fn counts(&self) -> Counts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
            launches: l(&self.launches),
            h2d: l(&self.h2d),
            h2d_bytes: l(&self.h2d_bytes),
            d2h: l(&self.d2h),
            d2h_bytes: l(&self.d2h_bytes),
            syncs: l(&self.syncs),
            busy_ns: l(&self.busy_ns),
        }
    }
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            launches: self.launches - o.launches,
            h2d: self.h2d - o.h2d,
            h2d_bytes: self.h2d_bytes - o.h2d_bytes,
            d2h: self.d2h - o.d2h,
            d2h_bytes: self.d2h_bytes - o.d2h_bytes,
            syncs: self.syncs - o.syncs,
            busy_ns: self.busy_ns - o.busy_ns,
        }
    }
}

impl std::ops::Add for Counts {
    type Output = Counts;
    fn add(self, o: Counts) -> Counts {
        Counts {
            launches: self.launches + o.launches,
            h2d: self.h2d + o.h2d,
            h2d_bytes: self.h2d_bytes + o.h2d_bytes,
            d2h: self.d2h + o.d2h,
            d2h_bytes: self.d2h_bytes + o.d2h_bytes,
            syncs: self.syncs + o.syncs,
            busy_ns: self.busy_ns + o.busy_ns,
        }
    }
}

impl Counts {
    /// Copies either way.
    pub fn copies(&self) -> u64 {
        self.h2d + self.d2h
    }
}
