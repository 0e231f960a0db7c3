//! Hostile hyperparameters: every fixture model rewritten with one metadata value changed (seeded,
//! 1,000 cases, the values that broke loaders before always among them), each run through
//! `tandem run` as [`hostile_util`] does. (Broken file structure is
//! crates/tandem-gguf/tests/malformed.rs's; hostile tensors are hostile_tensors.rs's.)

mod hostile_util;

use hostile_util::{cases_and_seed, fixtures, run_all, sample};
use std::path::{Path, PathBuf};
use tandem_gguf::{Array, GgufFile, GgufWriter, Value};

/// Integer values that have broken loaders: zero, one, odd, the original's neighbours, and the
/// limits of 31, 32 and 64 bits.
fn int_values(v: i128) -> Vec<i128> {
    vec![
        0,
        1,
        2,
        3,
        7,
        v - 1,
        v + 1,
        v * 2,
        v / 2,
        v * 1000,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 40,
        -1,
        i64::MAX as i128,
        u64::MAX as i128,
    ]
}

fn float_values(v: f64) -> Vec<f64> {
    vec![0.0, -0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e-45, 1e38, v * 1e6, -v, 1.0]
}

/// `v` as a value of the same type as `like`, wrapped into its range.
fn int_like(like: &Value, v: i128) -> Value {
    match like {
        Value::U8(_) => Value::U8(v as u8),
        Value::I8(_) => Value::I8(v as i8),
        Value::U16(_) => Value::U16(v as u16),
        Value::I16(_) => Value::I16(v as i16),
        Value::U32(_) => Value::U32(v as u32),
        Value::I32(_) => Value::I32(v as i32),
        Value::U64(_) => Value::U64(v as u64),
        Value::I64(_) => Value::I64(v as i64),
        _ => unreachable!(),
    }
}

/// Every mutation of one metadata entry: `(description, new value)`.
fn mutations(key: &str, value: &Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    if let Some(v) = value.as_i128() {
        for m in int_values(v) {
            let nv = int_like(value, m);
            out.push((format!("{key} = {nv:?}"), nv));
        }
        // Another type than the key's: what a careless converter writes.
        out.push((format!("{key} as i32 -1"), Value::I32(-1)));
        out.push((format!("{key} as u64 2^40"), Value::U64(1 << 40)));
        out.push((format!("{key} as f32"), Value::F32(v as f32 + 0.5)));
        out.push((format!("{key} as string"), Value::String(v.to_string())));
        return out;
    }
    match value {
        Value::F32(f) => {
            for m in float_values(*f as f64) {
                out.push((format!("{key} = {m}f32"), Value::F32(m as f32)));
            }
            out.push((format!("{key} as u32"), Value::U32(7)));
        }
        Value::F64(f) => {
            for m in float_values(*f) {
                out.push((format!("{key} = {m}f64"), Value::F64(m)));
            }
        }
        Value::Bool(b) => {
            out.push((format!("{key} = {}", !b), Value::Bool(!b)));
            out.push((format!("{key} as u8 2"), Value::U8(2)));
        }
        Value::String(s) => {
            out.push((format!("{key} = \"\""), Value::String(String::new())));
            out.push((format!("{key} with control bytes"), Value::String(format!("{s}\n\x1b[31mX\r"))));
        }
        Value::Array(a) => {
            if a.is_empty() {
                return out;
            }
            if let Some(first) = a.get(0).and_then(|v| v.as_i128()) {
                // Per-layer integers (head counts) and token ids: one element changed, or the array
                // cut short.
                for m in [0, first + 1, (1 << 31) - 1, -1] {
                    let mut vals: Vec<Value> = (0..a.len()).filter_map(|i| a.get(i)).collect();
                    let i = vals.len() - 1;
                    vals[i] = int_like(&vals[i], m);
                    if let Some(arr) = array_of(&vals) {
                        out.push((format!("{key}[{i}] = {m}"), Value::Array(arr)));
                    }
                }
            }
            if a.len() > 1 {
                let vals: Vec<Value> = (0..a.len() / 2).filter_map(|i| a.get(i)).collect();
                if let Some(arr) = array_of(&vals) {
                    out.push((format!("{key} cut to {} of {}", vals.len(), a.len()), Value::Array(arr)));
                }
            }
            if let Some(Value::F32(_)) = a.get(0) {
                let mut vals: Vec<Value> = (0..a.len()).filter_map(|i| a.get(i)).collect();
                vals[0] = Value::F32(f32::NAN);
                if let Some(arr) = array_of(&vals) {
                    out.push((format!("{key}[0] = NaN"), Value::Array(arr)));
                }
            }
        }
        _ => {}
    }
    out
}

