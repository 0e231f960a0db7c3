//! Weights bound by GGUF tensor name, used in place from the memory map.

use crate::{model_err, Result};
use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use tandem_cpu::packed::{pack, packable, packing_pays, packing_pays_for, Packed};
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
    /// With `--repack`: the packed copy CPU products use, made once (shared by clones), or why it
    /// could not be made (the weight is then used as it is).
    packed: Option<Arc<OnceLock<std::result::Result<Packed, String>>>>,
    /// The tensor's own bytes were given back to the system after packing (`--no-mmap`;
    /// [`Weight::release_source`]); shared by clones.
    released: Arc<AtomicBool>,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ty, self.dims)
    }
}

impl Weight {
    /// The tensor's bytes in the file (empty once [`Weight::release_source`] gave them back).
    pub fn bytes(&self) -> &[u8] {
        if self.released.load(Ordering::Acquire) {
            return &[];
        }
        self.src.tensor_at(self.index).map_or(&[][..], |t| self.src.data(t))
    }

    /// Bytes of the tensor in the file.
    pub fn source_len(&self) -> u64 {
        self.src.tensor_at(self.index).map_or(0, |t| t.info.size)
    }

    /// Gives the memory of the tensor's own bytes back to the system once its packed copy exists
    /// and the file was read into memory (`--no-mmap`), for a matrix that nothing else reads
    /// (`raw_readers`: the tensors bound more than once or read by rows; `attn_k_b` and
    /// `attn_v_b`, which the decompressed MLA form dequantizes); returns the bytes given back. [`Weight::bytes`] is
    /// empty afterwards.
    pub(crate) fn release_source(&self, raw_readers: &HashSet<usize>) -> u64 {
        if !self.releasable(raw_readers) || !matches!(self.pack_result(), Some(Ok(_))) || !self.src.can_release() {
            return 0;
        }
        let Some(t) = self.src.tensor_at(self.index) else { return 0 };
        if self.released.swap(true, Ordering::AcqRel) {
            return 0;
        }
        // SAFETY: from here on `bytes()` of this weight and its clones is empty; the products
        // take the packed copy (made above, never dropped while the weight lives); the weight
        // has no other binding (`raw_readers`), and `attn_k_b` and `attn_v_b`, the matrices
        // whose bytes a backend reads itself, are never released.
        unsafe { self.src.release(t) }
    }

    /// Whether [`Weight::release_source`] may give this weight's bytes back once it is packed.
    pub(crate) fn releasable(&self, raw_readers: &HashSet<usize>) -> bool {
        let read_raw = self.name.ends_with("attn_k_b.weight") || self.name.ends_with("attn_v_b.weight");
        self.packed.is_some() && !read_raw && !raw_readers.contains(&self.index)
    }

    /// Elements per row (`ne[0]`).
    pub fn cols(&self) -> usize {
        self.dims[0] as usize
    }

