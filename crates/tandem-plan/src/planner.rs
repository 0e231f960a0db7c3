//! The planner: a pure function from a model's inventory, the devices and the placement flags to
//! a [`Plan`]. No device code, no weight reads.
//!
//! Precedence, as in llama.cpp: a tensor matched by a rule (`-ot`, then `--cpu-moe` /
//! `--n-cpu-moe`) goes where the first matching rule says; every other tensor follows its layer,
//! which `-ngl` or `--fit` places.
//!
//! `-ngl N` counts layers from the output end (llama.cpp's `i_gpu_start = n_layer + 1 - N`, the
//! `+ 1` being the output head): `-ngl 1` offloads only the output head, `-ngl 999` everything.
//! With several GPUs the offloaded layers are split in proportion to their budgets, as llama.cpp
//! splits by free memory. One deliberate difference: llama.cpp always keeps `token_embd` on the
//! CPU; tandem puts it with layer 0, so `-ngl 999 -ot exps=CPU` leaves only routed experts on the
//! CPU (add `-ot token_embd=CPU` for llama.cpp's choice, 0.6 GiB less VRAM for Kimi K2).

use crate::device::{human, Device, GpuBudget, GpuLayers, GIB};
use crate::fit;
use crate::memory::{compute_bytes, kv_cells, kv_layer_bytes, mla_decompressed_bytes, KvConfig, Roles};
use crate::model::{Attention, ModelInfo};
use crate::report::{ByCategory, DeviceReport, HostReport, KvReport, Plan, TensorPlacement};
use crate::rules::{Matcher, Rule};
use crate::{Error, Result};
use tandem_gguf::{GgmlType, TensorCategory};

/// `--fit-target`'s default: VRAM left free on each GPU (llama.cpp's `-fitt` default, 1024 MiB).
pub const DEFAULT_FIT_MARGIN: u64 = GIB;

/// Everything the planner is asked, besides the model.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    /// `--gpu CUDA0=96GiB ...` (or detected GPUs), sorted by ordinal.
    pub gpus: Vec<GpuBudget>,
    /// Host memory for the CPU's row of the report; `None` when unknown.
    pub host_memory: Option<u64>,
    /// `-ot` rules in command-line order, then `--cpu-moe` / `--n-cpu-moe`.
    pub rules: Vec<Rule>,
    /// `-ngl`; `None` when not given.
    pub n_gpu_layers: Option<GpuLayers>,
    /// `--fit on|off`; `None` = automatic: fit when neither `-ngl` nor `-ot` is given.
    pub fit: Option<bool>,
    /// `--fit-target`: bytes to leave free on each GPU.
    pub fit_margin: u64,
    pub kv: KvConfig,
    /// `-ub`: tokens per forward pass.
    pub ubatch: u32,
    /// `false` with `--no-mmap`.
    pub mmap: bool,
    pub mlock: bool,
    /// The matrix types the GPU runtime multiplies (its caller knows them: tandem-cuda's
    /// `MATVEC_TYPES`); matrices of other types stay on the CPU. `None`: no such limit.
    pub gpu_types: Option<Vec<GgmlType>>,
    /// Whether the CPU may run MLA attention decompressed (`--mla auto` or `decompressed`): its
    /// f32 copies of `attn_k_b` / `attn_v_b` and rebuilt keys and values count on the CPU
    /// ([`crate::memory::mla_decompressed_bytes`]).
    pub mla_decompressed: bool,
}

impl Default for PlanRequest {
    fn default() -> Self {
        PlanRequest {
            gpus: Vec::new(),
            host_memory: None,
            rules: Vec::new(),
            n_gpu_layers: None,
            fit: None,
            fit_margin: DEFAULT_FIT_MARGIN,
            kv: KvConfig::default(),
            ubatch: 512,
            mmap: true,
            mlock: false,
            gpu_types: None,
            mla_decompressed: true,
        }
    }
}

