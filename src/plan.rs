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

#[derive(Args, Debug, Clone)]
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
        // the types the CUDA runtime multiplies: the plan keeps the others on the CPU
        gpu_types: Some(tandem_cuda::MATVEC_TYPES.to_vec()),
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
/// `cli::repack`).
pub(crate) fn repacking_line(r: &tandem_model::PackedSources, plan: &tandem_plan::Plan, no_mmap: bool) -> String {
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
    if budget.is_some_and(|b| anonymous + need + crate::cli::REPACK_HEADROOM > b) {
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
pub(crate) fn repacking(model: &tandem_model::Model, plan: &tandem_plan::Plan) -> Option<tandem_model::PackedSources> {
    if tandem_cpu::packed::paying_types().is_empty() {
        return None;
    }
    let on_cpu = |name: &str| plan.device_of(name) == Some(tandem_plan::Device::Cpu);
    let r = model.packed_sources(&|name| !on_cpu(name));
    (r.tensors > 0).then_some(r)
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    args.compat.print_notes();
    let path = args.model.path();
    // Headers only: always mapped, never read whole and never locked; --no-mmap and --mlock
    // change the estimate, not how the plan reads the file.
    let gguf = GgufModel::open(path, LoadOptions { mmap: true, mlock: false })?;
    let model = ModelInfo::from_gguf(&gguf, &path.display().to_string())?;
    let req = request(&args.placement, &args.model, &args.runtime)?;
    let plan = tandem_plan::plan(&model, &req)?;
    let repack = match args.model.repacks() {
        true => tandem_model::Model::load_with(std::sync::Arc::new(gguf), true).ok().and_then(|m| repacking(&m, &plan)),
        false => None,
    };
    let out = if args.json {
        let mut v: serde_json::Value = serde_json::from_str(&plan.to_json()).context("the plan's JSON")?;
        v["repack"] = match &repack {
            Some(r) => {
                serde_json::json!({
                    "tensors": r.tensors,
                    "source_bytes": r.source_bytes,
                    "packed_bytes": r.packed_bytes,
                    "no_mmap_given_back_bytes": r.releasable_bytes,
                })
            }
            None => serde_json::Value::Null,
        };
        let mut s = v.to_string();
        s.push('\n');
        s
    } else {
        let mut s = plan.to_text(args.tensors);
        if let Some(r) = &repack {
            s.push_str(&repacking_line(r, &plan, args.model.no_mmap));
        }
        s
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|_| stdout.flush()) {
        // A closed pipe (`tandem plan ... | head`) is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}
