//! KV cache: per sequence, per layer, one row per position, stored in the cache type (`-ctk`,
//! `-ctv`). For deepseek2 with MLA a row is the compressed latent plus the rotary part of K
//! (`kv_lora_rank + n_rot` values) and there is no separate V: V is the latent part of K.

use crate::device::KvStore;
use crate::exec::{DevId, Exec};
use crate::{Error, Result};
use std::collections::HashMap;
use tandem_gguf::GgmlType;

/// The element types a KV cache may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
}

impl CacheType {
    pub fn from_name(name: &str) -> Result<CacheType> {
        match name.to_ascii_lowercase().as_str() {
            "f32" => Ok(CacheType::F32),
            "f16" => Ok(CacheType::F16),
            "bf16" => Ok(CacheType::BF16),
            "q8_0" => Ok(CacheType::Q8_0),
            "q4_0" => Ok(CacheType::Q4_0),
            _ => Err(Error::Model(format!("unsupported KV cache type '{name}' (use f32, f16, bf16, q8_0 or q4_0)"))),
        }
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            CacheType::F32 => GgmlType::F32,
            CacheType::F16 => GgmlType::F16,
            CacheType::BF16 => GgmlType::BF16,
            CacheType::Q8_0 => GgmlType::Q8_0,
            CacheType::Q4_0 => GgmlType::Q4_0,
        }
    }
}

/// Row sizes of an architecture's cache: elements per position per layer.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    pub n_layer: usize,
    pub k_row: usize,
    /// 0 when V is read from K (MLA).
    pub v_row: usize,
    /// Every head's slice of a row must start on a block boundary of the cache type.
    pub k_head: usize,
    pub v_head: usize,
}

/// The layers one [`KvStore`] holds, each with its index among them (the stores keep a
/// sequence's rows layer by layer in that order).
#[derive(Clone, Debug)]
pub(crate) struct StoreLayers {
    /// Global layer -> index among the store's layers (`None`: not held here).
    local: Vec<Option<usize>>,
    n: usize,
}

impl StoreLayers {
    pub(crate) fn new(layout: &KvLayout, layers: &[usize]) -> Result<StoreLayers> {
        let mut local = vec![None; layout.n_layer];
        for (i, &il) in layers.iter().enumerate() {
            *local.get_mut(il).ok_or_else(|| Error::Model(format!("cache layer {il} of {}", layout.n_layer)))? =
                Some(i);
        }
        Ok(StoreLayers { local, n: layers.len() })
    }

    /// Layer `il`'s index among the store's layers.
    pub(crate) fn at(&self, il: usize) -> Result<usize> {
        self.local.get(il).copied().flatten().ok_or_else(|| Error::Model(format!("layer {il} is not cached here")))
    }

    /// How many layers the store holds.
    pub(crate) fn len(&self) -> usize {
        self.n
    }
}

/// The cache of every sequence: lengths here, rows on the devices that hold the layers'
/// attention ([`KvStore`]s; for the CPU, host memory).
pub struct KvCache {
    layout: KvLayout,
    k_type: GgmlType,
    v_type: GgmlType,
    n_ctx: usize,
    lens: HashMap<usize, usize>,
    stores: Vec<(DevId, Box<dyn KvStore>)>,
    /// Layer -> index into `stores`.
    layer_store: Vec<usize>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvCache({} layers, {} sequences)", self.layout.n_layer, self.lens.len())
    }
}

impl KvCache {
    /// A cache whose layer `il` lives on device `layer_dev[il]` of `ex`.
    pub(crate) fn new(
        layout: KvLayout,
        k: CacheType,
        v: CacheType,
        n_ctx: usize,
        ex: &Exec,
        layer_dev: &[DevId],
    ) -> Result<KvCache> {
        let (k_type, v_type) = (k.ggml(), v.ggml());
        let bad = |which: &str, ty: GgmlType, n: usize| {
            Error::Model(format!(
                "KV cache type {ty} for {which} needs head sizes that are multiples of {}, this model has {n}",
                ty.block_size()
            ))
        };
        if !layout.k_head.is_multiple_of(k_type.block_size()) {
            return Err(bad("K", k_type, layout.k_head));
        }
        // MLA reads V from the latent part of K, so that part must be whole blocks of K's type.
        let (v_ty_check, v_n) = if layout.v_row == 0 { (k_type, layout.v_head) } else { (v_type, layout.v_head) };
        if !v_n.is_multiple_of(v_ty_check.block_size()) {
            return Err(bad("V", v_ty_check, v_n));
        }
        if layer_dev.len() != layout.n_layer {
            return Err(Error::Model(format!("{} layer devices for {} layers", layer_dev.len(), layout.n_layer)));
        }
        let v_read = if layout.v_row == 0 { k_type } else { v_type };
        let mut layer_store = vec![0; layout.n_layer];
        let mut stores = Vec::new();
        for (d, layers, store) in ex.kv_stores(layer_dev, layout, k_type, v_read)? {
            for il in layers {
                layer_store[il] = stores.len();
            }
            stores.push((d, store));
        }
        Ok(KvCache { layout, k_type, v_type, n_ctx, lens: HashMap::new(), stores, layer_store })
    }

