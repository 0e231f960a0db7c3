//! The host emulator (the `emulate` feature): kernels/*.cu compiled for the CPU by build.rs, run
//! with a block's threads as fibers (kernels/host/), device memory in host memory, every queued
//! operation done at once. [`crate::Runtime::emulated`] gives a runtime on it, so the runtime, the
//! kernels and the executor built on them run on machines without a GPU — with the GPU's
//! arithmetic, not the CPU backend's — and the tests check them there.

use crate::driver::{Driver, Gemm};
use crate::{entry_points, DeviceInfo, Error, Result};
use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

/// An emulated kernel: grid and block as three u32 each, the arguments as cuLaunchKernel takes
/// them.
type EntryFn = unsafe extern "C" fn(grid: *const u32, block: *const u32, args: *mut *mut c_void);
type RegisterFn = unsafe extern "C" fn(ctx: *mut c_void, name: *const c_char, entry: EntryFn);

include!(concat!(env!("OUT_DIR"), "/emu_registry.rs"));

/// Alignment of emulated device memory (as cudaMalloc's).
const ALIGN: usize = 256;

pub(crate) struct Emulator {
    info: DeviceInfo,
    entries: HashMap<String, EntryFn>,
    loaded: Vec<String>,
    allocs: Mutex<HashMap<u64, Layout>>,
    /// Reads begun and not ended: ticket -> bytes.
    reads: Mutex<HashMap<usize, Vec<u8>>>,
    next_read: std::sync::atomic::AtomicUsize,
}

unsafe extern "C" fn record(ctx: *mut c_void, name: *const c_char, entry: EntryFn) {
    // SAFETY: `ctx` is the map `Emulator::new` passes, for the duration of the call.
    let map = unsafe { &mut *(ctx as *mut HashMap<String, EntryFn>) };
    // SAFETY: the generated registration passes NUL-terminated string literals.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    map.insert(name, entry);
}

impl Emulator {
    pub fn new() -> Result<Emulator> {
        if !NOT_BUILT.is_empty() {
            return Err(Error::Emulator(NOT_BUILT.to_string()));
        }
        let mut entries: HashMap<String, EntryFn> = HashMap::new();
        register_all(&mut entries as *mut _ as *mut c_void, record);
        let mut loaded: Vec<String> =
            entry_points::all_entry_points().iter().map(|(f, _)| format!("{f}: host emulation")).collect();
        loaded.sort();
        loaded.dedup();
        Ok(Emulator {
            info: DeviceInfo {
                ordinal: 0,
                name: "host emulator".into(),
                compute_capability: (0, 0),
                total_bytes: 1 << 40,
                free_bytes: 1 << 40,
            },
            entries,
            loaded,
            allocs: Mutex::new(HashMap::new()),
            reads: Mutex::new(HashMap::new()),
            next_read: std::sync::atomic::AtomicUsize::new(0),
        })
    }
}

impl Driver for Emulator {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn loaded_images(&self) -> &[String] {
        &self.loaded
    }

    fn has_kernel(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn has_blas(&self) -> bool {
        true
    }

    fn memory(&self) -> Result<(u64, u64)> {
        Ok((self.info.free_bytes, self.info.total_bytes))
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|_| Error::Shape(format!("an allocation of {bytes} bytes")))?;
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(Error::OutOfMemory { device: "the emulator".into(), what: "a buffer".into(), bytes });
        }
        self.allocs.lock().unwrap_or_else(|e| e.into_inner()).insert(p as u64, layout);
        Ok(p as u64)
    }

    unsafe fn free(&self, ptr: u64) {
        if let Some(layout) = self.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&ptr) {
            // SAFETY: allocated by `alloc` with this layout, not freed before (removed from the map).
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }

    fn memset_zero(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: the runtime checked that `dst` has `bytes` bytes of one of our allocations.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
        Ok(())
    }

    fn h2d(&self, dst: u64, src: &[u8]) -> Result<u64> {
        // SAFETY: as above, `dst` holds `src.len()` bytes; host and "device" memory never overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(0)
    }

    fn d2h_begin(&self, src: u64, bytes: usize) -> Result<usize> {
        let mut v = vec![0u8; bytes];
        // SAFETY: as above, `src` holds `bytes` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, v.as_mut_ptr(), bytes) };
        let t = self.next_read.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.reads.lock().unwrap_or_else(|e| e.into_inner()).insert(t, v);
        Ok(t)
    }

    fn d2h_end(&self, ticket: usize, dst: &mut [u8]) -> Result<()> {
        let v = self
            .reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ticket)
            .ok_or_else(|| Error::Shape(format!("no read {ticket} in flight")))?;
        let n = dst.len().min(v.len());
        dst[..n].copy_from_slice(&v[..n]);
        Ok(())
    }

    fn d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: as above; `copy` allows overlap, as cuMemcpyDtoD does not promise but tolerates.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &mut [*mut c_void]) -> Result<()> {
        let f = self.entries.get(name).ok_or_else(|| Error::MissingKernel {
            name: name.to_string(),
            file: entry_points::all_entry_points().into_iter().find(|(_, n)| n == name).map_or("?", |(f, _)| f),
        })?;
        // SAFETY: the caller's promise (Driver::launch); the entry reads exactly the kernel's
        // arguments through `args`.
        unsafe { f(grid.as_ptr(), block.as_ptr(), args.as_mut_ptr()) };
        Ok(())
    }

    fn gemm(&self, g: &Gemm) -> Result<()> {
        let (m, n, k, ldc) = (g.m as usize, g.n as usize, g.k as usize, g.ldc as usize);
        let load = |base: u64, i: usize| -> f32 {
            // SAFETY: the runtime checked that the operands hold m*k, n*k and n*ldc values.
            unsafe {
                if g.f16_inputs {
                    half::f16::from_bits(*(base as *const u16).add(i)).to_f32()
                } else {
                    *(base as *const f32).add(i)
                }
            }
        };
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f32;
                for l in 0..k {
                    acc += load(g.a, i * k + l) * load(g.b, j * k + l);
                }
                // SAFETY: as above.
                unsafe { *(g.c as *mut f32).add(j * ldc + i) = acc };
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        for (p, layout) in self.allocs.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            // SAFETY: allocated by `alloc` with this layout; the emulator is going away with its memory.
            unsafe { std::alloc::dealloc(p as *mut u8, layout) };
        }
    }
}
