//! The stand-in for builds without the `cuda` feature: the same names as the real runtime, but
//! nothing can be opened, so no [`Runtime`] or [`DeviceBuffer`] value ever exists and their
//! methods are unreachable (`match self.never {}`).

use crate::{AttnShape, DeviceInfo, Elem, Error, GgmlType, Image, Result, RouterParams};
use half::f16;
use std::convert::Infallible;
use std::marker::PhantomData;

/// Always [`Error::BuiltWithoutCuda`].
pub fn init() -> Result<()> {
    Err(Error::BuiltWithoutCuda)
}

/// Always [`Error::BuiltWithoutCuda`].
pub fn devices() -> Result<Vec<DeviceInfo>> {
    Err(Error::BuiltWithoutCuda)
}

/// Device memory; never exists in this build.
pub struct DeviceBuffer<T: Elem> {
    never: Infallible,
    _t: PhantomData<T>,
}

impl<T: Elem> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        match self.never {}
    }

    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

/// A CUDA device; never exists in this build.
#[derive(Debug)]
pub struct Runtime {
    never: Infallible,
}

#[allow(clippy::too_many_arguments, unused_variables)]
impl Runtime {
    /// Always [`Error::BuiltWithoutCuda`].
    pub fn open(images: &[Image], ordinal: usize) -> Result<Runtime> {
        Err(Error::BuiltWithoutCuda)
    }

    pub fn info(&self) -> &DeviceInfo {
        match self.never {}
    }

    pub fn loaded_images(&self) -> &[String] {
        match self.never {}
    }

    pub fn has_kernel(&self, name: &str) -> bool {
        match self.never {}
    }

    pub fn supports(&self, ty: GgmlType) -> bool {
        match self.never {}
    }

    pub fn has_cublas(&self) -> bool {
        match self.never {}
    }

    pub fn memory(&self) -> Result<(u64, u64)> {
        match self.never {}
    }

    pub fn alloc<T: Elem>(&self, n: usize, what: &str) -> Result<DeviceBuffer<T>> {
        match self.never {}
    }

    pub fn upload<T: Elem>(&self, data: &[T], what: &str) -> Result<DeviceBuffer<T>> {
        match self.never {}
    }

    pub fn write<T: Elem>(&self, dst: &mut DeviceBuffer<T>, offset: usize, data: &[T]) -> Result<()> {
        match self.never {}
    }

    pub fn write_bytes<T: Elem>(&self, dst: &mut DeviceBuffer<T>, offset: usize, bytes: &[u8]) -> Result<()> {
        match self.never {}
    }

    pub fn read<T: Elem>(&self, src: &DeviceBuffer<T>, offset: usize, out: &mut [T]) -> Result<()> {
        match self.never {}
    }

    pub fn synchronize(&self) -> Result<()> {
        match self.never {}
    }

    pub fn rmsnorm(
        &self,
        x: &mut DeviceBuffer<f32>,
        n_rows: usize,
        w: Option<&DeviceBuffer<f32>>,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        match self.never {}
    }

    pub fn rope(
        &self,
        x: &mut DeviceBuffer<f32>,
        cs: &DeviceBuffer<f32>,
        n_rows: usize,
        n_heads: usize,
        head_stride: usize,
        row_stride: usize,
        n_dims: usize,
        neox: bool,
    ) -> Result<()> {
        match self.never {}
    }

    pub fn swiglu(&self, gate: &mut DeviceBuffer<f32>, up: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        match self.never {}
    }

    pub fn add(&self, x: &mut DeviceBuffer<f32>, y: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        match self.never {}
    }

    pub fn scale_add(&self, x: &mut DeviceBuffer<f32>, y: &DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        match self.never {}
    }

    pub fn scale(&self, x: &mut DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        match self.never {}
    }

    pub fn router(
        &self,
        logits: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
        n_tokens: usize,
        p: &RouterParams,
        ids: &mut DeviceBuffer<i32>,
        weights: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        match self.never {}
    }

    pub fn matvec(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_offset: usize,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    ) -> Result<()> {
        match self.never {}
    }

    pub fn dequant_f16(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_offset: usize,
        out: &mut DeviceBuffer<f16>,
        n: usize,
    ) -> Result<()> {
        match self.never {}
    }

    pub fn f32_to_f16(&self, x: &DeviceBuffer<f32>, out: &mut DeviceBuffer<f16>, n: usize) -> Result<()> {
        match self.never {}
    }

    pub fn matmul(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_offset: usize,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    ) -> Result<()> {
        match self.never {}
    }

    pub fn attention(
        &self,
        q: &DeviceBuffer<f32>,
        k: &DeviceBuffer<f16>,
        v: Option<&DeviceBuffer<f16>>,
        n_kv: &DeviceBuffer<i32>,
        max_n_kv: usize,
        s: &AttnShape,
        part: &mut DeviceBuffer<f32>,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        match self.never {}
    }
}
