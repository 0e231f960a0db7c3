//! `tandem logits`: every position's logits for a token sequence, as little-endian f32
//! `[n_tokens][n_vocab]` (DESIGN.md "Contracts"), for comparison with llama.cpp.

use crate::cli::{ModelArgs, PlacementArgs, RuntimeArgs};
use anyhow::{bail, Context as _};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;
use tandem_model::{Batch, Context};

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
/// flags ask for (through [`crate::load`]; what it did, the CUDA fallback reason if any, goes to
/// stderr).
pub fn open_context(model: &ModelArgs, rt: &RuntimeArgs, placement: &PlacementArgs) -> anyhow::Result<Context> {
    let mut spec = crate::load::LoadSpec::from_args(model, rt, placement)?;
    spec.progress = true;
    let up = spec.open()?.bring_up_default()?;
    for line in &up.notes {
        tracing::info!("{line}");
    }
    Ok(up.ctx)
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
    tracing::info!(
        "logits: {n} tokens x {} vocab -> {} ({:.1} ms, {:.1} tokens/s)",
        ctx.model().n_vocab(),
        args.out.display(),
        secs * 1e3,
        n as f64 / secs.max(1e-9)
    );
    Ok(())
}