/// Places every tensor of `model` and reports the memory of every device.
pub fn plan(model: &ModelInfo, req: &PlanRequest) -> Result<Plan> {
    let h = &model.hparams;
    let devices: Vec<Device> = req.gpus.iter().map(|g| g.device).chain([Device::Cpu]).collect();
    let rule_devices: Vec<Device> = req.rules.iter().map(|r| r.resolve(&devices)).collect::<Result<_>>()?;
    let mut decisions = Vec::new();
    let mut warnings = Vec::new();

    let ctx = match req.kv.ctx {
        0 if h.n_ctx_train == 0 => {
            return Err(Error::Model {
                path: model.path.clone(),
                msg: "-c 0 asks for the training context, but the model has no context_length".into(),
            })
        }
        0 => u64::from(h.n_ctx_train),
        c => u64::from(c),
    };
    let (cells, cells_per_seq) = kv_cells(ctx, req.kv.parallel);
    let kv_layer: Vec<u64> =
        (0..h.n_layer as usize).map(|l| kv_layer_bytes(h, l, cells, &req.kv)).collect::<Result<_>>()?;

    // 1. Rules: the first matching rule in order wins.
    let mut placed = apply_rules(model, req, &rule_devices, &mut warnings);
    // Matrices of a type the CUDA runtime has no kernel for run on the CPU wherever a rule or
    // their layer would put them (the runtime keeps them there), so they take no GPU memory.
    if let (false, Some(types)) = (req.gpus.is_empty(), &req.gpu_types) {
        keep_kernelless_on_cpu(model, types, &mut placed, &mut decisions, &mut warnings);
    }

    // 2. Everything else follows its layer, placed by -ngl or by --fit.
    let ngl_given = matches!(req.n_gpu_layers, Some(GpuLayers::All | GpuLayers::Count(_)));
    let has_ot = req.rules.iter().any(|r| matches!(r.matcher, Matcher::Regex { .. }));
    let fit = match req.fit {
        Some(true) if ngl_given => {
            return Err(Error::Conflict(
                "--fit on and --n-gpu-layers both decide which layers go to the GPU; give one of them".into(),
            ))
        }
        Some(f) => f,
        None => !ngl_given && !has_ot,
    };
    if req.gpus.is_empty() {
        if matches!(req.n_gpu_layers, Some(GpuLayers::All) | Some(GpuLayers::Count(1..))) {
            warnings.push("--n-gpu-layers: no GPU declared (--gpu CUDA0=SIZE), so every layer stays on the CPU".into());
        }
        decisions.push("no GPU: every tensor on the CPU".into());
        placed.iter_mut().filter(|p| p.is_none()).for_each(|p| *p = Some(Device::Cpu));
    } else if fit {
        let ctx = fit::FitContext {
            model,
            gpus: &req.gpus,
            margin: req.fit_margin,
            kv_layer: &kv_layer,
            kv_on_gpu: req.kv.offload,
            ubatch: req.ubatch,
            cells_per_seq,
        };
        decisions.extend(fit::fit(&ctx, &mut placed));
    } else {
        let ngl = match req.n_gpu_layers {
            Some(GpuLayers::Count(n)) => n,
            _ => u32::MAX,
        };
        let (layers, output) = ngl_devices(h.n_layer, ngl, &req.gpus);
        decisions.push(describe_layers(req.n_gpu_layers, &layers, output));
        for (t, p) in model.tensors.iter().zip(placed.iter_mut()) {
            if p.is_none() {
                *p = Some(match t.layer {
                    Some(l) if l < h.n_layer => layers[l as usize],
                    _ if t.name == "token_embd.weight" => layers[0],
                    _ => output,
                });
            }
        }
    }
    let placed: Vec<Device> = placed.into_iter().map(|p| p.unwrap_or(Device::Cpu)).collect();
    if !req.rules.is_empty() {
        let n = model.tensors.iter().filter(|t| req.rules.iter().any(|r| r.matches(&t.name))).count();
        decisions.push(format!("{} placement rule(s) decided {n} tensor(s)", req.rules.len()));
    }

    // 3. KV cache: each layer's cache lives where most of that layer's attention weights are.
    let kv = KvPlacement {
        devices: (0..h.n_layer).map(|l| kv_device(model, &placed, l, req.kv.offload)).collect(),
        bytes: kv_layer,
    };

    // 4. Per-device totals, and whether they fit.
    let reports = device_reports(model, req, &devices, &placed, &kv, cells_per_seq);
    let fits = check_budgets(&reports, req, &mut warnings);
    // llama.cpp and tandem unmap what only the GPUs needed, so the host keeps the CPU row either
    // way: as page cache with mmap, as anonymous memory with --no-mmap.
    let (cpu_total, cpu_weights) =
        reports.iter().find(|r| r.name == Device::Cpu).map_or((0, 0), |r| (r.total_bytes, r.weights_bytes));
    let host = HostReport {
        rss_mmap_bytes: cpu_total,
        file_backed_bytes: if req.mmap { cpu_weights } else { 0 },
        rss_no_mmap_bytes: cpu_total,
    };
    let mla = matches!(h.attention, Attention::Mla { .. });
    let tensors = model
        .tensors
        .iter()
        .zip(&placed)
        .map(|(t, d)| TensorPlacement {
            name: t.name.clone(),
            device: *d,
            bytes: t.bytes,
            ty: t.ty,
            category: t.category,
        })
        .collect();
    Ok(Plan {
        model: model_title(model),
        devices: reports,
        tensors,
        fits,
        kv: KvReport {
            attention: h.attention,
            cells,
            cells_per_sequence: cells_per_seq,
            parallel: req.kv.parallel.max(1),
            type_k: req.kv.type_k,
            type_v: (!mla).then_some(req.kv.type_v),
            bytes: kv.bytes.iter().sum(),
        },
        ubatch: req.ubatch,
        host,
        decisions,
        warnings,
    })
}

