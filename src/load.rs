//! The one place a model is opened, for every command (`run`, `logits`, `bench`, `serve`):
//! a [`LoadSpec`] in (built from each command's flags by [`LoadSpec::from_args`] or by hand),
//! an [`Opened`] model out, then [`Opened::bring_up`] makes the executor for a thread count —
//! the placement plan made once and run as made, the threads, repacking, reading ahead — and the
//! context on it. What it did comes back as lines ([`Up::notes`]) for the command to print.

use crate::cli::{ModelArgs, PlacementArgs, RuntimeArgs};
use anyhow::{bail, Context as _};
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{CacheType, Context, ContextParams, Exec, MlaMode, Model};
use tandem_plan::{Device, GpuBudget, GpuLayers, ModelInfo, Plan, PlanRequest, Rule};

/// Whether weights are asked for ahead of use (`--read-ahead`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum ReadAhead {
    /// When the model is mapped from its files and the CPU's part of it exceeds the memory
    /// this process may take (MemAvailable, or a container's memory limit).
    #[default]
    Auto,
    On,
    Off,
}

/// How to open a model and run it, whatever command asks.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// The model file (any shard of a split model); `None`: the built-in demo model.
    pub path: Option<PathBuf>,
    pub mmap: bool,
    pub mlock: bool,
    /// Pack the CPU's matrices for the packed kernels at load.
    pub repack: bool,
    pub read_ahead: ReadAhead,
    /// Threads for single tokens and for batches.
    pub threads: usize,
    pub threads_batch: usize,
    /// Positions of all sequences together (0: the model's training context).
    pub ctx_total: usize,
    /// Sequences that share `ctx_total` (serve's slots); each gets an equal part.
    pub n_seq: usize,
    pub n_ubatch: usize,
    pub cache_type_k: CacheType,
    pub cache_type_v: CacheType,
    pub mla: MlaMode,
    /// The planner's request (placement, budgets, cache); its GPU part is used only when
    /// `wants_gpu`.
    pub plan: PlanRequest,
    /// The placement flags put something on a GPU.
    pub wants_gpu: bool,
    /// Show a progress bar while repacking.
    pub progress: bool,
}

impl LoadSpec {
    /// The spec the shared flags give (`-m`, `-t`, `-c`, `-ngl`, `-ot`, ...): the one parse of
    /// them; a bad value is an error naming the flag.
    pub fn from_args(model: &ModelArgs, rt: &RuntimeArgs, placement: &PlacementArgs) -> anyhow::Result<LoadSpec> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = rt.threads.unwrap_or(cores);
        let plan = crate::plan::request(placement, model, rt)?;
        // Flags are checked before any device is touched: a bad -ot is an error, not a fallback.
        if let Some(r) = plan.rules.iter().find(|r| Device::parse(&r.device).is_none()) {
            bail!("{}: '{}' is not a device (use CPU, CUDA0, CUDA1, ...)", r.source, r.device);
        }
        Ok(LoadSpec {
            path: Some(model.path().to_path_buf()),
            mmap: !model.no_mmap,
            mlock: model.mlock,
            repack: model.repacks(),
            read_ahead: model.read_ahead,
            threads,
            threads_batch: rt.threads_batch.unwrap_or(threads),
            ctx_total: rt.ctx_size,
            n_seq: rt.parallel.max(1),
            n_ubatch: rt.ubatch_size,
            cache_type_k: CacheType::from_name(&rt.cache_type_k)?,
            cache_type_v: CacheType::from_name(&rt.cache_type_v)?,
            mla: MlaMode::from_name(&rt.mla)?,
            plan,
            wants_gpu: wants_gpu(placement),
            progress: false,
        })
    }

    /// Opens the files and binds the model to them (no executor yet).
    pub fn open(&self) -> anyhow::Result<Opened> {
        let (gguf, name) = match &self.path {
            Some(p) => {
                let opts = LoadOptions { mmap: self.mmap, mlock: self.mlock };
                (GgufModel::open(p, opts)?, p.display().to_string())
            }
            None => (tandem_model::demo::demo_model()?, "the demo model".to_string()),
        };
        let model = Model::load_with(Arc::new(gguf), self.repack).with_context(|| format!("loading {name}"))?;
        let n_ctx_total = if self.ctx_total == 0 { model.n_ctx_train() } else { self.ctx_total };
        let n_ctx = n_ctx_total / self.n_seq.max(1);
        if n_ctx < 2 {
            bail!("-c {n_ctx_total} over -np {} slots leaves {n_ctx} tokens per slot; raise -c", self.n_seq);
        }
        Ok(Opened { spec: self.clone(), name, model: Arc::new(model), n_ctx })
    }
}

