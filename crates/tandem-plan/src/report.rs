//! The plan as data (serializable, printed as JSON by `tandem plan --json`) and as the
//! memory-layout table printed at load and by `tandem plan`.

use crate::device::{human, in_unit, unit_for, Device};
use crate::model::Attention;
use serde::Serialize;
use std::fmt::Write as _;
use tandem_gguf::{GgmlType, TensorCategory};

/// Bytes of weights per category on one device. `other` holds what fits no category
/// (`rope_freqs`, MTP `nextn.*`), so the categories always add up to the weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ByCategory {
    pub attention: u64,
    pub routed_experts: u64,
    pub shared_experts: u64,
    pub dense_ffn: u64,
    pub embeddings_output: u64,
    pub norms_router: u64,
    pub other: u64,
}

impl ByCategory {
    pub fn add(&mut self, c: TensorCategory, bytes: u64) {
        *self.slot(c) += bytes;
    }

    pub fn get(&self, c: TensorCategory) -> u64 {
        let mut copy = *self; // ByCategory is 7 words: copying beats a second match
        *copy.slot(c)
    }

    fn slot(&mut self, c: TensorCategory) -> &mut u64 {
        match c {
            TensorCategory::Attention => &mut self.attention,
            TensorCategory::RoutedExperts => &mut self.routed_experts,
            TensorCategory::SharedExperts => &mut self.shared_experts,
            TensorCategory::DenseFfn => &mut self.dense_ffn,
            TensorCategory::EmbeddingsOutput => &mut self.embeddings_output,
            TensorCategory::NormsRouter => &mut self.norms_router,
            TensorCategory::Other => &mut self.other,
        }
    }

    pub fn total(&self) -> u64 {
        TensorCategory::ALL.iter().map(|&c| self.get(c)).sum()
    }
}

/// One device's share of the plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceReport {
    pub name: Device,
    /// `--gpu CUDA0=SIZE` for a GPU; host memory for the CPU (`None` when unknown).
    pub budget_bytes: Option<u64>,
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    pub compute_bytes: u64,
    /// weights + KV + compute.
    pub total_bytes: u64,
    pub by_category: ByCategory,
}

/// Where one tensor goes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorPlacement {
    pub name: String,
    pub device: Device,
    pub bytes: u64,
    #[serde(rename = "type")]
    pub ty: GgmlType,
    pub category: TensorCategory,
}

/// The KV cache as planned.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvReport {
    pub attention: Attention,
    pub cells: u64,
    pub cells_per_sequence: u64,
    pub parallel: u32,
    pub type_k: GgmlType,
    /// `None` for MLA, which has no V cache.
    pub type_v: Option<GgmlType>,
    pub bytes: u64,
}

/// Host memory the process is expected to hold once loaded.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostReport {
    /// With mmap: CPU weights as file-backed page cache (shared, reclaimable) + host KV + buffers.
    pub rss_mmap_bytes: u64,
    /// The file-backed part of `rss_mmap_bytes`.
    pub file_backed_bytes: u64,
    /// With `--no-mmap`: all of it anonymous memory.
    pub rss_no_mmap_bytes: u64,
}

/// A complete placement: a device for every tensor, and what each device holds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub model: String,
    /// GPUs in order, then the CPU.
    pub devices: Vec<DeviceReport>,
    /// Every tensor, in file order.
    pub tensors: Vec<TensorPlacement>,
    /// Every GPU within its budget, and the host within its memory where it must be (see warnings).
    pub fits: bool,
    pub kv: KvReport,
    pub ubatch: u32,
    pub host: HostReport,
    /// How the placement was decided: the mode, and `--fit`'s reasons.
    pub decisions: Vec<String>,
    pub warnings: Vec<String>,
}

impl Plan {
    pub fn device(&self, d: Device) -> Option<&DeviceReport> {
        self.devices.iter().find(|r| r.name == d)
    }

    /// The device of the tensor named `name`.
    pub fn device_of(&self, name: &str) -> Option<Device> {
        self.tensors.iter().find(|t| t.name == name).map(|t| t.device)
    }