fn model_title(model: &ModelInfo) -> String {
    let h = &model.hparams;
    let name = model.name.as_deref().map(|n| format!("{n}, ")).unwrap_or_default();
    format!(
        "{} ({name}{}, {} layers, {} tensors, {} of weights)",
        model.path,
        h.arch,
        h.n_layer,
        model.tensors.len(),
        human(model.total_bytes())
    )
}

/// Each layer's KV cache: where it lives and its bytes.
struct KvPlacement {
    devices: Vec<Device>,
    bytes: Vec<u64>,
}

/// One report per device: weights by category, KV cache, compute buffers, budget.
fn device_reports(
    model: &ModelInfo,
    req: &PlanRequest,
    devices: &[Device],
    placed: &[Device],
    kv: &KvPlacement,
    cells_per_seq: u64,
) -> Vec<DeviceReport> {
    let h = &model.hparams;
    let any_gpu_used = placed.iter().chain(&kv.devices).any(|d| d.is_gpu());
    // The output head: `output.weight`, or `token_embd.weight` when the embeddings are tied.
    let head =
        if model.tensors.iter().any(|t| t.name == "output.weight") { "output.weight" } else { "token_embd.weight" };
    let mut reports = Vec::with_capacity(devices.len());
    for &dev in devices {
        let mut by_category = ByCategory::default();
        let mut roles = Roles { staging: dev == Device::Cpu && any_gpu_used, ..Roles::default() };
        for (t, _) in model.tensors.iter().zip(placed).filter(|(_, d)| **d == dev) {
            by_category.add(t.category, t.bytes);
            match t.category {
                TensorCategory::Attention => roles.attention = true,
                TensorCategory::DenseFfn | TensorCategory::SharedExperts => roles.ffn = true,
                TensorCategory::RoutedExperts => roles.routed_experts = true,
                _ => {}
            }
            roles.output |= t.name == head;
        }
        let kv_bytes: u64 = kv.devices.iter().zip(&kv.bytes).filter(|(d, _)| **d == dev).map(|(_, b)| b).sum();
        let mut compute = compute_bytes(h, req.ubatch, cells_per_seq, roles);
        if dev == Device::Cpu && req.mla_decompressed {
            let on_cpu = model.tensors.iter().zip(placed).filter(|(_, d)| **d == Device::Cpu).map(|(t, _)| t);
            compute += mla_decompressed_bytes(h, on_cpu, cells_per_seq);
        }
        let weights = by_category.total();
        let budget = match dev {
            Device::Cpu => req.host_memory,
            gpu => req.gpus.iter().find(|g| g.device == gpu).map(|g| g.bytes),
        };
        reports.push(DeviceReport {
            name: dev,
            budget_bytes: budget,
            weights_bytes: weights,
            kv_bytes,
            compute_bytes: compute,
            total_bytes: weights + kv_bytes + compute,
            by_category,
        });
    }
    reports
}

