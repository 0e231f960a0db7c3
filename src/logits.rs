//! `tandem logits`: every position's logits for a token sequence, as little-endian f32
//! `[n_tokens][n_vocab]` (DESIGN.md "Contracts"), for comparison with llama.cpp.

use crate::cli::{ModelArgs, PlacementArgs, RuntimeArgs};
use anyhow::{bail, Context as _};
use clap::Args;
use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tandem_gguf::GgufModel;
use tandem_model::{Batch, CacheType, Context, ContextParams, Exec, MlaMode, Model};
use tandem_plan::{Device, GpuBudget, GpuLayers, ModelInfo, Rule};

#[derive(Args, Debug, Clone)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    pub tokens: Vec<u32>,
    /// Output file (little-endian f32, one row of n_vocab per position).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Decode one token per step instead of the whole sequence as one batch.
    #[arg(long)]
    pub token_by_token: bool,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

/// Opens the model and a context as `-t/-tb/-c/-ub/-ctk/-ctv` say, on the backend the placement
/// flags ask for ([`select_backend`]; the fallback line, if any, goes to stderr).
pub fn open_context(model: &ModelArgs, rt: &RuntimeArgs, placement: &PlacementArgs) -> anyhow::Result<Context> {
    let gguf = Arc::new(GgufModel::open(model.path(), model.load_options())?);
    let loaded = Arc::new(
        Model::load_with(gguf.clone(), model.repacks())
            .with_context(|| format!("loading {}", model.path().display()))?,
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t = rt.threads.unwrap_or(cores);
    let threads = tandem_cpu::Threads::new(t, rt.threads_batch.unwrap_or(t))?;
    let params = ContextParams {
        n_ctx: rt.ctx_size,
        n_ubatch: rt.ubatch_size,
        cache_type_k: CacheType::from_name(&rt.cache_type_k)?,
        cache_type_v: CacheType::from_name(&rt.cache_type_v)?,
        mla: MlaMode::from_name(&rt.mla)?,
    };
    let choice = select_backend(&gguf, model, rt, placement, threads)?;
    for line in &choice.notes {
        eprintln!("tandem: {line}");
    }
    if model.repacks() {
        eprintln!("tandem: {}", crate::cli::repack(&loaded, &choice.exec, true));
    }
    Ok(Context::new(loaded, choice.exec, params)?)
}

/// The executor [`select_backend`] chose and what to tell the user about it.
pub struct BackendChoice {
    pub exec: Exec,
    /// One line for logs, e.g. `all tensors on CPU` or `CUDA0 (NVIDIA H200, ...): 312 tensors, ...`.
    pub description: String,
    /// Lines for stderr (without a prefix): the CUDA fallback reason, or what was uploaded.
    pub notes: Vec<String>,
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

/// The CPU, or — when the placement flags ask for a GPU — an executor with the tensors the planner
/// puts on each GPU uploaded there. Bad flags are errors; any CUDA failure
/// (no driver, no device, no kernels, out of memory while uploading, ...) falls back to the CPU
/// with one note: `CUDA unavailable (<reason>); running everything on the CPU`.
pub fn select_backend(
    gguf: &GgufModel,
    model: &ModelArgs,
    rt: &RuntimeArgs,
    placement: &PlacementArgs,
    threads: tandem_cpu::Threads,
) -> anyhow::Result<BackendChoice> {
    // Flags are checked before any device is touched: a bad -ot is an error, not a fallback.
    let req = crate::plan::request(placement, model, rt)?;
    if let Some(r) = req.rules.iter().find(|r| Device::parse(&r.device).is_none()) {
        bail!("{}: '{}' is not a device (use CPU, CUDA0, CUDA1, ...)", r.source, r.device);
    }
    let cpu = |threads: tandem_cpu::Threads, notes: Vec<String>| {
        let exec = Exec::cpu(threads);
        BackendChoice { description: exec.describe().to_string(), exec, notes }
    };
    if !wants_gpu(placement) {
        return Ok(cpu(threads, vec![]));
    }
    match gpu_backend(gguf, model.path(), req, placement, threads.clone()) {
        Ok(Some(exec)) => {
            let desc = exec.describe().to_string();
            Ok(BackendChoice { exec, notes: vec![format!("CUDA: {desc}")], description: desc })
        }
        Ok(None) => Ok(cpu(threads, vec![])),
        Err(reason) => Ok(cpu(threads, vec![format!("CUDA unavailable ({reason}); running everything on the CPU")])),
    }
}

/// `TANDEM_CUDA_EMULATOR=1` makes the GPU flags use one emulated GPU (tandem-cuda's host emulator
/// of the kernels, compiled into test builds only; other builds fall back to the CPU, saying that
/// the emulator is not built), so that the binary's GPU path is tested on machines without one.
pub const EMULATOR_ENV: &str = "TANDEM_CUDA_EMULATOR";

/// The executor for the plan of `req` with its GPUs, `None` when the plan puts nothing on a GPU,
/// or the one-line reason CUDA cannot be used.
fn gpu_backend(
    gguf: &GgufModel,
    path: &Path,
    mut req: tandem_plan::PlanRequest,
    placement: &PlacementArgs,
    threads: tandem_cpu::Threads,
) -> Result<Option<Exec>, String> {
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
        // No --gpu declarations: plan for the devices that are there, with their free memory.
        req.gpus = devices
            .iter()
            .map(|d| GpuBudget { device: Device::Cuda(d.ordinal as u32), bytes: d.free_bytes.max(1) })
            .collect();
    }
    let info = ModelInfo::from_gguf(gguf, &path.display().to_string()).map_err(|e| e.to_string())?;
    let plan = tandem_plan::plan(&info, &req).map_err(|e| e.to_string())?;
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
    if placement.no_kv_offload {
        exec.keep_kv_on_cpu();
    }
    Ok(Some(exec))
}

pub fn run(args: &LogitsArgs) -> anyhow::Result<()> {
    let mut ctx = open_context(&args.model, &args.runtime, &args.placement)?;
    let n = args.tokens.len();
    if n > ctx.params().n_ctx {
        bail!("{n} tokens do not fit in a context of {} (raise -c)", ctx.params().n_ctx);
    }
    let start = Instant::now();
    let logits = if args.token_by_token {
        let mut all = Vec::new();
        for (i, &t) in args.tokens.iter().enumerate() {
            all.extend(ctx.decode(&Batch::sequence(&[t], i as u32, 0, true))?);
        }
        all
    } else {
        ctx.decode(&Batch::sequence(&args.tokens, 0, 0, true))?
    };
    let secs = start.elapsed().as_secs_f64();
    let mut bytes = Vec::with_capacity(logits.len() * 4);
    for v in &logits {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let mut f = std::fs::File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    f.write_all(&bytes).with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "logits: {n} tokens x {} vocab -> {} ({:.1} ms, {:.1} tokens/s)",
        ctx.model().n_vocab(),
        args.out.display(),
        secs * 1e3,
        n as f64 / secs.max(1e-9)
    );
    Ok(())
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
