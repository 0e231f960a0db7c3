//! `--fit`: the automatic placement used when neither `-ngl` nor `-ot` is given and a GPU exists.
//!
//! 1. Each GPU's usable memory is its budget minus the margin (`--fit-target`) minus its compute
//!    buffers.
//! 2. Everything but routed experts goes to the GPUs first, with each layer's KV cache: the
//!    embeddings, then layer 0, 1, ... , then the output head, filling CUDA0, then CUDA1, ... .
//!    What does not fit (never the case for DeepSeek/Kimi on one 24 GiB+ GPU) stays on the CPU.
//! 3. Then whole routed-expert layers, from the last layer down, on any GPU that still has room:
//!    the layers nearest the output go first, so the result is `--n-cpu-moe N` for some N.
//! 4. The rest on the CPU. Tensors already placed by a rule (`--cpu-moe`, `--n-cpu-moe`, or
//!    `-ot` with an explicit `--fit on`) are left where the rule put them.
//!
//! Every step says what it chose and why, in the plan's `decisions`.

use crate::device::{human, Device, GpuBudget};
use crate::memory::{compute_bytes, Roles};
use crate::model::{ModelInfo, TensorEntry};
use tandem_gguf::TensorCategory;

pub(crate) struct FitContext<'a> {
    pub model: &'a ModelInfo,
    pub gpus: &'a [GpuBudget],
    pub margin: u64,
    /// KV bytes of each layer.
    pub kv_layer: &'a [u64],
    /// `false` with `--no-kv-offload`: the KV cache stays on the CPU and costs no VRAM.
    pub kv_on_gpu: bool,
    pub ubatch: u32,
    pub cells_per_seq: u64,
}

/// A set of tensors placed together and what they cost on a GPU.
struct Group {
    tensors: Vec<usize>,
    bytes: u64,
}

/// The not yet placed tensors that `pick` selects; `extra` bytes (a KV cache) travel with them.
fn group(model: &ModelInfo, placed: &[Option<Device>], pick: &dyn Fn(&TensorEntry) -> bool, extra: u64) -> Group {
    let tensors: Vec<usize> =
        model.tensors.iter().enumerate().filter(|(i, t)| placed[*i].is_none() && pick(t)).map(|(i, _)| i).collect();
    let bytes = tensors.iter().map(|&i| model.tensors[i].bytes).sum::<u64>() + extra;
    Group { tensors, bytes }
}

/// Fills `placed` (leaving rule-placed tensors alone) and returns the reasons.
pub(crate) fn fit(cx: &FitContext, placed: &mut [Option<Device>]) -> Vec<String> {
    let h = &cx.model.hparams;
    let mut why = Vec::new();
    let base_roles = Roles { attention: true, ffn: true, output: true, ..Roles::default() };
    let base_compute = compute_bytes(h, cx.ubatch, cx.cells_per_seq, base_roles);
    let expert_compute =
        compute_bytes(h, cx.ubatch, cx.cells_per_seq, Roles { routed_experts: true, ..Roles::default() });
    let mut left: Vec<u64> = cx.gpus.iter().map(|g| g.bytes.saturating_sub(cx.margin + base_compute)).collect();
    for (g, l) in cx.gpus.iter().zip(&left) {
        why.push(format!(
            "--fit: {} has {} usable = {} budget - {} margin - {} compute buffers",
            g.device,
            human(*l),
            human(g.bytes),
            human(cx.margin),
            human(base_compute)
        ));
    }

    // Step 2: the non-expert groups, in layer order.
    let n_layer = h.n_layer as usize;
    let not_expert = |t: &TensorEntry| t.category != TensorCategory::RoutedExperts;
    let mut base = vec![group(cx.model, placed, &|t| t.name == "token_embd.weight", 0)];
    for l in 0..n_layer {
        let kv = if cx.kv_on_gpu { cx.kv_layer[l] } else { 0 };
        base.push(group(cx.model, placed, &|t| t.layer == Some(l as u32) && not_expert(t), kv));
    }
    let output = |t: &TensorEntry| t.name != "token_embd.weight" && t.layer.is_none_or(|l| l as usize >= n_layer);
    base.push(group(cx.model, placed, &output, 0));

    let mut gpu = 0;
    let mut on_gpu = vec![0u64; cx.gpus.len()];
    let mut first_cpu_group = None;
    for (gi, g) in base.iter().enumerate() {
        while gpu < cx.gpus.len() && left[gpu] < g.bytes {
            gpu += 1;
        }
        let dev = if gpu < cx.gpus.len() {
            left[gpu] -= g.bytes;
            on_gpu[gpu] += g.bytes;
            cx.gpus[gpu].device
        } else {
            first_cpu_group.get_or_insert(gi);
            Device::Cpu
        };
        for &i in &g.tensors {
            placed[i] = Some(dev);
        }
    }
    for (g, b) in cx.gpus.iter().zip(&on_gpu).filter(|(_, b)| **b > 0) {
        why.push(format!("--fit: {} of non-expert weights and KV cache on {}", human(*b), g.device));
    }
    match first_cpu_group {
        None => why.push("--fit: every non-expert weight and the whole KV cache are on the GPU(s)".into()),
        // Group 0 is the embeddings, 1..=n_layer the layers, n_layer + 1 the output head.
        Some(gi) => why.push(format!(
            "--fit: the GPUs are full from {} on: those non-expert weights stay on the CPU",
            match gi {
                0 => "the embeddings".to_string(),
                gi if gi <= n_layer => format!("layer {}", gi - 1),
                _ => "the output head".to_string(),
            }
        )),
    }

    // Step 3: whole routed-expert layers from the output end.
    let mut has_experts = vec![false; cx.gpus.len()];
    let mut on_gpu_layers: Vec<u32> = Vec::new();
    let mut stopped_at = None;
    let mut any_experts = false;
    for l in (0..n_layer).rev() {
        let experts = |t: &TensorEntry| t.layer == Some(l as u32) && t.category == TensorCategory::RoutedExperts;
        let g = group(cx.model, placed, &experts, 0);
        if g.tensors.is_empty() {
            continue;
        }
        any_experts = true;
        let need = |k: usize| g.bytes + if has_experts[k] { 0 } else { expert_compute };
        let Some(k) = (0..cx.gpus.len()).find(|&k| left[k] >= need(k)) else {
            let best = left.iter().copied().max().unwrap_or(0);
            stopped_at = Some((l, g.bytes, best));
            break;
        };
        left[k] -= need(k);
        has_experts[k] = true;
        for &i in &g.tensors {
            placed[i] = Some(cx.gpus[k].device);
        }
        on_gpu_layers.push(l as u32);
    }
    if let (Some(&hi), Some(&lo)) = (on_gpu_layers.first(), on_gpu_layers.last()) {
        why.push(format!("--fit: routed experts of {} layer(s), {lo}-{hi}, on the GPU(s)", on_gpu_layers.len()));
    }
    if let Some((l, bytes, best)) = stopped_at {
        why.push(format!(
            "--fit: routed experts of layer {l} need {} but at most {} is left, so layers 0-{l} keep theirs on the CPU (as --n-cpu-moe {})",
            human(bytes),
            human(best),
            l + 1
        ));
    } else if any_experts {
        why.push("--fit: every routed expert fits on the GPU(s)".into());
    }
    for p in placed.iter_mut().filter(|p| p.is_none()) {
        *p = Some(Device::Cpu);
    }
    why
}
