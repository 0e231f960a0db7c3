//! A sequence's cached state in a file, for llama-server's slot save and restore
//! (`--slot-save-path`, `POST /slots/{id}?action=save|restore`): an agent's long conversation
//! set aside and taken up again later, or on another server of the same model, without
//! computing its prompt again.
//!
//! Layout, little-endian: the magic `TANDEMKV`, the format version (u32), the model's
//! fingerprint (u64, [`fingerprint`]), the K and V cache types (ggml ids, u32 each), the layer
//! count (u32), the bytes of one position's K and V row in a layer (u64 each), the token count
//! `n` (u32) and the `n` tokens (u32 each); then layer by layer its `n` K rows and its `n` V rows
//! (none under MLA) in the cache type's encoding, as llama.cpp lays out a block, and the CRC-32
//! of those rows (u32). Nothing read is trusted: the header is checked against this model and
//! cache, and the file's length against the header, before a row is read; a refused file leaves
//! the sequence as it was. A layer's rows are checked against their CRC before they are stored:
//! a file damaged there leaves the sequence empty (its rows were being replaced).

use crate::{Context, Error, Result};
use std::hash::Hasher;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use tandem_gguf::{GgmlType, GgufModel};

const MAGIC: &[u8; 8] = b"TANDEMKV";
const VERSION: u32 = 2;
/// Bytes before the tokens.
const HEADER: u64 = 8 + 4 + 8 + 4 + 4 + 4 + 8 + 8 + 4;

/// The FNV-1a hash of the model's metadata and tensor list (names, types, shapes): files saved
/// from one model are refused by another, a fine-tune of the same shape included when its
/// metadata differ (its name, as converters write it).
pub fn fingerprint(gguf: &GgufModel) -> u64 {
    let mut h = fnv::FnvHasher::default();
    for (key, value) in gguf.metadata().entries() {
        h.write(key.as_bytes());
        h.write(format!("{value:?}").as_bytes());
    }
    for t in gguf.tensors() {
        h.write(t.info.name.as_bytes());
        h.write_u32(t.info.ty.id());
        t.info.dims.iter().for_each(|&d| h.write_u64(d));
    }
    h.finish()
}

/// The header fields after the magic and the version.
#[derive(Debug, PartialEq)]
struct Header {
    fingerprint: u64,
    k_type: u32,
    v_type: u32,
    n_layer: u32,
    k_row: u64,
    v_row: u64,
}

impl Context {
    /// This context's header, and the bytes of one layer's rows of one position.
    fn state_header(&self) -> Result<(Header, u64)> {
        let c = self.cache();
        let l = c.layout();
        let bytes = |ty: GgmlType, n: usize| tandem_quant::row_size(ty, n).map(|b| b as u64).map_err(Error::from);
        let k_row = bytes(c.k_type(), l.k_row)?;
        let v_row = if l.v_row == 0 { 0 } else { bytes(c.v_type(), l.v_row)? };
        let h = Header {
            fingerprint: self.model().fingerprint(),
            k_type: c.k_type().id(),
            v_type: c.v_type().id(),
            n_layer: l.n_layer as u32,
            k_row,
            v_row,
        };
        Ok((h, k_row + v_row))
    }

