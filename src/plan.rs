//! `tandem plan`: where every tensor of a model would go and how much memory each device needs,
//! from the GGUF headers alone — before buying hardware or waiting an hour for a load.
//!
//! Takes the same command line as `tandem serve` / llama-server (placement, context, cache and
//! batch flags count; flags that only matter when serving are accepted and ignored), so a
//! deployment's command line can be checked as it is.

use crate::cli::{CompatArgs, ModelArgs, PlacementArgs, RuntimeArgs};
use anyhow::Context as _;
use clap::Args;
use std::io::Write;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_plan::{
    parse_cache_type, parse_size, GpuBudget, KvConfig, ModelInfo, PlanRequest, Rule, DEFAULT_FIT_MARGIN, MIB,
};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub placement: PlacementArgs,
    #[command(flatten)]
    pub compat: CompatArgs,
    #[command(flatten)]
    pub serving: ServingArgs,
    /// Print JSON for machines instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Add one line per tensor to the table.
    #[arg(long)]
    pub tensors: bool,
}

/// Flags of `tandem run` / `tandem serve` that a pasted command line carries but a plan does not
/// depend on.
#[derive(Args, Debug, Clone, Default)]
pub struct ServingArgs {
    /// Tokens to generate (not used by plan).
    #[arg(short = 'n', long = "n-predict", value_name = "N", allow_negative_numbers = true)]
    pub n_predict: Option<i64>,
    /// Listen address (not used by plan).
    #[arg(long, value_name = "ADDR")]
    pub host: Option<String>,
    /// Listen port (not used by plan).
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// Model name served to clients (not used by plan).
    #[arg(short = 'a', long, value_name = "NAME")]
    pub alias: Option<String>,
    /// Prompt (not used by plan).
    #[arg(short = 'p', long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Sampling temperature (not used by plan).
    #[arg(long, value_name = "T")]
    pub temp: Option<f32>,
    /// Top-k sampling (not used by plan).
    #[arg(long = "top-k", value_name = "K")]
    pub top_k: Option<u32>,
    /// Top-p sampling (not used by plan).
    #[arg(long = "top-p", value_name = "P")]
    pub top_p: Option<f32>,
    /// Min-p sampling (not used by plan).
    #[arg(long = "min-p", value_name = "P")]
    pub min_p: Option<f32>,
    /// Sampling seed (not used by plan).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub seed: Option<i64>,
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
        mmap: !model.no_mmap,
        mlock: model.mlock,
    })
}

/// This machine's memory (`MemTotal` of /proc/meminfo), the CPU's budget unless --host-memory.
fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    args.compat.print_notes();
    let path = &args.model.model;
    // Headers only: always mapped, never read whole and never locked; --no-mmap and --mlock
    // change the estimate, not how the plan reads the file.
    let gguf = GgufModel::open(path, LoadOptions { mmap: true, mlock: false })?;
    let model = ModelInfo::from_gguf(&gguf, &path.display().to_string())?;
    let req = request(&args.placement, &args.model, &args.runtime)?;
    let plan = tandem_plan::plan(&model, &req)?;
    let out = if args.json {
        let mut s = plan.to_json();
        s.push('\n');
        s
    } else {
        plan.to_text(args.tensors)
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|_| stdout.flush()) {
        // A closed pipe (`tandem plan ... | head`) is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}