    /// The memory-layout table; `tensors` adds one line per tensor.
    pub fn to_text(&self, tensors: bool) -> String {
        let mut s = String::new();
        // One unit for the whole table, chosen by the largest device total (not the budgets, so
        // a tiny model on a big machine still shows its sizes).
        let unit = unit_for(self.devices.iter().map(|d| d.total_bytes).max().unwrap_or(0));
        let gib = |b: u64| in_unit(b, unit);
        let kv = &self.kv;
        let cache = match kv.type_v {
            None => format!("K {} (MLA latent; V is a view of K, no V cache)", kv.type_k),
            Some(v) => format!("K {} / V {}", kv.type_k, v),
        };
        let _ = writeln!(s, "plan for {}", self.model);
        let _ = writeln!(
            s,
            "  context {} cells ({} sequence(s) x {}), {cache}, micro-batch {} tokens",
            kv.cells, kv.parallel, kv.cells_per_sequence, self.ubatch
        );
        for d in &self.decisions {
            let _ = writeln!(s, "  {d}");
        }
        let _ = writeln!(s);
        let w = 13;
        let _ = writeln!(
            s,
            "{:<8}{:>w$}{:>w$}{:>w$}{:>w$}{:>w$}{:>w$}",
            "device", "weights", "KV cache", "compute", "total", "budget", "free"
        );
        for d in &self.devices {
            let (budget, free) = match d.budget_bytes {
                Some(b) if b >= d.total_bytes => (human(b), human(b - d.total_bytes)),
                Some(b) => (human(b), format!("-{}", human(d.total_bytes - b))),
                None => ("?".into(), "?".into()),
            };
            let _ = writeln!(
                s,
                "{:<8}{:>w$}{:>w$}{:>w$}{:>w$}{:>w$}{:>w$}",
                d.name.to_string(),
                gib(d.weights_bytes),
                gib(d.kv_bytes),
                gib(d.compute_bytes),
                gib(d.total_bytes),
                budget,
                free
            );
        }
        let _ = writeln!(s);
        let _ = write!(s, "{:<20}", "weights by category");
        for d in &self.devices {
            let _ = write!(s, "{:>w$}", d.name.to_string());
        }
        let _ = writeln!(s, "{:>w$}", "all");
        for c in TensorCategory::ALL {
            let all: u64 = self.devices.iter().map(|d| d.by_category.get(c)).sum();
            if all == 0 && c == TensorCategory::Other {
                continue;
            }
            let _ = write!(s, "  {:<18}", c.label());
            for d in &self.devices {
                let _ = write!(s, "{:>w$}", gib(d.by_category.get(c)));
            }
            let _ = writeln!(s, "{:>w$}", gib(all));
        }
        let all: u64 = self.devices.iter().map(|d| d.weights_bytes).sum();
        let _ = write!(s, "  {:<18}", "total");
        for d in &self.devices {
            let _ = write!(s, "{:>w$}", gib(d.weights_bytes));
        }
        let _ = writeln!(s, "{:>w$}", gib(all));
        let h = &self.host;
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "host memory: {} with mmap ({} of it file-backed page cache, reclaimable), {} with --no-mmap",
            human(h.rss_mmap_bytes),
            human(h.file_backed_bytes),
            human(h.rss_no_mmap_bytes)
        );
        let paged = self
            .device(Device::Cpu)
            .and_then(|c| c.budget_bytes.filter(|&b| b < c.total_bytes).map(|b| c.total_bytes - b))
            .filter(|_| self.fits && self.host.file_backed_bytes > 0);
        match paged {
            Some(over) => {
                let _ = writeln!(s, "fits: yes, with mmap paging about {} of CPU weights in from disk", human(over));
            }
            None => {
                let _ = writeln!(s, "fits: {}", if self.fits { "yes" } else { "no" });
            }
        }
        for w in &self.warnings {
            let _ = writeln!(s, "warning: {w}");
        }
        if tensors {
            let _ = writeln!(s);
            let width = self.tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
            let _ = writeln!(s, "{:<width$}  {:<8}{:<8}{:>14}", "name", "device", "type", "bytes");
            for t in &self.tensors {
                let _ = writeln!(s, "{:<width$}  {:<8}{:<8}{:>14}", t.name, t.device.to_string(), t.ty.name(), t.bytes);
            }
        }
        s
    }

    /// The plan as pretty JSON (`tandem plan --json`).
    pub fn to_json(&self) -> String {
        // Serializing plain structs of numbers and strings cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_add_up() {
        let mut c = ByCategory::default();
        c.add(TensorCategory::RoutedExperts, 10);
        c.add(TensorCategory::Other, 1);
        c.add(TensorCategory::RoutedExperts, 5);
        assert_eq!(c.get(TensorCategory::RoutedExperts), 15);
        assert_eq!(c.total(), 16);
        let json = serde_json::to_value(c).unwrap();
        let keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
        for k in ["attention", "routed_experts", "shared_experts", "dense_ffn", "embeddings_output", "norms_router"] {
            assert!(keys.contains(&k), "{k}");
        }
    }
}