    pub fn k_type(&self) -> GgmlType {
        self.k_type
    }

    /// The type V is read as (K's type under MLA).
    pub fn v_type(&self) -> GgmlType {
        if self.layout.v_row == 0 {
            self.k_type
        } else {
            self.v_type
        }
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Positions cached for `seq`.
    pub fn seq_len(&self, seq: usize) -> usize {
        self.lens.get(&seq).copied().unwrap_or(0)
    }

    /// Forgets positions `n..` of `seq` (all of it with `n = 0`).
    pub fn truncate(&mut self, seq: usize, n: usize) {
        // Always, also at the current length: a failed step may have left rows in some layers.
        for (_, s) in &mut self.stores {
            s.truncate(seq, n);
        }
        match n {
            0 => {
                self.lens.remove(&seq);
            }
            _ => {
                if let Some(l) = self.lens.get_mut(&seq) {
                    *l = (*l).min(n);
                }
            }
        }
    }

    /// Makes `dst` a copy of the first `n` positions of `src` (a shared prompt prefix computed
    /// once), on the devices that hold the rows. On error `dst` is empty.
    pub fn copy_prefix(&mut self, src: usize, dst: usize, n: usize) -> Result<()> {
        if src == dst {
            self.truncate(dst, n);
            return Ok(());
        }
        let n = n.min(self.seq_len(src));
        self.truncate(dst, 0);
        if n == 0 {
            return Ok(());
        }
        for i in 0..self.stores.len() {
            if let Err(e) = self.stores[i].1.copy_prefix(src, dst, n) {
                self.truncate(dst, 0);
                return Err(e);
            }
        }
        self.lens.insert(dst, n);
        Ok(())
    }

    /// Appends `n` positions of zero rows to `seq` in every layer (see [`crate::Context::append_zero_rows`]).
    pub fn append_zero_rows(&mut self, seq: usize, n: usize) -> Result<()> {
        let len = self.seq_len(seq);
        if len + n > self.n_ctx {
            return Err(Error::Batch(format!(
                "sequence {seq}: {} positions are beyond the context of {}",
                len + n,
                self.n_ctx
            )));
        }
        for i in 0..self.stores.len() {
            if let Err(e) = self.stores[i].1.append_zeros(seq, len, n) {
                self.truncate(seq, len);
                return Err(e);
            }
        }
        if n > 0 {
            *self.lens.entry(seq).or_insert(0) += n;
        }
        Ok(())
    }

    /// Records that every layer holds `n` positions of `seq` (written with
    /// [`KvStore::write_rows`]).
    pub(crate) fn set_len(&mut self, seq: usize, n: usize) {
        match n {
            0 => self.lens.remove(&seq),
            _ => self.lens.insert(seq, n),
        };
    }

    /// Bytes the cache holds now.
    pub fn used_bytes(&self) -> usize {
        self.stores.iter().map(|(_, s)| s.used_bytes()).sum()
    }

    /// The most bytes of rebuilt keys and values the decompressed MLA attention keeps between
    /// runs, on each device that keeps them (the CPU).
    pub(crate) fn set_rebuilt_budget(&mut self, bytes: usize) {
        for (_, s) in &mut self.stores {
            s.set_rebuilt_budget(bytes);
        }
    }

    /// Bytes of rebuilt keys and values kept now.
    pub fn rebuilt_bytes(&self) -> usize {
        self.stores.iter().map(|(_, s)| s.rebuilt_bytes()).sum()
    }

    /// Rows of `seq` in layer `il` whose rebuilt keys and values are kept.
    pub(crate) fn rebuilt_rows(&self, il: usize, seq: usize) -> usize {
        self.store(il).map_or(0, |(_, s)| s.rebuilt_rows(seq, il))
    }

    /// The store of layer `il` and its device.
    pub(crate) fn store(&self, il: usize) -> Result<(DevId, &dyn KvStore)> {
        let i = *self.layer_store.get(il).ok_or_else(|| Error::Model(format!("no cache for layer {il}")))?;
        let (d, s) = &self.stores[i];
        Ok((*d, s.as_ref()))
    }

    pub(crate) fn store_mut(&mut self, il: usize) -> Result<(DevId, &mut dyn KvStore)> {
        let i = *self.layer_store.get(il).ok_or_else(|| Error::Model(format!("no cache for layer {il}")))?;
        let (d, s) = &mut self.stores[i];
        Ok((*d, s.as_mut()))
    }

    /// The store device `d` holds, if any.
    pub(crate) fn store_on_mut(&mut self, d: DevId) -> Option<&mut dyn KvStore> {
        self.stores.iter_mut().find(|(sd, _)| *sd == d).map(|(_, s)| s.as_mut() as &mut dyn KvStore)
    }

    /// The micro-batch's rows are in every layer: each of its sequences is that much longer.
    pub(crate) fn advance(&mut self, seqs: &[usize]) {
        for &s in seqs {
            *self.lens.entry(s).or_insert(0) += 1;
        }
    }
}
