//! `tandem plan`: where every tensor of a model would go and how much memory each device needs,
//! from the GGUF headers alone — before buying hardware or waiting an hour for a load.
//!
//! Takes the same command line as `tandem serve` / llama-server (placement, context, cache and
//! batch flags count; flags that only matter when serving are accepted and ignored), so a
//! deployment's command line can be checked as it is.

use crate::cli::{EngineArgs, ModelArgs};
use crate::load::{mla_cache_budget, mla_cache_line, mla_rows_bytes, repacking, repacking_line, request, LoadSpec};
use anyhow::Context as _;
use clap::Args;
use std::io::Write;
use tandem_gguf::LoadOptions;
use tandem_plan::ModelInfo;

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
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

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    args.engine.print_notes();
    let path = args.model.path();
    // Headers only: always mapped, never read whole and never locked; --no-mmap and --mlock
    // change the estimate, not how the plan reads the file.
    let gguf = crate::load::open_gguf(path, LoadOptions { mmap: true, mlock: false }, &args.model.load.overrides()?)?;
    let model = ModelInfo::from_gguf(&gguf, &path.display().to_string())?;
    let req = request(&args.engine.placement, &args.model, &args.engine.runtime)?;
    let plan = tandem_plan::plan(&model, &req)?;
    let repack = match args.model.load.repacks() {
        true => tandem_model::Model::load_with(std::sync::Arc::new(gguf), true).ok().and_then(|m| repacking(&m, &plan)),
        false => None,
    };
    // The rebuilt MLA rows kept between prompt runs, where the model and `--mla` make them.
    let spec = LoadSpec::from_args(&args.model, &args.engine.runtime, &args.engine.placement)?;
    let mla_cache = (spec.mla != tandem_model::MlaMode::Absorbed)
        .then(|| mla_rows_bytes(&plan, &model).map(|full| (mla_cache_budget(spec.mla_cache, Some(&plan)), full)))
        .flatten();
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
        v["mla_cache"] = match mla_cache {
            Some((budget, full)) => serde_json::json!({ "budget_bytes": budget, "full_cache_bytes": full }),
            None => serde_json::Value::Null,
        };
        let mut s = v.to_string();
        s.push('\n');
        s
    } else {
        let mut s = plan.to_text(args.tensors);
        if let Some(r) = &repack {
            s.push_str(&repacking_line(r, &plan, args.model.load.no_mmap));
        }
        if let Some((budget, _)) = mla_cache {
            s.push_str(&mla_cache_line(spec.mla_cache.is_some(), budget, Some((&plan, &model))));
            s.push('\n');
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
