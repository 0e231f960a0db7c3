//! Strict parser of the GGUF header (ggml/docs/gguf.md). Model files are hostile input: every
//! count, length, dimension, type id, offset and size is checked against the bytes that are
//! actually there, and against fixed caps, before anything is allocated.

use crate::value::{Array, Value, ValueType};
use crate::GgmlType;
use std::collections::HashSet;

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const KEY_ALIGNMENT: &str = "general.alignment";

/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays that is accepted.
pub const MAX_ARRAY_NESTING: usize = 8;
/// Caps far above any real model (a 1T split model has ~100k tensors and ~50 keys per shard).
pub const MAX_TENSORS: u64 = 1 << 24;
pub const MAX_KVS: u64 = 1 << 20;
/// Longest key or tensor name (ggml's own names are < 64 bytes).
pub const MAX_NAME_LEN: u64 = 1 << 16;
/// Longest string value (chat templates are a few KiB; the cap only stops absurd claims).
pub const MAX_STRING_LEN: u64 = 1 << 30;

/// Where parsing failed and why. The caller adds the file name.
#[derive(Debug)]
pub struct ParseError {
    pub offset: u64,
    pub msg: String,
}

type PResult<T> = std::result::Result<T, ParseError>;

/// One tensor's entry in the header, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the row length (contiguous), as `ne[]` in ggml.
    pub dims: Vec<u64>,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed and validated GGUF header.
#[derive(Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section in the file.
    pub data_offset: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err<T>(&self, msg: impl Into<String>) -> PResult<T> {
        Err(ParseError { offset: self.pos as u64, msg: msg.into() })
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> PResult<&'a [u8]> {
        if n > self.remaining() {
            return self.err(format!("file truncated: {what} needs {n} bytes, {} left", self.remaining()));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> PResult<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> PResult<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> PResult<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items that take at least `min_item` bytes each, checked against the bytes left
    /// and against `cap`.
    fn count(&mut self, what: &str, min_item: u64, cap: u64) -> PResult<u64> {
        let start = self.pos as u64;
        let n = self.u64(what)?;
        if n > cap {
            return Err(ParseError { offset: start, msg: format!("{what} {n} is larger than the limit {cap}") });
        }
        if n.saturating_mul(min_item) > self.remaining() {
            return Err(ParseError {
                offset: start,
                msg: format!(
                    "{what} {n} cannot fit in the {} bytes left in the file (truncated or corrupt?)",
                    self.remaining()
                ),
            });
        }
        Ok(n)
    }

    fn string(&mut self, what: &str, cap: u64) -> PResult<String> {
        let start = self.pos as u64;
        let len = self.u64(what)?;
        if len > cap {
            return Err(ParseError {
                offset: start,
                msg: format!("{what} length {len} is larger than the limit {cap}"),
            });
        }
        if len > self.remaining() {
            return Err(ParseError {
                offset: start,
                msg: format!("{what} length {len} is larger than the {} bytes left in the file", self.remaining()),
            });
        }
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value_type(&mut self, key: &str) -> PResult<ValueType> {
        let start = self.pos as u64;
        let id = self.u32("value type")?;
        ValueType::from_id(id)
            .ok_or(ParseError { offset: start, msg: format!("unknown metadata value type {id} for key '{key}'") })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> PResult<Value> {
        let what = "metadata value";
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => Value::Bool(self.bool(key)?),
            ValueType::String => Value::String(self.string("string", MAX_STRING_LEN)?),
            ValueType::Array => Value::Array(self.array_value(key, depth + 1)?),
        })
    }

    fn bool(&mut self, key: &str) -> PResult<bool> {
        match self.array::<1>("bool")?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => {
                self.pos -= 1;
                self.err(format!("bool value {b} of key '{key}' is neither 0 nor 1"))
            }
        }
    }

    fn array_value(&mut self, key: &str, depth: usize) -> PResult<Array> {
        if depth > MAX_ARRAY_NESTING {
            return self.err(format!("arrays nested deeper than {MAX_ARRAY_NESTING} levels in key '{key}'"));
        }
        let ty = self.value_type(key)?;
        let n = self.count("array length", ty.min_encoded_size(), u64::MAX)? as usize;
        macro_rules! read_vec {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push($read);
                }
                Array::$variant(v)
            }};
        }
        let w = "array element";
        Ok(match ty {
            ValueType::U8 => Array::U8(self.take(n as u64, w)?.to_vec()),
            ValueType::I8 => read_vec!(I8, self.array::<1>(w)?[0] as i8),
            ValueType::U16 => read_vec!(U16, u16::from_le_bytes(self.array(w)?)),
            ValueType::I16 => read_vec!(I16, i16::from_le_bytes(self.array(w)?)),
            ValueType::U32 => read_vec!(U32, self.u32(w)?),
            ValueType::I32 => read_vec!(I32, i32::from_le_bytes(self.array(w)?)),
            ValueType::F32 => read_vec!(F32, f32::from_le_bytes(self.array(w)?)),
            ValueType::U64 => read_vec!(U64, self.u64(w)?),
            ValueType::I64 => read_vec!(I64, i64::from_le_bytes(self.array(w)?)),
            ValueType::F64 => read_vec!(F64, f64::from_le_bytes(self.array(w)?)),
            ValueType::Bool => read_vec!(Bool, self.bool(key)?),
            ValueType::String => read_vec!(String, self.string("string", MAX_STRING_LEN)?),
            ValueType::Array => read_vec!(Array, self.array_value(key, depth + 1)?),
        })
    }
}

