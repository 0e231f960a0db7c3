//! The [`Runtime`]'s memory: buffers from the caching pool ([`crate::memory`]), copies between
//! host and device and on the device, and the waits for them.

use super::Runtime;
use crate::memory::{DeviceBuffer, Span};
use crate::{Elem, Error, Result};

/// A copy to the host in flight ([`Runtime::read_begin`]).
#[derive(Debug)]
#[must_use = "a read begun is ended with Runtime::read_end"]
pub struct Reading {
    ticket: usize,
    bytes: usize,
}
impl Runtime {
    /// A buffer of `n` values, not zeroed; `what` names it in an out-of-memory error.
    pub fn alloc<T: Elem>(&self, n: usize, what: &str) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::new(&self.pool, n, what)
    }

    /// A buffer of `n` zeros (queued).
    pub fn zeros<T: Elem>(&self, n: usize, what: &str) -> Result<DeviceBuffer<T>> {
        let b = self.alloc::<T>(n, what)?;
        if n > 0 {
            self.drv.memset_zero(b.at(0, n, what)?, n * std::mem::size_of::<T>())?;
            self.ledger.launch(1);
        }
        Ok(b)
    }

    /// Queues zeroing values `off..off + n` of `b`.
    pub fn fill_zero<T: Elem>(&self, b: &DeviceBuffer<T>, off: usize, n: usize) -> Result<()> {
        let p = b.at(off, n, "zero")?;
        if n > 0 {
            self.drv.memset_zero(p, n * std::mem::size_of::<T>())?;
            self.ledger.launch(1);
        }
        Ok(())
    }

    /// A new buffer holding `data` (one copy).
    pub fn upload<T: Elem>(&self, data: &[T], what: &str) -> Result<DeviceBuffer<T>> {
        let b = self.alloc::<T>(data.len(), what)?;
        self.write(&b, 0, data)?;
        Ok(b)
    }

    /// Queues a copy of `data` to `dst[offset..]` (one copy; `data` may be reused at once).
    pub fn write<T: Elem>(&self, dst: &DeviceBuffer<T>, offset: usize, data: &[T]) -> Result<()> {
        // SAFETY: `T` is a plain value type (f32, u8, u16, i32, f16): its bytes are initialized.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        self.write_bytes(dst, offset, bytes)
    }

    /// Queues a copy of raw bytes to `dst[offset..]`; `bytes` must be a whole number of values.
    pub fn write_bytes<T: Elem>(&self, dst: &DeviceBuffer<T>, offset: usize, bytes: &[u8]) -> Result<()> {
        let size = std::mem::size_of::<T>();
        if !bytes.len().is_multiple_of(size) {
            return Err(Error::Shape(format!("{} bytes are not a whole number of {size}-byte values", bytes.len())));
        }
        let p = dst.at(offset, bytes.len() / size, "write")?;
        if bytes.is_empty() {
            return Ok(());
        }
        let waits = self.drv.h2d(p, bytes)?;
        self.ledger.h2d(bytes.len());
        self.ledger.sync(waits);
        Ok(())
    }

    /// Copies `src[offset..offset + out.len()]` to `out` after all queued work (one copy, one
    /// wait).
    pub fn read<T: Elem>(&self, src: &DeviceBuffer<T>, offset: usize, out: &mut [T]) -> Result<()> {
        let r = self.read_begin(src, offset, out.len())?;
        self.read_end(r, out)
    }

    /// Queues a copy of `n` values of `src[offset..]` to the host (one copy); the work queued
    /// after it does not delay it. [`Runtime::read_end`] waits for it (one wait).
    pub fn read_begin<T: Elem>(&self, src: &DeviceBuffer<T>, offset: usize, n: usize) -> Result<Reading> {
        let p = src.at(offset, n, "read")?;
        let bytes = n * std::mem::size_of::<T>();
        let ticket = self.drv.d2h_begin(p, bytes)?;
        self.ledger.d2h(bytes);
        Ok(Reading { ticket, bytes })
    }

    /// Waits for a read begun with [`Runtime::read_begin`] and copies its values to `out`.
    pub fn read_end<T: Elem>(&self, r: Reading, out: &mut [T]) -> Result<()> {
        // SAFETY: as in `write`; every byte pattern is a valid value of these types.
        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(out)) };
        if bytes.len() != r.bytes {
            return Err(Error::Shape(format!("a read of {} bytes ended into {}", r.bytes, bytes.len())));
        }
        self.ledger.sync(1);
        self.drv.d2h_end(r.ticket, bytes)
    }

    /// Queues a device-to-device copy of `n` values.
    pub fn copy<T: Elem>(&self, dst: Span<T>, src: Span<T>, n: usize) -> Result<()> {
        let (d, s) = (dst.ptr(n, "copy destination")?, src.ptr(n, "copy source")?);
        if n == 0 {
            return Ok(());
        }
        self.ledger.launch(1);
        self.drv.d2d(d, s, n * std::mem::size_of::<T>())
    }

    /// Waits for all queued work; a kernel that failed while running is reported here.
    pub fn synchronize(&self) -> Result<()> {
        self.ledger.sync(1);
        self.drv.synchronize()
    }
}
