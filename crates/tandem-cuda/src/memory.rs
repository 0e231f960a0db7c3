//! Device memory: buffers from a caching pool. A freed buffer goes back to the pool and is handed
//! out again to a later allocation of its size class without a driver call: all work is queued on
//! one stream, so a kernel queued after the free that writes the reused memory runs after every
//! kernel queued before it that read it. The pool gives its memory back to the driver when an
//! allocation finds no device memory (after waiting for the queued work), and when it is dropped.

use crate::driver::Driver;
use crate::{Elem, Error, Result};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// Sizes up to this are rounded up to a power of two (at least [`MIN_CLASS`]); larger ones to a
/// multiple of [`LARGE_UNIT`].
const POW2_MAX: usize = 64 << 20;
const MIN_CLASS: usize = 256;
const LARGE_UNIT: usize = 2 << 20;

fn class_of(bytes: usize) -> usize {
    if bytes <= POW2_MAX {
        bytes.max(MIN_CLASS).next_power_of_two()
    } else {
        bytes.div_ceil(LARGE_UNIT) * LARGE_UNIT
    }
}

pub(crate) struct Pool {
    drv: Arc<dyn Driver>,
    free: Mutex<HashMap<usize, Vec<u64>>>,
    device: String,
}

impl Pool {
    pub fn new(drv: Arc<dyn Driver>) -> Arc<Pool> {
        let device = format!("CUDA{}", drv.info().ordinal);
        Arc::new(Pool { drv, free: Mutex::new(HashMap::new()), device })
    }

    /// A block of at least `bytes`: `(pointer, class)`.
    fn take(&self, bytes: usize, what: &str) -> Result<(u64, usize)> {
        let class = class_of(bytes);
        if let Some(p) = self.free.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&class).and_then(Vec::pop) {
            return Ok((p, class));
        }
        match self.drv.alloc(class) {
            Ok(p) => Ok((p, class)),
            Err(Error::OutOfMemory { .. }) => {
                // The cached blocks back to the driver (once nothing queued uses them), then once more.
                self.trim()?;
                self.drv.alloc(class).map(|p| (p, class)).map_err(|e| match e {
                    Error::OutOfMemory { .. } => {
                        Error::OutOfMemory { device: self.device.clone(), what: what.to_string(), bytes }
                    }
                    other => other,
                })
            }
            Err(e) => Err(e),
        }
    }

    fn give(&self, ptr: u64, class: usize) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).entry(class).or_default().push(ptr);
    }

    /// Frees every cached block.
    pub fn trim(&self) -> Result<()> {
        self.drv.synchronize()?;
        let blocks: Vec<u64> =
            self.free.lock().unwrap_or_else(|e| e.into_inner()).drain().flat_map(|(_, v)| v).collect();
        for p in blocks {
            // SAFETY: a block of this pool's driver, back in the pool (no buffer owns it), and the
            // stream is idle (synchronized above).
            unsafe { self.drv.free(p) };
        }
        Ok(())
    }

    /// Bytes held in the pool's free lists.
    pub fn cached_bytes(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(c, v)| c * v.len()).sum()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.trim();
    }
}

/// Memory on the device: `len` values of `T`, back to the pool on drop. Written only by the
/// device (kernels, copies), never through a Rust reference, so shared references suffice.
pub struct DeviceBuffer<T: Elem> {
    ptr: u64,
    len: usize,
    class: usize,
    pool: Arc<Pool>,
    _t: PhantomData<T>,
}

impl<T: Elem> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({} x {} bytes on {})", self.len, std::mem::size_of::<T>(), self.pool.device)
    }
}

impl<T: Elem> DeviceBuffer<T> {
    pub(crate) fn new(pool: &Arc<Pool>, len: usize, what: &str) -> Result<DeviceBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::Shape(format!("{what}: {len} values do not fit in memory")))?;
        let (ptr, class) = pool.take(bytes.max(1), what)?;
        Ok(DeviceBuffer { ptr, len, class, pool: pool.clone(), _t: PhantomData })
    }

    /// Number of `T` values.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of value `offset` (checked: `offset + need <= len`).
    pub(crate) fn at(&self, offset: usize, need: usize, what: &str) -> Result<u64> {
        match offset.checked_add(need) {
            Some(end) if end <= self.len => Ok(self.ptr + (offset * std::mem::size_of::<T>()) as u64),
            _ => Err(Error::Shape(format!(
                "{what}: values {offset}..{} needed, the buffer has {}",
                offset.saturating_add(need),
                self.len
            ))),
        }
    }

    /// The device address of value 0.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The values from `offset` on, as a kernel takes them (the bounds are checked there).
    pub fn span(&self, offset: usize) -> Span<'_, T> {
        Span { buf: self, offset }
    }
}

/// The values of a [`DeviceBuffer`] from an offset on: where a kernel reads or writes.
pub struct Span<'a, T: Elem> {
    buf: &'a DeviceBuffer<T>,
    offset: usize,
}

impl<T: Elem> Clone for Span<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Elem> Copy for Span<'_, T> {}

impl<T: Elem> std::fmt::Debug for Span<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "values {}.. of a buffer of {}", self.offset, self.buf.len)
    }
}

impl<'a, T: Elem> Span<'a, T> {
    /// The values `n` further on.
    pub fn skip(self, n: usize) -> Span<'a, T> {
        Span { buf: self.buf, offset: self.offset.saturating_add(n) }
    }

    /// The offset in the buffer, in values.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The device address of the first value (checked: `need` values from it are in the buffer).
    pub(crate) fn ptr(&self, need: usize, what: &str) -> Result<u64> {
        self.buf.at(self.offset, need, what)
    }
}

impl<T: Elem> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        self.pool.give(self.ptr, self.class);
    }
}
