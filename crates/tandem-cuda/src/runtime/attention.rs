//! The [`Runtime`]'s KV cache and attention kernels: rows stored into the cache at each token's
//! [`crate::KvMeta`], and attention over them, split over the rows and combined.

use super::{grid, grid_yz, int, long, Runtime};
use crate::memory::{DeviceBuffer, Span};
use crate::{AttnShape, CacheKind, Error, Result, ATTN_MAX_HEAD_DIM, MLA_HEADS, MLA_MAX_DK, MLA_MAX_DV};

/// Block of tandem_attn_* and tandem_attn_combine, and of tandem_attn_mla_*.
const ATTN_THREADS: u32 = 128;
const MLA_THREADS: u32 = 256;

/// The address of the [`crate::KvMeta`]s of `n` tokens at value `off` of an f32 buffer (4 values
/// per token, 8-byte aligned for their u64).
fn meta_ptr(meta: Span<f32>, n: usize, what: &str) -> Result<u64> {
    if !meta.offset().is_multiple_of(2) {
        return Err(Error::Shape(format!("{what}: metadata at an odd offset {}", meta.offset())));
    }
    meta.ptr(n * crate::KV_META_BYTES / 4, what)
}

impl Runtime {
    /// Writes each token's row (`width` values at `src[t * src_stride ..]`) into the
    /// cache at its `meta` entry (a [`crate::KvMeta`] per token): layer `layer`, rows of
    /// `row_bytes`, at byte `byte_off` of the row.
    ///
    /// The metadata's addresses are not checked here: the caller made them from cache buffers of
    /// this runtime with room for each token's position.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        kind: CacheKind,
        src: Span<f32>,
        src_stride: usize,
        meta: Span<f32>,
        n_tokens: usize,
        layer: usize,
        row_bytes: usize,
        byte_off: usize,
        width: usize,
    ) -> Result<()> {
        if n_tokens == 0 {
            return Ok(());
        }
        let bytes = kind.bytes(width).ok_or_else(|| Error::Shape(format!("kv_store: {width} {kind:?} values")))?;
        if byte_off + bytes > row_bytes || width > src_stride {
            return Err(Error::Shape(format!("kv_store: {bytes} bytes at {byte_off} of rows of {row_bytes}")));
        }
        let sp = src.ptr((n_tokens - 1) * src_stride + width, "kv_store source")?;
        let mp = meta_ptr(meta, n_tokens, "kv_store meta")?;
        let (ss, l, rb, bo, wd) = (
            long(src_stride, "kv")?,
            int(layer, "kv")?,
            long(row_bytes, "kv")?,
            long(byte_off, "kv")?,
            int(width, "kv")?,
        );
        let name = format!("tandem_kv_store_{}", kind.name());
        self.launch_rows(&name, n_tokens, &mut args![sp, ss, mp, l, rb, bo, wd])
    }

    /// Attention of `s.n_tokens` query rows (`q`, `[n][n_head][dk]`) over each one's cache rows
    /// `0..=pos` (its `meta` entry) in layer `layer`; `v_off`: byte offset of V in a row, `None`
    /// when V is the first `dv` values of each K head (MLA). `part` is scratch of `n_tokens *
    /// n_head * n_split * (dv + 2)`; `out` is `[n][n_head][dv]`; `max_pos` is the largest position.
    /// MLA shapes (one KV head, V in K, heads a multiple of [`MLA_HEADS`]) take the kernel that
    /// shares each row among a group of heads.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        kind: CacheKind,
        q: &DeviceBuffer<f32>,
        meta: Span<f32>,
        max_pos: usize,
        layer: usize,
        row_bytes: usize,
        v_off: Option<usize>,
        s: &AttnShape,
        part: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        if s.n_head_kv == 0
            || s.n_head == 0
            || !s.n_head.is_multiple_of(s.n_head_kv)
            || s.n_split == 0
            || s.dk == 0
            || s.dv == 0
            || (v_off.is_none() && s.dv > s.dk)
            || s.dk > ATTN_MAX_HEAD_DIM
            || s.dv > ATTN_MAX_HEAD_DIM
            || kind.bytes(s.dk).is_none()
            || kind.bytes(s.dv).is_none()
        {
            return Err(Error::Shape(format!(
                "attention: {} heads over {} KV heads, dk {} dv {}, {} splits, {kind:?} cache",
                s.n_head, s.n_head_kv, s.dk, s.dv, s.n_split
            )));
        }
        if s.n_tokens == 0 {
            return Ok(());
        }
        let k_bytes = kind.bytes(s.n_head_kv * s.dk).unwrap_or(usize::MAX);
        let v_bytes = kind.bytes(s.n_head_kv * s.dv).unwrap_or(usize::MAX);
        let fits = match v_off {
            Some(v) => k_bytes <= v && v + v_bytes <= row_bytes,
            None => k_bytes <= row_bytes,
        };
        if !fits {
            return Err(Error::Shape(format!("attention: K/V heads do not fit rows of {row_bytes} bytes")));
        }
        let rows = max_pos + 1;
        let chunk = rows.div_ceil(s.n_split);
        let qp = q.at(0, s.n_tokens * s.n_head * s.dk, "attention q")?;
        let mp = meta_ptr(meta, s.n_tokens, "attention meta")?;
        let pp = part.at(0, s.n_tokens * s.n_head * s.n_split * (s.dv + 2), "attention parts")?;
        let op = out.at(0, s.n_tokens * s.n_head * s.dv, "attention out")?;
        let (l, rb) = (int(layer, "attention")?, long(row_bytes, "attention")?);
        let (nh, dk, dv, ch) =
            (s.n_head as i32, int(s.dk, "attention")?, int(s.dv, "attention")?, int(chunk, "attention")?);
        let (nt, ns, nhg) = (grid_yz(s.n_tokens, "attention tokens")?, s.n_split as u32, s.n_head as u32);
        let scale = s.scale;
        let mla = v_off.is_none()
            && s.n_head_kv == 1
            && s.n_head.is_multiple_of(MLA_HEADS)
            && s.dk <= MLA_MAX_DK
            && s.dv <= MLA_MAX_DV
            && self.has_kernel(&format!("tandem_attn_mla_{}", kind.name()));
        if mla {
            let groups = grid(s.n_head / MLA_HEADS)?;
            self.launch(
                &format!("tandem_attn_mla_{}", kind.name()),
                [groups, grid_yz(s.n_split, "attention splits")?, nt],
                [MLA_THREADS, 1, 1],
                &mut args![qp, mp, pp, l, rb, nh, dk, dv, scale, ch],
            )?;
        } else {
            let (nhk, vo) = (int(s.n_head_kv, "attention")?, v_off.map_or(-1i64, |v| v as i64));
            self.launch(
                &format!("tandem_attn_{}", kind.name()),
                [grid(s.n_split)?, grid_yz(s.n_head, "attention heads")?, nt],
                [ATTN_THREADS, 1, 1],
                &mut args![qp, mp, pp, l, rb, vo, nh, nhk, dk, dv, scale, ch],
            )?;
        }
        let ns_i = ns as i32;
        self.launch("tandem_attn_combine", [nhg, nt, 1], [ATTN_THREADS, 1, 1], &mut args![pp, op, nh, dv, ns_i])
    }
}
