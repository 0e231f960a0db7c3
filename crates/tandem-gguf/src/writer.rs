//! GGUF v3 writer, laying files out as gguf-py's `GGUFWriter` does (header, key/values, tensor
//! infos, padding to the alignment, then each tensor's data padded to the alignment), so files it
//! writes load in llama.cpp.

use crate::parse::{DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_ALIGNMENT, MAX_DIMS};
use crate::value::{Array, Value};
use crate::{Error, GgmlType, Result};
use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    /// Bytes of the tensor's data.
    len: u64,
    /// The data, or empty for a tensor [`GgufWriter::write_file_with`] fills as it writes it.
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes one GGUF file.
pub struct GgufWriter {
    version: u32,
    kv: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// A writer of GGUF version 3.
    pub fn new() -> GgufWriter {
        GgufWriter { version: 3, kv: Vec::new(), tensors: Vec::new() }
    }

    /// Writes version 2 or 3 (they share a layout; 3 allows big-endian files, which tandem never writes).
    pub fn version(mut self, version: u32) -> Result<GgufWriter> {
        if !(2..=3).contains(&version) {
            return Err(Error::Write(format!("cannot write GGUF version {version}")));
        }
        self.version = version;
        Ok(self)
    }

    /// Adds a key/value pair; keys are written in the order added.
    pub fn add(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        self.kv.push((key.to_string(), value.into()));
        self
    }

    /// Adds a tensor. `dims` are in ggml order (`dims[0]` is the row length).
    pub fn add_tensor(&mut self, name: &str, ty: GgmlType, dims: &[u64], data: Vec<u8>) -> Result<&mut Self> {
        let len = tensor_bytes(name, ty, dims)?;
        if len != data.len() as u64 {
            return Err(Error::Write(format!(
                "tensor '{name}': {} bytes of data for {ty} {dims:?} (expected {len})",
                data.len()
            )));
        }
        self.tensors.push(PendingTensor { name: name.to_string(), ty, dims: dims.to_vec(), len, data });
        Ok(self)
    }

    /// Adds a tensor whose bytes [`GgufWriter::write_file_with`] asks for when it writes them (a
    /// file bigger than memory, written one tensor at a time); returns its size in bytes.
    pub fn add_tensor_later(&mut self, name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64> {
        let len = tensor_bytes(name, ty, dims)?;
        self.tensors.push(PendingTensor { name: name.to_string(), ty, dims: dims.to_vec(), len, data: Vec::new() });
        Ok(len)
    }

    /// Writes the file to `path`, calling `fill(i, bytes)` for the data of each tensor `i` (in the
    /// order added) that was added with [`GgufWriter::add_tensor_later`]; one tensor's bytes in
    /// memory at a time.
    pub fn write_file_with(&self, path: impl AsRef<Path>, fill: &mut dyn FnMut(usize, &mut [u8])) -> Result<()> {
        let path = path.as_ref();
        let io = |e: std::io::Error| Error::io(path, e);
        let mut header = Vec::new();
        self.write_header(&mut header).map_err(|e| Error::Write(e.to_string()))?;
        let alignment = self.alignment()?;
        let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(path).map_err(io)?);
        f.write_all(&header).map_err(io)?;
        let zeros = vec![0u8; alignment as usize];
        let mut buf = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let data: &[u8] = if t.data.is_empty() && t.len > 0 {
                buf.clear();
                buf.resize(t.len as usize, 0);
                fill(i, &mut buf);
                &buf
            } else {
                &t.data
            };
            f.write_all(data).map_err(io)?;
            let pad = (t.len.div_ceil(alignment) * alignment - t.len) as usize;
            f.write_all(&zeros[..pad]).map_err(io)?;
        }
        f.flush().map_err(io)
    }

    fn alignment(&self) -> Result<u64> {
        match self.kv.iter().find(|(k, _)| k == KEY_ALIGNMENT) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, Value::U32(a))) if *a != 0 && a.is_power_of_two() => Ok(*a as u64),
            Some((_, v)) => Err(Error::Write(format!("{KEY_ALIGNMENT} = {v} must be a power-of-two u32"))),
        }
    }

    /// The whole file in memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_to(&mut out).map_err(|e| Error::Write(e.to_string()))?;
        Ok(out)
    }

    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
    }

    fn write_to(&self, out: &mut Vec<u8>) -> std::io::Result<()> {
        if self.tensors.iter().any(|t| t.data.is_empty() && t.len > 0) {
            let m = "tensors added with add_tensor_later are written by write_file_with";
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, m));
        }
        self.write_header(out)?;
        for t in &self.tensors {
            out.write_all(&t.data)?;
            pad(out, self.alignment().map_err(|e| std::io::Error::other(e.to_string()))?);
        }
        Ok(())
    }

    /// Everything before the tensor data, padded to the alignment.
    fn write_header(&self, out: &mut Vec<u8>) -> std::io::Result<()> {
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        let alignment = self.alignment().map_err(|e| invalid(e.to_string()))?;
        let mut keys = HashSet::new();
        for (k, _) in &self.kv {
            if k.is_empty() || !keys.insert(k.as_str()) {
                return Err(invalid(format!("empty or duplicate key '{k}'")));
            }
        }
        let mut names = HashSet::new();
        for t in &self.tensors {
            if t.name.is_empty() || !names.insert(t.name.as_str()) {
                return Err(invalid(format!("empty or duplicate tensor name '{}'", t.name)));
            }
        }
        out.write_all(&GGUF_MAGIC)?;
        out.write_all(&self.version.to_le_bytes())?;
        out.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        out.write_all(&(self.kv.len() as u64).to_le_bytes())?;
        for (k, v) in &self.kv {
            write_str(out, k)?;
            out.write_all(&(v.value_type() as u32).to_le_bytes())?;
            write_value(out, v)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            write_str(out, &t.name)?;
            out.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                out.write_all(&d.to_le_bytes())?;
            }
            out.write_all(&t.ty.id().to_le_bytes())?;
            out.write_all(&offset.to_le_bytes())?;
            offset += t.len.div_ceil(alignment) * alignment;
        }
        pad(out, alignment);
        Ok(())
    }
}