/// A model bound to its files, ready for executors.
pub struct Opened {
    spec: LoadSpec,
    /// The file's path as given, or "the demo model".
    pub name: String,
    pub model: Arc<Model>,
    /// Positions per sequence.
    pub n_ctx: usize,
}

/// An executor brought up and its context.
pub struct Up {
    pub ctx: Context,
    /// The plan the executor runs, or why there is none (the demo model, a model the planner
    /// does not know).
    pub plan: Option<Plan>,
    pub plan_error: Option<String>,
    /// What was done, one line each, for the command to print: the CUDA fallback reason or
    /// what was uploaded, repacking, reading ahead.
    pub notes: Vec<String>,
}

impl Opened {
    /// The spec's threads.
    pub fn bring_up_default(&self) -> anyhow::Result<Up> {
        self.bring_up(self.spec.threads, self.spec.threads_batch, self.n_ctx)
    }

    /// The executor for `threads` (single tokens) and `threads_batch` threads, on the devices
    /// the plan names (the CPU when CUDA cannot be used, with a note saying why), its weights
    /// repacked and read ahead as the spec says, and a context of `n_ctx` positions per sequence.
    pub fn bring_up(&self, threads: usize, threads_batch: usize, n_ctx: usize) -> anyhow::Result<Up> {
        let spec = &self.spec;
        let gguf = self.model.gguf();
        let threads = tandem_cpu::Threads::new(threads, threads_batch)?;
        let mut notes = Vec::new();
        let info = spec.path.as_ref().map(|p| ModelInfo::from_gguf(gguf, &p.display().to_string()));
        // The cache the plan counts is the one this context makes.
        let mut req = spec.plan.clone();
        req.kv.ctx = u32::try_from(n_ctx.saturating_mul(spec.n_seq.max(1))).unwrap_or(u32::MAX);
        let mut gpu = None;
        if spec.wants_gpu {
            match info.as_ref().map(|i| i.as_ref().map_err(|e| e.to_string())) {
                Some(Ok(info)) => match gpu_backend(gguf, info, req.clone(), threads.clone()) {
                    Ok(Some((exec, plan))) => {
                        notes.push(format!("CUDA: {}", exec.describe()));
                        gpu = Some((exec, plan));
                    }
                    Ok(None) => {}
                    Err(reason) => {
                        notes.push(format!("CUDA unavailable ({reason}); running everything on the CPU"))
                    }
                },
                Some(Err(e)) => notes.push(format!("CUDA unavailable ({e}); running everything on the CPU")),
                None => notes.push("CUDA unavailable (the demo model has no plan); running everything on the CPU".into()),
            }
        }
        let (mut exec, plan) = match gpu {
            Some((exec, plan)) => (exec, Ok(plan)),
            None => {
                // The CPU's plan: what this process will map and hold.
                req.gpus.clear();
                req.n_gpu_layers = None;
                req.rules.clear();
                req.fit = None;
                let plan = match info.as_ref() {
                    Some(Ok(info)) => tandem_plan::plan(info, &req).map_err(|e| e.to_string()),
                    Some(Err(e)) => Err(e.to_string()),
                    None => Err("the demo model has none".to_string()),
                };
                (Exec::cpu(threads), plan)
            }
        };
        if spec.repack {
            notes.push(crate::cli::repack(&self.model, &exec, spec.progress));
        }
        if let Some(line) = read_ahead(spec.read_ahead, gguf, &mut exec) {
            notes.push(line);
        }
        let params = ContextParams {
            n_ctx,
            n_ubatch: spec.n_ubatch,
            cache_type_k: spec.cache_type_k,
            cache_type_v: spec.cache_type_v,
            mla: spec.mla,
        };
        let ctx = Context::new(self.model.clone(), exec, params)?;
        let (plan, plan_error) = match plan {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        };
        Ok(Up { ctx, plan, plan_error, notes })
    }
}

/// Turns reading ahead on where `mode` says; the line saying so when it is on.
fn read_ahead(mode: ReadAhead, gguf: &GgufModel, exec: &mut Exec) -> Option<String> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let cpu_bytes: u64 = gguf.tensors().filter(|t| !exec.holds_elsewhere(&t.info.name)).map(|t| t.info.size).sum();
    let why = match mode {
        ReadAhead::Off => return None,
        ReadAhead::On => "--read-ahead on".to_string(),
        ReadAhead::Auto => {
            let free = crate::cli::available_memory()?;
            if !gguf.pages_on_demand() || cpu_bytes <= free {
                return None;
            }
            format!("the CPU's {:.2} GiB of mapped weights exceed the {:.2} GiB of memory available", gib(cpu_bytes), gib(free))
        }
    };
    exec.set_read_ahead(true);
    Some(format!("read-ahead: {why}; each layer's chosen experts and the next layer's weights are asked for ahead"))
}