    /// Rows over all higher dimensions.
    pub fn rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }

    /// The whole tensor as a matrix of [`Weight::rows`] rows, for CPU products: the packed copy
    /// when the weight has one (made here on first use if [`Weight::pack`] was not called).
    pub fn matrix(&self) -> Result<WeightRef<'_>> {
        if let Some(p) = self.pack() {
            return Ok(p.weight_ref());
        }
        self.plain()
    }

    /// The tensor's own bytes as a matrix (ggml rows).
    fn plain(&self) -> Result<WeightRef<'_>> {
        Ok(WeightRef::new(self.ty, self.rows(), self.cols(), self.bytes())?)
    }

    /// The packed copy (`--repack`), made now if it does not exist yet; None for weights that are
    /// used as they are, and for those whose copy could not be made ([`Weight::pack_result`]).
    pub fn pack(&self) -> Option<&Packed> {
        self.pack_result()?.ok()
    }

    /// Bytes of the packed copy (0 for weights that are not packed).
    pub fn packed_size(&self) -> usize {
        if self.packed.is_none() {
            return 0;
        }
        tandem_cpu::packed::packed_size(self.ty, self.rows(), self.cols())
    }

    /// Makes [`Weight::pack_result`] say `why` instead of packing, unless the copy exists already.
    pub fn keep_unpacked(&self, why: &str) {
        if let Some(cell) = &self.packed {
            let _ = cell.set(Err(why.to_string()));
        }
    }

    /// [`Weight::pack`] with the reason a packable weight stays unpacked (e.g. no memory for the
    /// copy); None for weights that are not packed at all.
    pub fn pack_result(&self) -> Option<std::result::Result<&Packed, &str>> {
        let cell = self.packed.as_ref()?;
        let made =
            cell.get_or_init(|| pack(self.ty, self.rows(), self.cols(), self.bytes()).map_err(|e| e.to_string()));
        Some(made.as_ref().map_err(|e| e.as_str()))
    }

    /// Row `r` as f32.
    pub fn row_f32(&self, r: usize) -> Result<Vec<f32>> {
        let m = self.plain()?;
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

/// A 1-D tensor of the model as f32 (norm weights, biases): devices other than the CPU hold a
/// copy of it by name.
#[derive(Clone, Debug)]
pub struct Vector {
    pub name: String,
    pub v: Vec<f32>,
}

/// Binds tensors by name and checks shapes and types; remembers which tensors were used, so a
/// file with tensors the architecture does not know is refused by name.
pub struct WeightLoader {
    src: Arc<GgufModel>,
    used: RefCell<HashSet<usize>>,
    /// Tensors bound more than once, or read by rows: their own bytes stay in use.
    raw_readers: RefCell<HashSet<usize>>,
    /// `--repack`, where it pays on this machine.
    repack: bool,
    packables: RefCell<Vec<Weight>>,
}

impl WeightLoader {
    pub fn new(src: Arc<GgufModel>) -> WeightLoader {
        WeightLoader::with_repack(src, false)
    }

    /// A loader whose matrices in a packable type and shape (`tandem_cpu::packed`) are repacked
    /// for CPU products when `repack` is set and the machine has the kernel for it.
    pub fn with_repack(src: Arc<GgufModel>, repack: bool) -> WeightLoader {
        WeightLoader {
            src,
            used: RefCell::new(HashSet::new()),
            raw_readers: RefCell::default(),
            repack: repack && packing_pays(),
            packables: RefCell::default(),
        }
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
        self.bind(name, dims, true)
    }

    /// A tensor read by rows (`ggml_get_rows`: token embeddings), never packed.
    pub fn get_table(&self, name: &str, dims: &[usize]) -> Result<Weight> {
        self.bind(name, dims, false)?
            .ok_or_else(|| model_err(format!("missing tensor '{name}' (expected shape {dims:?})")))
    }

    /// Tensors bound more than once or read by rows (see [`Weight::release_source`]).
    pub fn raw_readers(&self) -> HashSet<usize> {
        self.raw_readers.borrow().clone()
    }

    /// The weights that will be packed for CPU products (`--repack`), in load order.
    pub fn packables(&self) -> Vec<Weight> {
        self.packables.borrow().clone()
    }

    fn bind(&self, name: &str, dims: &[usize], may_pack: bool) -> Result<Option<Weight>> {
        let Some(index) = self.src.tensor_index(name) else { return Ok(None) };
        let Some(t) = self.src.tensor_at(index) else { return Ok(None) };
        let got = &t.info.dims;
        // As llama.cpp's `check_tensor_dims`: dimensions beyond either list count as 1, so a file
        // may write `[n, 1]` for `[n]` and `[n]` for `[n, 1]`.
        let at = |d: &[u64], i: usize| d.get(i).copied().unwrap_or(1);
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if (0..got.len().max(want.len())).any(|i| at(got, i) != at(&want, i)) {
            return Err(model_err(format!("tensor '{name}' has shape {got:?}, expected {dims:?}")));
        }
        let ty = t.info.ty;
        if !DEQUANTIZE_TYPES.contains(&ty) || (want.len() > 1 && !VEC_DOT_TYPES.contains(&ty)) {
            return Err(model_err(format!("tensor '{name}' has type {ty}, which tandem does not support yet")));
        }
        if !self.used.borrow_mut().insert(index) || !may_pack {
            self.raw_readers.borrow_mut().insert(index);
        }
        // The shape asked for (the file's, but for dimensions of 1).
        let dims = want;
        let rows = dims[1..].iter().product::<u64>() as usize;
        // Each matrix of a 3-D tensor (an expert) must be whole groups too: it is multiplied alone.
        let pack = may_pack
            && self.repack
            && dims.len() > 1
            && packing_pays_for(ty)
            && packable(ty, dims[1] as usize, dims[0] as usize)
            && packable(ty, rows, dims[0] as usize);
        let w = Weight {
            src: self.src.clone(),
            index,
            name: name.to_string(),
            ty,
            dims,
            packed: pack.then(Default::default),
            released: Arc::default(),
        };
        if pack {
            self.packables.borrow_mut().push(w.clone());
        }
        Ok(Some(w))
    }

    /// A 1-D f32 vector (rope frequency factors).
    pub fn opt_vec(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        self.opt(name, &[n])?.map(|w| w.to_f32()).transpose()
    }

    /// A 1-D tensor a device applies (norm weights, biases), as f32 with its name.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vector> {
        Ok(Vector { name: name.to_string(), v: self.get(name, &[n])?.to_f32()? })
    }

    pub fn opt_vector(&self, name: &str, n: usize) -> Result<Option<Vector>> {
        Ok(self.opt(name, &[n])?.map(|w| w.to_f32()).transpose()?.map(|v| Vector { name: name.to_string(), v }))
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
