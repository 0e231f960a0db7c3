//! `tandem logits`: every position's logits for a token sequence, as little-endian f32
//! `[n_tokens][n_vocab]` (DESIGN.md "Contracts"), for comparison with llama.cpp.

use crate::cli::{ModelArgs, RuntimeArgs};
use anyhow::{bail, Context as _};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tandem_gguf::GgufModel;
use tandem_model::{Batch, CacheType, Context, ContextParams, CpuBackend, Model};

#[derive(Args, Debug)]
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
}

/// Opens the model and a CPU context as `-t/-tb/-c/-ub/-ctk/-ctv` say.
pub fn open_context(model: &ModelArgs, rt: &RuntimeArgs) -> anyhow::Result<Context> {
    let gguf = GgufModel::open(&model.model, model.load_options())?;
    let model = Arc::new(Model::load(Arc::new(gguf)).with_context(|| format!("loading {}", model.model.display()))?);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t = rt.threads.unwrap_or(cores);
    let threads = tandem_cpu::Threads::new(t, rt.threads_batch.unwrap_or(t))?;
    let params = ContextParams {
        n_ctx: rt.ctx_size,
        n_ubatch: rt.ubatch_size,
        cache_type_k: CacheType::from_name(&rt.cache_type_k)?,
        cache_type_v: CacheType::from_name(&rt.cache_type_v)?,
    };
    Ok(Context::new(model, Box::new(CpuBackend::new(threads)), params)?)
}

pub fn run(args: &LogitsArgs) -> anyhow::Result<()> {
    let mut ctx = open_context(&args.model, &args.runtime)?;
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