/// Whether the placement flags put anything on a GPU: `-ngl` above 0 (or all/auto), an `-ot`
/// rule naming CUDAn, `--gpu`, or `--fit on`. Without any of them tandem stays on the CPU silently.
pub fn wants_gpu(p: &PlacementArgs) -> bool {
    let ngl = matches!(p.n_gpu_layers, Some(GpuLayers::All | GpuLayers::Auto | GpuLayers::Count(1..)));
    let ot = Rule::parse_overrides(&p.override_tensor)
        .map(|rules| rules.iter().any(|r| Device::parse(&r.device).is_some_and(Device::is_gpu)))
        .unwrap_or(false);
    ngl || ot || !p.gpu.is_empty() || p.fit.as_deref() == Some("on")
}

/// `TANDEM_CUDA_EMULATOR=1` makes the GPU flags use one emulated GPU (tandem-cuda's host emulator
/// of the kernels, compiled into test builds only; other builds fall back to the CPU, saying that
/// the emulator is not built), so that the binary's GPU path is tested on machines without one.
pub const EMULATOR_ENV: &str = "TANDEM_CUDA_EMULATOR";

/// The executor and its plan for the GPUs of `req` (the devices there, with their free memory,
/// when `--gpu` declares none), `None` when the plan puts nothing on a GPU, or the one-line
/// reason CUDA cannot be used.
fn gpu_backend(
    gguf: &GgufModel,
    info: &ModelInfo,
    mut req: PlanRequest,
    threads: tandem_cpu::Threads,
) -> Result<Option<(Exec, Plan)>, String> {
    let emulated = std::env::var_os(EMULATOR_ENV).is_some_and(|v| v == "1");
    let open = |n: usize| {
        if emulated {
            tandem_cuda::Runtime::emulated()
        } else {
            tandem_cuda::Runtime::open(crate::kernels::images(), n)
        }
    };
    let devices = if emulated {
        vec![open(0).map_err(|e| e.to_string())?.info().clone()]
    } else {
        tandem_cuda::devices().map_err(|e| e.to_string())?
    };
    if req.gpus.is_empty() {
        req.gpus = devices
            .iter()
            .map(|d| GpuBudget { device: Device::Cuda(d.ordinal as u32), bytes: d.free_bytes.max(1) })
            .collect();
    }
    let plan = tandem_plan::plan(info, &req).map_err(|e| e.to_string())?;
    let ordinals: BTreeSet<u32> = plan
        .tensors
        .iter()
        .filter_map(|t| match t.device {
            Device::Cuda(n) => Some(n),
            Device::Cpu => None,
        })
        .collect();
    if ordinals.is_empty() {
        return Ok(None);
    }
    let mut runtimes = Vec::new();
    let mut index = HashMap::new();
    for &n in &ordinals {
        let rt = open(n as usize).map_err(|e| e.to_string())?;
        index.insert(n, runtimes.len());
        runtimes.push(rt);
    }
    let mut on_gpu = HashMap::new();
    for t in &plan.tensors {
        if let Device::Cuda(n) = t.device {
            on_gpu.insert(t.name.clone(), index[&n]);
        }
    }
    let mut exec = Exec::with_cuda(threads, runtimes, gguf, &on_gpu).map_err(|e| e.to_string())?;
    if !req.kv.offload {
        exec.keep_kv_on_cpu();
    }
    Ok(Some((exec, plan)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(ngl: Option<&str>, ot: &[&str]) -> PlacementArgs {
        PlacementArgs {
            n_gpu_layers: ngl.map(|n| n.parse().unwrap()),
            override_tensor: ot.iter().map(|s| s.to_string()).collect(),
            ..PlacementArgs::default()
        }
    }

    #[test]
    fn only_gpu_flags_ask_for_a_gpu() {
        assert!(!wants_gpu(&placement(None, &[])));
        assert!(!wants_gpu(&placement(Some("0"), &[])));
        assert!(!wants_gpu(&placement(None, &["exps=CPU"])));
        assert!(wants_gpu(&placement(Some("999"), &["exps=CPU"])));
        assert!(wants_gpu(&placement(Some("all"), &[])));
        assert!(wants_gpu(&placement(Some("1"), &[])));
        assert!(wants_gpu(&placement(None, &["attn=cuda0,exps=CPU"])));
        let declared = PlacementArgs { gpu: vec!["CUDA0=8GiB".into()], ..PlacementArgs::default() };
        assert!(wants_gpu(&declared));
    }
}
