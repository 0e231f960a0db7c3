//! `tandem inspect`: what a GGUF model is, from its headers alone (no tensor data is read).

use serde::Serialize;
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use tandem_gguf::{Array, GgmlType, GgufModel, TensorCategory, Value};

/// Arrays longer than this are summarized (first elements and the length).
const ARRAY_SUMMARY_AFTER: usize = 16;
const ARRAY_HEAD: usize = 8;

#[derive(Serialize)]
pub struct Report {
    pub path: String,
    pub gguf_version: u32,
    pub architecture: Option<String>,
    pub name: Option<String>,
    /// For deepseek2: "mla" (attn_k_b/attn_v_b) or "legacy" (attn_kv_b).
    pub attention_flavour: Option<&'static str>,
    pub shards: Vec<ShardReport>,
    pub tensor_count: usize,
    pub parameter_count: u64,
    pub tensor_bytes: u64,
    pub file_bytes: u64,
    pub hyperparameters: BTreeMap<String, Json>,
    pub metadata: BTreeMap<String, Json>,
    pub tensors: Vec<TensorRow>,
    pub by_type: Vec<Total>,
    pub by_category: Vec<Total>,
}

#[derive(Serialize)]
pub struct ShardReport {
    pub path: String,
    pub tensor_count: usize,
    pub kv_count: usize,
    pub file_bytes: u64,
}

#[derive(Serialize)]
pub struct TensorRow {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: GgmlType,
    /// ggml order: shape[0] is the row length.
    pub shape: Vec<u64>,
    pub bytes: u64,
    pub shard: usize,
    pub category: TensorCategory,
}

#[derive(Serialize, Default, Clone)]
pub struct Total {
    pub name: String,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
}

impl Report {
    pub fn new(path: &str, model: &GgufModel) -> Report {
        let md = model.metadata();
        let arch = md.opt_str("general.architecture").ok().flatten().map(str::to_string);
        let prefix = arch.as_ref().map(|a| format!("{a}."));
        let mut hyperparameters = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (k, v) in md.entries() {
            let is_hparam = prefix.as_ref().is_some_and(|p| k.starts_with(p.as_str()));
            let map = if is_hparam { &mut hyperparameters } else { &mut metadata };
            map.insert(k.clone(), value_json(v));
        }
        let mut tensors = Vec::with_capacity(model.tensor_count());
        let mut by_type: BTreeMap<GgmlType, Total> = BTreeMap::new();
        let mut by_category: BTreeMap<TensorCategory, Total> = BTreeMap::new();
        for t in model.tensors() {
            let (info, n) = (t.info, t.info.n_elements());
            let category = TensorCategory::of(&info.name);
            for (total, name) in [
                (by_type.entry(info.ty).or_default(), info.ty.name()),
                (by_category.entry(category).or_default(), category.key()),
            ] {
                total.name = name.to_string();
                total.tensors += 1;
                total.parameters += n;
                total.bytes += info.size;
            }
            tensors.push(TensorRow {
                name: info.name.clone(),
                ty: info.ty,
                shape: info.dims.clone(),
                bytes: info.size,
                shard: t.shard,
                category,
            });
        }
        let attention_flavour = (arch.as_deref() == Some("deepseek2")).then(|| {
            if model.tensors().any(|t| t.info.name.ends_with("attn_kv_b.weight")) {
                "legacy"
            } else {
                "mla"
            }
        });
        let shards: Vec<ShardReport> = model
            .shards()
            .iter()
            .map(|s| ShardReport {
                path: s.path().to_string(),
                tensor_count: s.tensors().len(),
                kv_count: s.metadata().len(),
                file_bytes: s.file_size(),
            })
            .collect();
        Report {
            path: path.to_string(),
            gguf_version: model.shards()[0].version(),
            name: md.opt_str("general.name").ok().flatten().map(str::to_string),
            architecture: arch,
            attention_flavour,
            tensor_count: tensors.len(),
            parameter_count: tensors.iter().map(|t| t.shape.iter().product::<u64>()).sum(),
            tensor_bytes: tensors.iter().map(|t| t.bytes).sum(),
            file_bytes: shards.iter().map(|s| s.file_bytes).sum(),
            shards,
            hyperparameters,
            metadata,
            tensors,
            by_type: by_type.into_values().collect(),
            by_category: by_category.into_values().collect(),
        }
    }

    /// The human-readable report. `with_tensors` prints the per-tensor table.
    pub fn to_text(&self, with_tensors: bool) -> String {
        let mut s = String::new();
        let _ = self.write_text(&mut s, with_tensors);
        s
    }

