//! Weights bound by GGUF tensor name, used in place from the memory map.

use crate::{model_err, Result};
use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::Arc;
use tandem_cpu::WeightRef;
use tandem_gguf::{GgmlType, GgufModel};
use tandem_quant::{dequantize_row, DEQUANTIZE_TYPES, VEC_DOT_TYPES};

/// A tensor of the model: its type, shape (ggml order) and bytes in the mapping.
#[derive(Clone)]
pub struct Weight {
    src: Arc<GgufModel>,
    index: usize,
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ty, self.dims)
    }
}

impl Weight {
    pub fn bytes(&self) -> &[u8] {
        self.src.tensor_at(self.index).map_or(&[][..], |t| self.src.data(t))
    }

    /// Elements per row (`ne[0]`).
    pub fn cols(&self) -> usize {
        self.dims[0] as usize
    }

    /// Rows over all higher dimensions.
    pub fn rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }

    /// The whole tensor as a matrix of [`Weight::rows`] rows.
    pub fn matrix(&self) -> Result<WeightRef<'_>> {
        Ok(WeightRef::new(self.ty, self.rows(), self.cols(), self.bytes())?)
    }

    /// Row `r` as f32.
    pub fn row_f32(&self, r: usize) -> Result<Vec<f32>> {
        let m = self.matrix()?;
        let one = m.rows(r, 1)?;
        let mut out = vec![0f32; self.cols()];
        dequantize_row(self.ty, one.data, &mut out)?;
        Ok(out)
    }

    /// The whole tensor as f32 (for norms, biases and other small vectors).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.rows() * self.cols()];
        dequantize_row(self.ty, self.bytes(), &mut out)?;
        Ok(out)
    }
}

/// Binds tensors by name and checks shapes and types; remembers which tensors were used, so a
/// file with tensors the architecture does not know is refused by name.
pub struct WeightLoader {
    src: Arc<GgufModel>,
    used: RefCell<HashSet<usize>>,
}

impl WeightLoader {
    pub fn new(src: Arc<GgufModel>) -> WeightLoader {
        WeightLoader { src, used: RefCell::new(HashSet::new()) }
    }

    pub fn gguf(&self) -> &GgufModel {
        &self.src
    }

    /// A tensor that must exist with shape `dims` (ggml order).
    pub fn get(&self, name: &str, dims: &[usize]) -> Result<Weight> {
        self.opt(name, dims)?.ok_or_else(|| model_err(format!("missing tensor '{name}' (expected shape {dims:?})")))
    }

    /// A tensor that may be absent; when present it must have shape `dims`.
    pub fn opt(&self, name: &str, dims: &[usize]) -> Result<Option<Weight>> {
        let Some(index) = self.src.tensor_index(name) else { return Ok(None) };
        let Some(t) = self.src.tensor_at(index) else { return Ok(None) };
        let got: Vec<usize> = t.info.dims.iter().map(|&d| d as usize).collect();
        let mut want = dims.to_vec();
        while want.len() > 1 && want.last() == Some(&1) && want.len() > got.len() {
            want.pop();
        }
        if got != want {
            return Err(model_err(format!("tensor '{name}' has shape {got:?}, expected {want:?}")));
        }
        let ty = t.info.ty;
        if !DEQUANTIZE_TYPES.contains(&ty) || (t.info.dims.len() > 1 && !VEC_DOT_TYPES.contains(&ty)) {
            return Err(model_err(format!("tensor '{name}' has type {ty}, which tandem does not support yet")));
        }
        self.used.borrow_mut().insert(index);
        Ok(Some(Weight { src: self.src.clone(), index, name: name.to_string(), ty, dims: t.info.dims.clone() }))
    }

    /// A 1-D f32 vector (norm weights, biases).
    pub fn vec(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        self.get(name, &[n])?.to_f32()
    }

    pub fn opt_vec(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        self.opt(name, &[n])?.map(|w| w.to_f32()).transpose()
    }

    /// Refuses tensors that no part of the architecture bound, except `ignorable` ones.
    pub fn check_all_used(&self, ignorable: impl Fn(&str) -> bool) -> Result<()> {
        let used = self.used.borrow();
        for (i, t) in self.src.tensors().enumerate() {
            if !used.contains(&i) && !ignorable(&t.info.name) {
                return Err(model_err(format!(
                    "tensor '{}' ({} {:?}) is not supported by this architecture",
                    t.info.name, t.info.ty, t.info.dims
                )));
            }
        }
        Ok(())
    }
}
