//! The one place a model is opened, for every command (`run`, `logits`, `bench`, `serve`):
//! a [`LoadSpec`] in (built from each command's flags by [`LoadSpec::from_args`] or by hand),
//! an [`Opened`] model out, then [`Opened::bring_up`] makes the executor for a thread count —
//! the placement plan made once and run as made, the threads, repacking, reading ahead — and the
//! context on it. What it did comes back as lines ([`Up::notes`]) for the command to print.

use crate::cli::{ModelArgs, PlacementArgs, RuntimeArgs};
use anyhow::{bail, Context as _};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{CacheType, Context, ContextParams, Exec, MlaMode, Model};
use tandem_plan::{
    parse_cache_type, parse_size, Device, GpuBudget, GpuLayers, KvConfig, ModelInfo, Plan, PlanRequest, Rule,
    DEFAULT_FIT_MARGIN, MIB,
};

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
    /// Bytes for the rebuilt MLA keys and values kept between runs (`--mla-cache`); `None`:
    /// sized from the memory the plan leaves free.
    pub mla_cache: Option<u64>,
    /// The planner's request (placement, budgets, cache); its GPU part is used only when
    /// `wants_gpu`.
    pub plan: PlanRequest,
    /// The placement flags put something on a GPU.
    pub wants_gpu: bool,
    /// Show a progress bar while repacking.
    pub progress: bool,
    /// Metadata values that replace the file's (`--override-kv`).
    pub overrides: Vec<(String, tandem_gguf::Value)>,
}

impl LoadSpec {
    /// The spec the shared flags give (`-m`, `-t`, `-c`, `-ngl`, `-ot`, ...): the one parse of
    /// them; a bad value is an error naming the flag.
    pub fn from_args(model: &ModelArgs, rt: &RuntimeArgs, placement: &PlacementArgs) -> anyhow::Result<LoadSpec> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = thread_count("-t", rt.threads, cores, cores)?;
        let plan = request(placement, model, rt)?;
        // Flags are checked before any device is touched: a bad -ot is an error, not a fallback.
        if let Some(r) = plan.rules.iter().find(|r| Device::parse(&r.device).is_none()) {
            bail!("{}: '{}' is not a device (use CPU, CUDA0, CUDA1, ...)", r.source, r.device);
        }
        Ok(LoadSpec {
            path: Some(model.path().to_path_buf()),
            mmap: !model.load.no_mmap,
            mlock: model.load.mlock,
            repack: model.load.repacks(),
            read_ahead: model.load.read_ahead,
            threads,
            threads_batch: thread_count("--threads-batch", rt.threads_batch, threads, cores)?,
            ctx_total: rt.ctx_size,
            n_seq: rt.parallel.max(1),
            n_ubatch: rt.ubatch_size,
            cache_type_k: CacheType::from_name(&rt.cache_type_k)?,
            cache_type_v: CacheType::from_name(&rt.cache_type_v)?,
            mla: MlaMode::from_name(&rt.mla)?,
            mla_cache: match rt.mla_cache.trim() {
                "auto" => None,
                size => Some(parse_size(size).map_err(|e| anyhow::anyhow!("--mla-cache: {e}"))?),
            },
            plan,
            wants_gpu: wants_gpu(placement),
            progress: false,
            overrides: model.load.overrides()?,
        })
    }

    /// Opens the files and binds the model to them (no executor yet).
    pub fn open(&self) -> anyhow::Result<Opened> {
        let (gguf, name) = match &self.path {
            Some(p) => {
                let opts = LoadOptions { mmap: self.mmap, mlock: self.mlock };
                (open_gguf(p, opts, &self.overrides)?, p.display().to_string())
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

/// The model's files opened, `overrides` set in its metadata (each said on stderr, as llama.cpp
/// says them).
pub fn open_gguf(
    path: &Path,
    opts: LoadOptions,
    overrides: &[(String, tandem_gguf::Value)],
) -> anyhow::Result<GgufModel> {
    let mut gguf = GgufModel::open(path, opts)?;
    for (key, value) in overrides {
        let was = gguf.metadata().get(key).map_or("absent".to_string(), |v| format!("{} {v}", v.type_description()));
        tracing::info!("metadata override: {key} = {} {value} (the file: {was})", value.type_description());
        gguf.metadata_mut().set(key, value.clone());
    }
    Ok(gguf)
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
                    Err(reason) => notes.push(format!("CUDA unavailable ({reason}); running everything on the CPU")),
                },
                Some(Err(e)) => notes.push(format!("CUDA unavailable ({e}); running everything on the CPU")),
                None => {
                    notes.push("CUDA unavailable (the demo model has no plan); running everything on the CPU".into())
                }
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
            notes.push(repack(&self.model, &exec, spec.progress));
        }
        if let Some(line) = read_ahead(spec.read_ahead, gguf, &mut exec) {
            notes.push(line);
        }
        let mla_cache = mla_cache_budget(spec.mla_cache, plan.as_ref().ok());
        let info = info.as_ref().and_then(|i| i.as_ref().ok());
        // Kept rows live in the CPU's cache: said where the plan puts the cache there (or is unknown).
        let on_cpu = plan.as_ref().ok().zip(info).is_none_or(|(p, i)| mla_rows_bytes(p, i).is_some());
        if spec.mla != MlaMode::Absorbed && self.model.is_mla() && on_cpu {
            notes.push(mla_cache_line(spec.mla_cache.is_some(), mla_cache, plan.as_ref().ok().zip(info)));
        }
        let params = ContextParams {
            n_ctx,
            n_ubatch: spec.n_ubatch,
            cache_type_k: spec.cache_type_k,
            cache_type_v: spec.cache_type_v,
            mla: spec.mla,
            mla_cache_bytes: usize::try_from(mla_cache).unwrap_or(usize::MAX),
        };
        let ctx = Context::new(self.model.clone(), exec, params)?;
        let (plan, plan_error) = match plan {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        };
        Ok(Up { ctx, plan, plan_error, notes })
    }
}