/// Bytes of a tensor of `ty` and `dims`, checked.
fn tensor_bytes(name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64> {
    if dims.is_empty() || dims.len() > MAX_DIMS || dims.contains(&0) {
        return Err(Error::Write(format!("tensor '{name}': bad dimensions {dims:?}")));
    }
    let rows: Option<u64> = dims[1..].iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    ty.row_bytes(dims[0])
        .zip(rows)
        .and_then(|(r, n)| r.checked_mul(n))
        .ok_or_else(|| Error::Write(format!("tensor '{name}': {ty} {dims:?} is not a whole number of blocks")))
}

fn pad(out: &mut Vec<u8>, alignment: u64) {
    let len = (out.len() as u64).div_ceil(alignment) * alignment;
    out.resize(len as usize, 0);
}

fn write_str(out: &mut Vec<u8>, s: &str) -> std::io::Result<()> {
    out.write_all(&(s.len() as u64).to_le_bytes())?;
    out.write_all(s.as_bytes())
}

fn write_value(out: &mut Vec<u8>, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => out.write_all(&[*x]),
        Value::I8(x) => out.write_all(&x.to_le_bytes()),
        Value::U16(x) => out.write_all(&x.to_le_bytes()),
        Value::I16(x) => out.write_all(&x.to_le_bytes()),
        Value::U32(x) => out.write_all(&x.to_le_bytes()),
        Value::I32(x) => out.write_all(&x.to_le_bytes()),
        Value::F32(x) => out.write_all(&x.to_le_bytes()),
        Value::Bool(x) => out.write_all(&[*x as u8]),
        Value::String(s) => write_str(out, s),
        Value::U64(x) => out.write_all(&x.to_le_bytes()),
        Value::I64(x) => out.write_all(&x.to_le_bytes()),
        Value::F64(x) => out.write_all(&x.to_le_bytes()),
        Value::Array(a) => write_array(out, a),
    }
}

fn write_array(out: &mut Vec<u8>, a: &Array) -> std::io::Result<()> {
    out.write_all(&(a.elem_type() as u32).to_le_bytes())?;
    out.write_all(&(a.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {{
            for x in $v {
                out.write_all(&x.to_le_bytes())?;
            }
            Ok(())
        }};
    }
    match a {
        Array::U8(v) => out.write_all(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => each!(v.iter().map(|b| *b as u8)),
        Array::String(v) => v.iter().try_for_each(|s| write_str(out, s)),
        Array::Array(v) => v.iter().try_for_each(|x| write_array(out, x)),
    }
}

macro_rules! value_from {
    ($($t:ty => $scalar:ident),*) => {$(
        impl From<$t> for Value {
            fn from(x: $t) -> Value { Value::$scalar(x) }
        }
        impl From<Vec<$t>> for Value {
            fn from(x: Vec<$t>) -> Value { Value::Array(Array::$scalar(x)) }
        }
    )*};
}
value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for Value {
    fn from(x: &str) -> Value {
        Value::String(x.to_string())
    }
}

impl From<Vec<&str>> for Value {
    fn from(x: Vec<&str>) -> Value {
        Value::Array(Array::String(x.into_iter().map(str::to_string).collect()))
    }
}

impl From<Array> for Value {
    fn from(x: Array) -> Value {
        Value::Array(x)
    }
}