    fn write_text(&self, s: &mut String, with_tensors: bool) -> std::fmt::Result {
        writeln!(s, "model: {}", self.path)?;
        writeln!(
            s,
            "  GGUF v{}, {} shard(s), {} in files, {} tensors",
            self.gguf_version,
            self.shards.len(),
            bytes(self.file_bytes),
            self.tensor_count
        )?;
        writeln!(s, "  architecture: {}", self.architecture.as_deref().unwrap_or("(none)"))?;
        if let Some(f) = self.attention_flavour {
            let how = if f == "mla" { "attn_k_b + attn_v_b" } else { "attn_kv_b" };
            writeln!(s, "  attention: {f} ({how})")?;
        }
        if let Some(n) = &self.name {
            writeln!(s, "  name: {n}")?;
        }
        writeln!(
            s,
            "  parameters: {} ({}), tensor data: {}, {:.2} bits per weight",
            params(self.parameter_count),
            self.parameter_count,
            bytes(self.tensor_bytes),
            self.tensor_bytes as f64 * 8.0 / self.parameter_count.max(1) as f64
        )?;
        if self.shards.len() > 1 {
            writeln!(s, "\nshards:")?;
            for (i, sh) in self.shards.iter().enumerate() {
                writeln!(
                    s,
                    "  {i:>3}  {}  {} tensors, {} keys, {}",
                    sh.path,
                    sh.tensor_count,
                    sh.kv_count,
                    bytes(sh.file_bytes)
                )?;
            }
        }
        writeln!(s, "\nhyperparameters:")?;
        for (k, v) in &self.hyperparameters {
            writeln!(s, "  {k} = {}", json_text(v))?;
        }
        writeln!(s, "\nmetadata:")?;
        for (k, v) in &self.metadata {
            writeln!(s, "  {k} = {}", json_text(v))?;
        }
        if with_tensors {
            let w = self.tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
            writeln!(s, "\ntensors:")?;
            writeln!(s, "  {:<w$}  {:<7}  {:<22}  {:>12}  shard", "name", "type", "shape", "bytes")?;
            for t in &self.tensors {
                let shape = t.shape.iter().map(u64::to_string).collect::<Vec<_>>().join(" x ");
                writeln!(s, "  {:<w$}  {:<7}  {:<22}  {:>12}  {}", t.name, t.ty.name(), shape, t.bytes, t.shard)?;
            }
        }
        for (title, totals) in [("type", &self.by_type), ("category", &self.by_category)] {
            writeln!(s, "\ntotals by {title}:")?;
            writeln!(s, "  {:<18} {:>8} {:>14} {:>12} {:>7}", title, "tensors", "parameters", "bytes", "share")?;
            for t in totals {
                writeln!(
                    s,
                    "  {:<18} {:>8} {:>14} {:>12} {:>6.2}%",
                    label(&t.name),
                    t.tensors,
                    params(t.parameters),
                    bytes(t.bytes),
                    100.0 * t.bytes as f64 / self.tensor_bytes.max(1) as f64
                )?;
            }
        }
        Ok(())
    }
}

fn label(key: &str) -> &str {
    TensorCategory::ALL.iter().find(|c| c.key() == key).map_or(key, |c| c.label())
}

/// A metadata value as JSON; long arrays become `{"type", "len", "head"}`.
fn value_json(v: &Value) -> Json {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        // Through its shortest decimal form, so 1e-5f32 is not shown as 9.999999747378752e-6.
        Value::F32(x) => x.to_string().parse::<f64>().map_or(Json::Null, |f| json!(f)),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Array(a) => array_json(a),
    }
}

fn array_json(a: &Array) -> Json {
    let n = if a.len() > ARRAY_SUMMARY_AFTER { ARRAY_HEAD } else { a.len() };
    let items: Vec<Json> = (0..n).filter_map(|i| a.get(i)).map(|v| value_json(&v)).collect();
    if a.len() > ARRAY_SUMMARY_AFTER {
        json!({"type": format!("array of {}", a.elem_type().name()), "len": a.len(), "head": items})
    } else {
        Json::Array(items)
    }
}

fn json_text(v: &Json) -> String {
    match v {
        Json::Object(o) if o.contains_key("len") => {
            let head: Vec<String> = o["head"].as_array().into_iter().flatten().map(json_text).collect();
            format!("[{}, ...] ({} elements, {})", head.join(", "), o["len"], o["type"].as_str().unwrap_or(""))
        }
        Json::String(s) if s.chars().count() > 120 => {
            let cut: String = s.chars().take(120).collect();
            format!("{:?}... ({} bytes)", cut, s.len())
        }
        other => other.to_string(),
    }
}

/// Bytes with a binary unit.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

/// A parameter count as llama.cpp prints it (K, M, B, T).
pub fn params(n: u64) -> String {
    let x = n as f64;
    match n {
        0..1_000 => format!("{n}"),
        1_000..1_000_000 => format!("{:.2} K", x / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2} M", x / 1e6),
        1_000_000_000..1_000_000_000_000 => format!("{:.2} B", x / 1e9),
        _ => format!("{:.2} T", x / 1e12),
    }
}