    /// Writes the cached positions of `seq` (which hold `tokens`) to `path`, through a temporary
    /// file renamed into place: a failed save leaves no file behind. Returns the bytes written.
    pub fn save_sequence(&self, seq: usize, tokens: &[u32], path: &Path) -> Result<u64> {
        let n = self.seq_len(seq);
        if tokens.len() != n {
            return Err(Error::Model(format!("sequence {seq} caches {n} positions, not {} tokens", tokens.len())));
        }
        let (h, _) = self.state_header()?;
        let tmp = partial_path(path);
        let io = |e: std::io::Error| Error::Model(format!("writing {}: {e}", tmp.display()));
        let result = (|| {
            let mut w = BufWriter::new(std::fs::File::create(&tmp).map_err(io)?);
            let mut put = |b: &[u8]| w.write_all(b).map_err(io);
            put(MAGIC)?;
            put(&VERSION.to_le_bytes())?;
            put(&h.fingerprint.to_le_bytes())?;
            for v in [h.k_type, h.v_type, h.n_layer] {
                put(&v.to_le_bytes())?;
            }
            put(&h.k_row.to_le_bytes())?;
            put(&h.v_row.to_le_bytes())?;
            put(&(n as u32).to_le_bytes())?;
            let mut written = HEADER + 4 * n as u64;
            for t in tokens {
                put(&t.to_le_bytes())?;
            }
            for il in 0..h.n_layer as usize {
                let rows = self.cache().store(il)?.1.read_rows(seq, il, n)?;
                put(&rows)?;
                put(&crc32fast::hash(&rows).to_le_bytes())?;
                written += rows.len() as u64 + 4;
            }
            w.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)?;
            Ok(written)
        })();
        match result {
            Ok(written) => {
                std::fs::rename(&tmp, path).map_err(|e| Error::Model(format!("saving {}: {e}", path.display())))?;
                Ok(written)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Replaces the cached positions of `seq` with those saved in `path` (by
    /// [`Context::save_sequence`] from this model and cache types); returns their tokens and
    /// the bytes read. A file refused by its header, length or tokens leaves `seq` as it was;
    /// one whose rows are damaged (a layer's CRC differs) or cannot be read or stored leaves it
    /// empty.
    pub fn restore_sequence(&mut self, seq: usize, path: &Path) -> Result<(Vec<u32>, u64)> {
        let name = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| Error::Model(format!("{name}: {e}")))?;
        let len = file.metadata().map_err(|e| Error::Model(format!("{name}: {e}")))?.len();
        self.restore_from(seq, BufReader::new(file), len, &name)
    }

    /// [`Context::restore_sequence`] from the `len` bytes `r` reads (`name` names them in errors).
    pub fn restore_from(&mut self, seq: usize, mut r: impl Read, len: u64, name: &str) -> Result<(Vec<u32>, u64)> {
        let (want, layer_row) = self.state_header()?;
        let bad = |why: String| Error::Model(format!("{name}: {why}"));
        let short = |_| bad("ends inside its header".into());
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic).map_err(short)?;
        if &magic != MAGIC {
            return Err(bad("not a tandem slot file".into()));
        }
        let version = read_u32(&mut r).map_err(short)?;
        if version != VERSION {
            return Err(bad(format!("format version {version}; this tandem reads version {VERSION}")));
        }
        let got = Header {
            fingerprint: read_u64(&mut r).map_err(short)?,
            k_type: read_u32(&mut r).map_err(short)?,
            v_type: read_u32(&mut r).map_err(short)?,
            n_layer: read_u32(&mut r).map_err(short)?,
            k_row: read_u64(&mut r).map_err(short)?,
            v_row: read_u64(&mut r).map_err(short)?,
        };
        let type_name = |id: u32| GgmlType::from_id(id).map_or(format!("type {id}"), |t| t.name().to_string());
        if got.fingerprint != want.fingerprint {
            return Err(bad("saved from another model".into()));
        }
        if (got.k_type, got.v_type) != (want.k_type, want.v_type) {
            return Err(bad(format!(
                "saved with a {} / {} KV cache, this one is {} / {} (-ctk / -ctv)",
                type_name(got.k_type),
                type_name(got.v_type),
                type_name(want.k_type),
                type_name(want.v_type)
            )));
        }
        if got != want {
            return Err(bad(format!(
                "its rows ({} layers of {} + {} bytes) are not this cache's ({} of {} + {})",
                got.n_layer, got.k_row, got.v_row, want.n_layer, want.k_row, want.v_row
            )));
        }
        let n = read_u32(&mut r).map_err(short)? as u64;
        let n_ctx = self.cache().n_ctx() as u64;
        if n > n_ctx {
            return Err(bad(format!("holds {n} positions, the context has {n_ctx} (-c)")));
        }
        let expect = HEADER + 4 * n + u64::from(want.n_layer) * (n * layer_row + 4);
        if len != expect {
            return Err(bad(format!("is {len} bytes, its header says {expect}")));
        }
        let n = n as usize;
        let mut tokens = vec![0u32; n];
        let n_vocab = self.model().n_vocab();
        for t in &mut tokens {
            *t = read_u32(&mut r).map_err(|e| bad(e.to_string()))?;
            if *t as usize >= n_vocab {
                return Err(bad(format!("token {t} is beyond the vocabulary of {n_vocab}")));
            }
        }
        // Everything but the rows checked: from here the sequence is replaced.
        self.truncate(seq, 0);
        let result = (|| {
            let mut rows = vec![0u8; n * layer_row as usize];
            for il in 0..want.n_layer as usize {
                r.read_exact(&mut rows).map_err(|e| bad(e.to_string()))?;
                let crc = read_u32(&mut r).map_err(|e| bad(e.to_string()))?;
                if crc != crc32fast::hash(&rows) {
                    return Err(bad(format!("the rows of layer {il} are damaged (its checksum differs)")));
                }
                self.cache_mut().store_mut(il)?.1.write_rows(seq, il, n, &rows)?;
            }
            self.cache_mut().set_len(seq, n);
            Ok(tokens)
        })();
        match result {
            Ok(tokens) => Ok((tokens, len)),
            Err(e) => {
                self.truncate(seq, 0);
                Err(e)
            }
        }
    }
}

/// The temporary file a save of `path` writes before renaming it into place: beside it, hidden,
/// named after it and this process. The name is cut to 200 bytes so that the whole stays within
/// the 255 bytes a file name may have (as `path`'s may).
fn partial_path(path: &Path) -> std::path::PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let cut = (0..=name.len().min(200)).rev().find(|&i| name.is_char_boundary(i)).unwrap_or(0);
    path.with_file_name(format!(".{}.{}.tandem-partial", &name[..cut], std::process::id()))
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
