//! KV cache: per sequence, per layer, one row per position, stored in the cache type (`-ctk`,
//! `-ctv`). For deepseek2 with MLA a row is the compressed latent plus the rotary part of K
//! (`kv_lora_rank + n_rot` values) and there is no separate V: V is the latent part of K.

use crate::{Error, Result};
use std::collections::HashMap;
use tandem_gguf::GgmlType;
use tandem_quant::{quantize_row, row_size};

/// The element types a KV cache may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
    BF16,
    Q8_0,
}

impl CacheType {
    pub fn from_name(name: &str) -> Result<CacheType> {
        match name.to_ascii_lowercase().as_str() {
            "f32" => Ok(CacheType::F32),
            "f16" => Ok(CacheType::F16),
            "bf16" => Ok(CacheType::BF16),
            "q8_0" => Ok(CacheType::Q8_0),
            _ => Err(Error::Model(format!("unsupported KV cache type '{name}' (use f32, f16, bf16 or q8_0)"))),
        }
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            CacheType::F32 => GgmlType::F32,
            CacheType::F16 => GgmlType::F16,
            CacheType::BF16 => GgmlType::BF16,
            CacheType::Q8_0 => GgmlType::Q8_0,
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

struct SeqKv {
    len: usize,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
}

/// The cache of every sequence.
pub struct KvCache {
    layout: KvLayout,
    k_type: GgmlType,
    v_type: GgmlType,
    k_row_bytes: usize,
    v_row_bytes: usize,
    n_ctx: usize,
    seqs: HashMap<usize, SeqKv>,
}

impl KvCache {
    pub(crate) fn new(layout: KvLayout, k: CacheType, v: CacheType, n_ctx: usize) -> Result<KvCache> {
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
        Ok(KvCache {
            k_row_bytes: row_size(k_type, layout.k_row)?,
            v_row_bytes: if layout.v_row == 0 { 0 } else { row_size(v_type, layout.v_row)? },
            layout,
            k_type,
            v_type,
            n_ctx,
            seqs: HashMap::new(),
        })
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

    /// Positions cached for `seq`.
    pub fn seq_len(&self, seq: usize) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    /// Forgets positions `n..` of `seq` (all of it with `n = 0`).
    pub fn truncate(&mut self, seq: usize, n: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            if n < s.len {
                s.len = n;
                for k in &mut s.k {
                    k.truncate(n * self.k_row_bytes);
                }
                for v in &mut s.v {
                    v.truncate(n * self.v_row_bytes);
                }
            }
        }
        if n == 0 {
            self.seqs.remove(&seq);
        }
    }

    /// Makes `dst` a copy of the first `n` positions of `src` (a shared prompt prefix computed once).
    pub fn copy_prefix(&mut self, src: usize, dst: usize, n: usize) {
        if src == dst {
            self.truncate(dst, n);
            return;
        }
        let n = n.min(self.seq_len(src));
        self.truncate(dst, 0);
        let Some(s) = self.seqs.get(&src) else { return };
        let copy = SeqKv {
            len: n,
            k: s.k.iter().map(|k| k[..n * self.k_row_bytes].to_vec()).collect(),
            v: s.v.iter().map(|v| v[..(n * self.v_row_bytes).min(v.len())].to_vec()).collect(),
        };
        if n > 0 {
            self.seqs.insert(dst, copy);
        }
    }

    /// Bytes the cache holds now.
    pub fn used_bytes(&self) -> usize {
        self.seqs.values().map(|s| s.len * (self.k_row_bytes + self.v_row_bytes) * self.layout.n_layer).sum()
    }

    /// Appends the K (and V) row of the next position of `seq` in layer `il`.
    pub(crate) fn push(&mut self, seq: usize, il: usize, k: &[f32], v: Option<&[f32]>) -> Result<()> {
        let n_layer = self.layout.n_layer;
        let s = self.seqs.entry(seq).or_insert_with(|| SeqKv {
            len: 0,
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
        });
        let kbuf = &mut s.k[il];
        let at = kbuf.len();
        kbuf.resize(at + self.k_row_bytes, 0);
        quantize_row(self.k_type, k, &mut kbuf[at..])?;
        if let (Some(v), true) = (v, self.v_row_bytes > 0) {
            let vbuf = &mut s.v[il];
            let at = vbuf.len();
            vbuf.resize(at + self.v_row_bytes, 0);
            quantize_row(self.v_type, v, &mut vbuf[at..])?;
        }
        // The sequence's length is that of its last layer's K rows.
        if il == n_layer - 1 {
            s.len = s.k[il].len() / self.k_row_bytes;
        }
        Ok(())
    }

    /// The K rows (and V rows, empty under MLA) of `seq` in layer `il`.
    pub(crate) fn rows(&self, seq: usize, il: usize) -> (&[u8], &[u8]) {
        match self.seqs.get(&seq) {
            Some(s) => (&s.k[il], &s.v[il]),
            None => (&[], &[]),
        }
    }
}