/// The most threads a pool may have: beyond any server's cores, and far below what stalls a
/// machine to spawn.
pub const MAX_THREADS: usize = 1024;

/// A thread count flag: as given, `default` when absent, every core (`cores`) for 0 or less (as
/// llama.cpp reads `-t`), an error above [`MAX_THREADS`].
fn thread_count(flag: &str, given: Option<i64>, default: usize, cores: usize) -> anyhow::Result<usize> {
    match given {
        None => Ok(default),
        Some(n) if n <= 0 => Ok(cores),
        Some(n) => match usize::try_from(n) {
            Ok(n) if n <= MAX_THREADS => Ok(n),
            _ => bail!("{flag} {n}: at most {MAX_THREADS} threads (0 or less: all {cores} cores)"),
        },
    }
}

/// `--mla-cache`'s budget for the rebuilt MLA keys and values kept between prompt runs: as
/// given, or (`auto`) half the memory `plan` leaves the CPU and at most half of what is
/// available now.
pub fn mla_cache_budget(given: Option<u64>, plan: Option<&Plan>) -> u64 {
    given.unwrap_or_else(|| {
        let cpu = plan.and_then(|p| p.device(Device::Cpu));
        let left = cpu.and_then(|c| Some(c.budget_bytes?.saturating_sub(c.total_bytes)));
        let free = [left, available_memory()].into_iter().flatten().min();
        free.map_or(tandem_model::DEFAULT_MLA_CACHE_BYTES as u64, |f| f / 2)
    })
}

/// The bytes the rebuilt keys and values of every cell of `plan`'s cache take (f32, each layer's
/// heads); `None` without MLA or where the cache is not the CPU's (a GPU's keeps no rows).
pub fn mla_rows_bytes(plan: &Plan, info: &ModelInfo) -> Option<u64> {
    let h = &info.hparams;
    let on_cpu = plan.device(Device::Cpu).is_some_and(|c| c.kv_bytes > 0);
    (on_cpu && matches!(h.attention, tandem_plan::Attention::Mla { .. })).then(|| {
        let per_cell = u64::from(h.n_layer) * u64::from(h.n_head) * u64::from(h.head_dim_k + h.head_dim_v) * 4;
        plan.kv.cells.saturating_mul(per_cell)
    })
}

/// The line saying how much of the rebuilt MLA rows may be kept: `budget`, or all of them where
/// the plan is known and they take less.
pub fn mla_cache_line(given: bool, budget: u64, known: Option<(&Plan, &ModelInfo)>) -> String {
    if budget == 0 {
        return "MLA: rebuilt keys and values are not kept between prompt runs (--mla-cache 0)".to_string();
    }
    let how = if given { "as given" } else { "auto: half the free memory" };
    let what = match known.and_then(|(p, i)| mla_rows_bytes(p, i)) {
        Some(full) if full <= budget => format!(
            "all, {} for a full cache (--mla-cache {how}: {})",
            tandem_plan::human(full),
            tandem_plan::human(budget)
        ),
        Some(full) => format!(
            "up to {} (--mla-cache {how}; a full cache's take {})",
            tandem_plan::human(budget),
            tandem_plan::human(full)
        ),
        None => format!("up to {} (--mla-cache {how})", tandem_plan::human(budget)),
    };
    format!("MLA: rebuilt keys and values kept between prompt runs: {what}, anonymous memory beyond the plan's")
}