/// GPUs must hold everything on them; the host must hold what cannot be paged back in from the
/// file (all of it with `--no-mmap` or `--mlock`). Warns about every shortfall.
fn check_budgets(reports: &[DeviceReport], req: &PlanRequest, warnings: &mut Vec<String>) -> bool {
    let mut fits = true;
    for r in reports {
        let Some(budget) = r.budget_bytes else { continue };
        let cpu_pageable = r.name == Device::Cpu && req.mmap && !req.mlock;
        let must_hold = if cpu_pageable { r.total_bytes - r.weights_bytes } else { r.total_bytes };
        if must_hold > budget {
            fits = false;
            warnings.push(format!(
                "{}: needs {}, {} available (over by {})",
                r.name,
                human(must_hold),
                human(budget),
                human(must_hold - budget)
            ));
        } else if r.total_bytes > budget {
            warnings.push(format!(
                "CPU: {} of weights with {} of host memory: mmap will page CPU weights in from disk as they are used (slow); --no-mmap or --mlock would not fit",
                human(r.weights_bytes),
                human(budget)
            ));
        }
    }
    fits
}

/// The device of layer `l`'s KV cache: the CPU with `--no-kv-offload`, else the device holding
/// most of the layer's attention bytes (any of its tensors if it has no attention).
fn kv_device(model: &ModelInfo, placed: &[Device], l: u32, offload: bool) -> Device {
    if !offload {
        return Device::Cpu;
    }
    let mut bytes: Vec<(Device, u64)> = Vec::new();
    let layer = model.tensors.iter().zip(placed).filter(|(t, _)| t.layer == Some(l));
    let attention: Vec<_> = layer.clone().filter(|(t, _)| t.category == TensorCategory::Attention).collect();
    let pick = if attention.is_empty() { layer.collect() } else { attention };
    for (t, d) in pick {
        match bytes.iter_mut().find(|(bd, _)| bd == d) {
            Some((_, b)) => *b += t.bytes,
            None => bytes.push((*d, t.bytes)),
        }
    }
    // Ties go to the GPU (devices sort GPUs first).
    bytes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    bytes.first().map_or(Device::Cpu, |(d, _)| *d)
}

/// Applies the rules; returns the device of every tensor a rule matched and warns about rules
/// that decide nothing.
fn apply_rules(
    model: &ModelInfo,
    req: &PlanRequest,
    devs: &[Device],
    warnings: &mut Vec<String>,
) -> Vec<Option<Device>> {
    let mut won = vec![0usize; req.rules.len()];
    let mut shadowed = vec![0usize; req.rules.len()];
    let placed = model
        .tensors
        .iter()
        .map(|t| {
            let mut first = None;
            for (i, _) in req.rules.iter().enumerate().filter(|(_, r)| r.matches(&t.name)) {
                match first {
                    None => {
                        won[i] += 1;
                        first = Some(devs[i]);
                    }
                    Some(_) => shadowed[i] += 1,
                }
            }
            first
        })
        .collect();
    for (i, r) in req.rules.iter().enumerate().filter(|(i, _)| won[*i] == 0) {
        warnings.push(if shadowed[i] > 0 {
            format!("{}: every tensor it matches was already placed by an earlier rule", r.source)
        } else {
            format!("{}: matches no tensor", r.source)
        });
    }
    placed
}

/// Places on the CPU every matrix (two or more dimensions, as the runtime uploads them) whose type
/// is not one of `gpu_types` (the types the GPU runtime multiplies; it keeps a matrix of any other
/// type on the CPU wherever the plan puts it), including those a rule sent to a GPU, and says so.
fn keep_kernelless_on_cpu(
    model: &ModelInfo,
    gpu_types: &[GgmlType],
    placed: &mut [Option<Device>],
    decisions: &mut Vec<String>,
    warnings: &mut Vec<String>,
) {
    let mut types: Vec<(GgmlType, usize)> = Vec::new();
    let (mut n, mut bytes) = (0usize, 0u64);
    let mut overruled: Vec<&str> = Vec::new();
    for (t, p) in model.tensors.iter().zip(placed.iter_mut()) {
        if t.dims.len() < 2 || gpu_types.contains(&t.ty) || *p == Some(Device::Cpu) {
            continue;
        }
        if p.is_some() {
            overruled.push(&t.name);
        }
        *p = Some(Device::Cpu);
        n += 1;
        bytes += t.bytes;
        match types.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, k)) => *k += 1,
            None => types.push((t.ty, 1)),
        }
    }
    if n == 0 {
        return;
    }
    let list: Vec<String> = types.iter().map(|(ty, k)| format!("{ty} x {k}")).collect();
    decisions.push(format!(
        "no CUDA kernel for {}: those {n} matrices ({}) run on the CPU",
        list.join(", "),
        human(bytes)
    ));
    if let Some(first) = overruled.first() {
        warnings.push(format!(
            "{} matrices a rule sent to a GPU (first {first}) have a type with no CUDA kernel: they run on the CPU",
            overruled.len()
        ));
    }
}