/// Parses and validates the header of a GGUF file whose complete contents are `buf`
/// (only the header pages are touched; tensor data is checked for bounds, not read).
pub fn parse_header(buf: &[u8]) -> PResult<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.array::<4>("magic")?;
    if magic != GGUF_MAGIC {
        c.pos = 0;
        return c.err(format!("bad magic {magic:02x?}: not a GGUF file (expected \"GGUF\")"));
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return c.err("GGUF version 1 is not supported (versions 2 and 3 are)"),
        v if v & 0xffff == 0 && v != 0 => {
            return c.err(format!("GGUF version {v:#x} looks big-endian; only little-endian files are supported"))
        }
        v => return c.err(format!("unsupported GGUF version {v} (versions 2 and 3 are)")),
    }
    // Smallest tensor info: name length + 1-byte name + n_dims + one dim + type + offset.
    let n_tensors = c.count("tensor count", 8 + 1 + 4 + 8 + 4 + 8, MAX_TENSORS)?;
    // Smallest key/value: key length + 1-byte key + type + 1-byte value.
    let n_kv = c.count("metadata key/value count", 8 + 1 + 4 + 1, MAX_KVS)?;

    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
    let mut keys: HashSet<String> = HashSet::with_capacity(n_kv as usize);
    for _ in 0..n_kv {
        let key_at = c.pos as u64;
        let key = c.string("key", MAX_NAME_LEN)?;
        if key.is_empty() {
            return Err(ParseError { offset: key_at, msg: "empty metadata key".into() });
        }
        if !keys.insert(key.clone()) {
            return Err(ParseError { offset: key_at, msg: format!("duplicate metadata key '{key}'") });
        }
        let ty = c.value_type(&key)?;
        let value = c.value(ty, &key, 0)?;
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == KEY_ALIGNMENT) {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if *a != 0 && a.is_power_of_two() => *a as u64,
        Some((_, Value::U32(a))) => return c.err(format!("{KEY_ALIGNMENT} = {a} is not a non-zero power of two")),
        Some((_, v)) => return c.err(format!("{KEY_ALIGNMENT} has type {}, expected u32", v.type_description())),
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names: HashSet<String> = HashSet::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let info_at = c.pos as u64;
        let t = tensor_info(&mut c)?;
        if t.offset % alignment != 0 {
            return Err(ParseError {
                offset: info_at,
                msg: format!("tensor '{}' offset {} is not a multiple of the alignment {alignment}", t.name, t.offset),
            });
        }
        if !names.insert(t.name.clone()) {
            return Err(ParseError { offset: info_at, msg: format!("duplicate tensor name '{}'", t.name) });
        }
        tensors.push(t);
    }

    let header_end = c.pos as u64;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    check_tensor_extents(&tensors, data_offset, file_len)?;
    Ok(Header { version, metadata, tensors, alignment, data_offset })
}

fn tensor_info(c: &mut Cursor) -> PResult<TensorInfo> {
    let name = c.string("tensor name", MAX_NAME_LEN)?;
    if name.is_empty() {
        return c.err("empty tensor name");
    }
    let n_dims = c.u32("tensor n_dims")?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return c.err(format!("tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for i in 0..n_dims {
        let d = i64::from_le_bytes(c.array("tensor dimension")?);
        if d <= 0 {
            return c.err(format!("tensor '{name}' dimension {i} is {d} (must be positive)"));
        }
        dims.push(d as u64);
    }
    let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    let Some(n_elements) = n_elements.filter(|&n| n <= i64::MAX as u64) else {
        return c.err(format!("tensor '{name}' dimensions {dims:?}: element count overflows"));
    };
    let type_at = c.pos as u64;
    let type_id = c.u32("tensor type")?;
    let Some(ty) = GgmlType::from_id(type_id) else {
        return Err(ParseError { offset: type_at, msg: format!("tensor '{name}' has unknown ggml type id {type_id}") });
    };
    let Some(row) = ty.row_bytes(dims[0]) else {
        return c.err(format!(
            "tensor '{name}' row length {} is not a multiple of the {ty} block size {}",
            dims[0],
            ty.block_size()
        ));
    };
    let size = (n_elements / dims[0]).checked_mul(row);
    let Some(size) = size else {
        return c.err(format!("tensor '{name}' dimensions {dims:?}: byte size overflows"));
    };
    let offset = c.u64("tensor offset")?;
    Ok(TensorInfo { name, ty, dims, offset, size })
}

fn check_tensor_extents(tensors: &[TensorInfo], data_offset: u64, file_len: u64) -> PResult<()> {
    let data_len = file_len.saturating_sub(data_offset);
    for t in tensors {
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|e| e > data_len) {
            return Err(ParseError {
                offset: file_len,
                msg: format!(
                    "tensor '{}' data ({} bytes at data offset {}) runs past the end of the file \
                     ({data_len} bytes of data; truncated?)",
                    t.name, t.size, t.offset
                ),
            });
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        if w[0].offset + w[0].size > w[1].offset {
            return Err(ParseError {
                offset: data_offset + w[1].offset,
                msg: format!("tensors '{}' and '{}' overlap", w[0].name, w[1].name),
            });
        }
    }
    Ok(())
}