/// Turns reading ahead on where `mode` says; the line saying so when it is on.
fn read_ahead(mode: ReadAhead, gguf: &GgufModel, exec: &mut Exec) -> Option<String> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let cpu_bytes: u64 = gguf.tensors().filter(|t| !exec.holds_elsewhere(&t.info.name)).map(|t| t.info.size).sum();
    let why = match mode {
        ReadAhead::Off => return None,
        ReadAhead::On => "--read-ahead on".to_string(),
        ReadAhead::Auto => {
            let free = available_memory()?;
            if !gguf.pages_on_demand() || cpu_bytes <= free {
                return None;
            }
            format!(
                "the CPU's {:.2} GiB of mapped weights exceed the {:.2} GiB of memory available",
                gib(cpu_bytes),
                gib(free)
            )
        }
    };
    exec.set_read_ahead(true);
    Some(format!("read-ahead: {why}; each layer's chosen experts and the next layer's weights are asked for ahead"))
}

/// The planner's request from the command line; `tandem run` and `tandem serve` use the same.
pub fn request(placement: &PlacementArgs, model: &ModelArgs, rt: &RuntimeArgs) -> anyhow::Result<PlanRequest> {
    let mut rules = Rule::parse_overrides(&placement.override_tensor)?;
    // llama.cpp appends these to the overrides where they appear on the command line; tandem
    // tries them after every -ot rule (the same unless -ot sends experts to a GPU).
    if placement.cpu_moe {
        rules.push(Rule::cpu_moe());
    }
    if let Some(n) = placement.n_cpu_moe.filter(|&n| n > 0) {
        rules.push(Rule::n_cpu_moe(n));
    }
    let fit_margin = match &placement.fit_target {
        None => DEFAULT_FIT_MARGIN,
        // A bare number is MiB, as llama.cpp's -fitt takes it.
        Some(v) if v.bytes().all(|b| b.is_ascii_digit()) && !v.is_empty() => {
            v.parse::<u64>().map(|m| m * MIB).context(format!("--fit-target '{v}': too large"))?
        }
        Some(v) => parse_size(v).map_err(|m| anyhow::anyhow!("--fit-target '{v}': {m}"))?,
    };
    let host_memory = match &placement.host_memory {
        Some(v) => Some(parse_size(v).map_err(|m| anyhow::anyhow!("--host-memory '{v}': {m}"))?),
        None => machine_memory(),
    };
    let u32_flag = |flag: &str, v: usize| u32::try_from(v).with_context(|| format!("{flag} {v}: too large"));
    Ok(PlanRequest {
        gpus: GpuBudget::parse_all(&placement.gpu)?,
        host_memory,
        rules,
        n_gpu_layers: placement.n_gpu_layers,
        fit: placement.fit.as_deref().map(|f| f == "on"),
        fit_margin,
        kv: KvConfig {
            ctx: u32_flag("--ctx-size", rt.ctx_size)?,
            type_k: parse_cache_type("--cache-type-k", &rt.cache_type_k)?,
            type_v: parse_cache_type("--cache-type-v", &rt.cache_type_v)?,
            parallel: u32_flag("--parallel", rt.parallel)?.max(1),
            offload: !placement.no_kv_offload,
        },
        ubatch: u32_flag("--ubatch-size", rt.ubatch_size)?.max(1),
        mmap: !model.load.no_mmap,
        mlock: model.load.mlock,
        // the types the CUDA runtime multiplies: the plan keeps the others on the CPU
        gpu_types: Some(tandem_cuda::MATVEC_TYPES.to_vec()),
        mla_decompressed: MlaMode::from_name(&rt.mla)? != MlaMode::Absorbed,
    })
}