/// The device of every layer and of the output head for `-ngl ngl`, as llama.cpp's
/// `llama_model::load_tensors` assigns them.
pub fn ngl_devices(n_layer: u32, ngl: u32, gpus: &[GpuBudget]) -> (Vec<Device>, Device) {
    let n_all = u64::from(n_layer);
    let i_gpu_start = (n_all + 1).saturating_sub(u64::from(ngl));
    let act = u64::from(ngl).min(n_all + 1);
    let total: u128 = gpus.iter().map(|g| u128::from(g.bytes)).sum();
    let device = |il: u64| -> Device {
        if gpus.is_empty() || il < i_gpu_start {
            return Device::Cpu;
        }
        // upper_bound over the cumulative budget fractions, in exact integer arithmetic.
        let pos = u128::from(il - i_gpu_start);
        let mut cum = 0u128;
        for g in gpus {
            cum += u128::from(g.bytes);
            if pos * total < cum * u128::from(act) {
                return g.device;
            }
        }
        gpus[gpus.len() - 1].device
    };
    ((0..n_all).map(device).collect(), device(n_all))
}

/// "--n-gpu-layers 999: layers 0-60 and the output head on CUDA0".
fn describe_layers(ngl: Option<GpuLayers>, layers: &[Device], output: Device) -> String {
    let flag = match ngl {
        Some(GpuLayers::Count(n)) => format!("--n-gpu-layers {n}"),
        Some(GpuLayers::All) => "--n-gpu-layers all".into(),
        _ => "--n-gpu-layers all (the default without --fit)".into(),
    };
    let mut parts = Vec::new();
    let mut start = 0;
    for i in 1..=layers.len() {
        if i == layers.len() || layers[i] != layers[start] {
            let range = if i - 1 == start { format!("layer {start}") } else { format!("layers {start}-{}", i - 1) };
            parts.push(format!("{range} on {}", layers[start]));
            start = i;
        }
    }
    parts.push(format!("the output head on {output}"));
    format!("{flag}: {}", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::GIB;

    fn gpus(sizes: &[u64]) -> Vec<GpuBudget> {
        sizes.iter().enumerate().map(|(i, &s)| GpuBudget { device: Device::Cuda(i as u32), bytes: s * GIB }).collect()
    }

    #[test]
    fn ngl_counts_from_the_output_end() {
        let g = gpus(&[96]);
        let cpu = Device::Cpu;
        let gpu = Device::Cuda(0);
        assert_eq!(ngl_devices(4, 0, &g), (vec![cpu; 4], cpu));
        // -ngl 1: only the output head.
        assert_eq!(ngl_devices(4, 1, &g), (vec![cpu; 4], gpu));
        assert_eq!(ngl_devices(4, 2, &g), (vec![cpu, cpu, cpu, gpu], gpu));
        assert_eq!(ngl_devices(4, 5, &g), (vec![gpu; 4], gpu));
        assert_eq!(ngl_devices(4, 999, &g), (vec![gpu; 4], gpu));
        assert_eq!(ngl_devices(4, 999, &[]), (vec![cpu; 4], cpu));
    }

    #[test]
    fn ngl_splits_gpus_by_budget() {
        // 3 layers + output over 24 and 72 GiB: fractions 0, .25, .5, .75 against split 0.25.
        let (layers, out) = ngl_devices(3, 999, &gpus(&[24, 72]));
        assert_eq!(layers, [Device::Cuda(0), Device::Cuda(1), Device::Cuda(1)]);
        assert_eq!(out, Device::Cuda(1));
        assert_eq!(
            describe_layers(Some(GpuLayers::Count(999)), &layers, out),
            "--n-gpu-layers 999: layer 0 on CUDA0, layers 1-2 on CUDA1, the output head on CUDA1"
        );
    }
}