/// An array of the values' type, if the writer can hold it.
fn array_of(vals: &[Value]) -> Option<Array> {
    macro_rules! arr {
        ($var:ident) => {
            Some(Array::$var(
                vals.iter().map(|v| if let Value::$var(x) = v { x.clone() } else { unreachable!() }).collect(),
            ))
        };
    }
    match vals.first()? {
        Value::U8(_) => arr!(U8),
        Value::I8(_) => arr!(I8),
        Value::U16(_) => arr!(U16),
        Value::I16(_) => arr!(I16),
        Value::U32(_) => arr!(U32),
        Value::I32(_) => arr!(I32),
        Value::U64(_) => arr!(U64),
        Value::I64(_) => arr!(I64),
        Value::F32(_) => arr!(F32),
        Value::F64(_) => arr!(F64),
        Value::Bool(_) => arr!(Bool),
        Value::String(_) => arr!(String),
        _ => None,
    }
}

struct Case {
    fixture: PathBuf,
    key: String,
    what: String,
    value: Value,
}

/// The cases that broke `tandem run` before, always run.
const KNOWN: &[(&str, i128)] = &[
    ("rope.dimension_count", 7),
    ("rope.dimension_count", 1 << 31),
    ("rope.dimension_count", (1 << 32) - 1),
    ("block_count", (1 << 31) - 1),
    ("feed_forward_length", (1 << 32) - 1),
    ("embedding_length", (1 << 32) - 1),
    ("attention.head_count", (1 << 31) - 1),
    ("context_length", (1 << 32) - 1),
    ("expert_count", (1 << 32) - 1),
    ("expert_used_count", (1 << 32) - 1),
    ("attention.kv_lora_rank", (1 << 32) - 1),
];

fn cases(n: usize, seed: u64) -> Vec<Case> {
    let mut all = Vec::new();
    let mut known = Vec::new();
    for f in fixtures() {
        let file = GgufFile::open(&f).unwrap();
        for (key, value) in file.metadata().entries() {
            let muts = mutations(key, value);
            for (what, v) in muts {
                let is_known = KNOWN.iter().any(|&(k, kv)| {
                    key.split_once('.').is_some_and(|(_, rest)| rest == k)
                        && v.as_i128() == Some(kv)
                        && std::mem::discriminant(&v) == std::mem::discriminant(value)
                });
                let c = Case { fixture: f.clone(), key: key.clone(), what, value: v };
                if is_known {
                    known.push(c);
                } else {
                    all.push(c);
                }
            }
        }
    }
    // Values that wrap to the same one (-1 and 2^32 - 1 as u32) are one case.
    let mut seen = std::collections::HashSet::new();
    known.retain(|c| seen.insert((c.fixture.clone(), c.key.clone(), format!("{:?}", c.value))));
    all.retain(|c| seen.insert((c.fixture.clone(), c.key.clone(), format!("{:?}", c.value))));
    sample(known, all, n, seed)
}

fn write_mutant(c: &Case, path: &Path) {
    let f = GgufFile::open(&c.fixture).unwrap();
    let mut w = GgufWriter::new().version(f.version()).unwrap();
    for (k, v) in f.metadata().entries() {
        if *k == c.key {
            w.add(k, c.value.clone());
        } else {
            w.add(k, v.clone());
        }
    }
    for t in f.tensors() {
        w.add_tensor(&t.name, t.ty, &t.dims, f.tensor_data(&t.name).unwrap().to_vec()).unwrap();
    }
    w.write_file(path).unwrap();
}

#[test]
fn mutated_hyperparameters_are_refused_in_one_line_or_run() {
    let (n, seed) = cases_and_seed(1000, 0x7a6d);
    let cases = cases(n, seed);
    let what = |c: &Case| format!("{} with {}", c.fixture.file_name().unwrap().to_string_lossy(), c.what);
    run_all("hostile-metadata", &cases, what, write_mutant, seed);
}