/// This machine's memory (`MemTotal` of /proc/meminfo), the CPU's budget unless --host-memory.
fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// One line for the table: what repacking at load (the default) copies of the CPU's matrices,
/// and whether a load on this host makes the copies (it keeps 1 GiB free beside them, see
/// [`repack`]).
pub fn repacking_line(r: &tandem_model::PackedSources, plan: &tandem_plan::Plan, no_mmap: bool) -> String {
    let gib = tandem_plan::human;
    let what = format!(
        "repacking (the default; --no-repack turns it off): {} of packed copies of {} CPU matrices ({} in the file)",
        gib(r.packed_bytes),
        r.tensors,
        gib(r.source_bytes)
    );
    let anonymous =
        if no_mmap { plan.host.rss_no_mmap_bytes } else { plan.host.rss_mmap_bytes - plan.host.file_backed_bytes };
    let need = r.peak_bytes(no_mmap);
    let budget = plan.device(tandem_plan::Device::Cpu).and_then(|c| c.budget_bytes);
    if budget.is_some_and(|b| anonymous + need + REPACK_HEADROOM > b) {
        return format!(
            "{what} would not fit beside the rest of the host memory, so a load here uses the weights as they are\n"
        );
    }
    if !no_mmap {
        return format!("{what}, anonymous memory beyond the host memory above; once packed, the file's pages of those tensors are not read again and stay reclaimable\n");
    }
    if r.releasable_bytes == 0 {
        return format!("{what}, beyond the host memory above: with --no-mmap both copies stay resident\n");
    }
    format!(
        "{what}; with --no-mmap {} of their read bytes are given back as they are packed, so the host memory above grows by about {}\n",
        gib(r.releasable_bytes),
        gib(r.packed_bytes.saturating_sub(r.releasable_bytes))
    )
}

/// What repacking would copy of the matrices `plan` leaves to the CPU (`None` when this machine
/// runs no packed kernel, nothing would be repacked, or tandem cannot load the file).
pub fn repacking(model: &tandem_model::Model, plan: &tandem_plan::Plan) -> Option<tandem_model::PackedSources> {
    if tandem_cpu::packed::paying_types().is_empty() {
        return None;
    }
    let on_cpu = |name: &str| plan.device_of(name) == Some(tandem_plan::Device::Cpu);
    let r = model.packed_sources(&|name| !on_cpu(name));
    (r.tensors > 0).then_some(r)
}

/// Memory this process may still take (`MemAvailable`, lowered to a memory cgroup's room).
pub fn available_memory() -> Option<u64> {
    tandem_gguf::read_ahead::available_memory()
}

/// Memory repacking leaves free for the KV cache and compute buffers.
pub const REPACK_HEADROOM: u64 = 1 << 30;

/// Repacking (the default; not with `--no-repack`): packs every packable matrix `exec` leaves
/// to the CPU now (with a progress bar on stderr when `progress`), and says in one line what it
/// did.
pub fn repack(model: &tandem_model::Model, exec: &tandem_model::Exec, progress: bool) -> String {
    let paying = tandem_cpu::packed::paying_types();
    if paying.is_empty() {
        return "repack: this CPU runs no packed kernel (they need AVX2; or TANDEM_CPU_ISA caps the level below it); weights are used as they are".into();
    }
    let names: Vec<String> = paying.iter().map(|t| t.to_string().to_uppercase()).collect();
    let skip = |name: &str| exec.holds_elsewhere(name);
    let need = model.repack_need(&skip);
    if let Some(free) = available_memory().filter(|&free| need.saturating_add(REPACK_HEADROOM) > free) {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let why = format!(
            "the packed copies need {:.2} GiB and {:.2} GiB of memory are available (1 GiB kept free)",
            gib(need),
            gib(free)
        );
        model.keep_unpacked(&why);
        return format!("repack: {why}; weights are used as they are");
    }
    let start = std::time::Instant::now();
    let pb = if progress { indicatif::ProgressBar::new(0) } else { indicatif::ProgressBar::hidden() };
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("repacking weights [{bar:30}] {bytes}/{total_bytes} ({elapsed})")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    let r = model.pack_weights(&skip, &mut |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    });
    pb.finish_and_clear();
    let failed = match r.failed.first() {
        Some((name, why)) => format!("; {} left as they are ({name}: {why})", r.failed.len()),
        None => String::new(),
    };
    if r.tensors == 0 {
        return format!(
            "repack: no {} matrix with whole groups of 16 rows on the CPU (the types this CPU has packed kernels for); nothing repacked{failed}",
            names.join(" / ")
        );
    }
    let types: Vec<String> = r.types.iter().map(|t| t.to_string().to_uppercase()).collect();
    let given = match r.released_tensors {
        0 => String::new(),
        n => format!("; the read bytes of {n} of them given back ({})", tandem_plan::human(r.released_bytes)),
    };
    format!(
        "repack: {} tensors repacked ({}; {}) in {:.1} s{given}{failed}",
        r.tensors,
        types.join(", "),
        tandem_plan::human(r.bytes),
        start.elapsed().as_secs_f64()
    )
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
