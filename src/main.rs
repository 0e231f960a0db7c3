//! tandem: inference runtime for trillion-parameter MoE models in GGUF.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use tandem::inspect::Report;
use tandem_gguf::{GgufModel, LoadOptions};

#[derive(Parser)]
#[command(name = "tandem", version, about = "Inference runtime for trillion-parameter MoE models in GGUF")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: tandem::logging::LogArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a GGUF model from its headers: hyperparameters, metadata, tensors, totals.
    Inspect(InspectArgs),
    /// Write every position's logits for a token sequence (little-endian f32 [n_tokens][n_vocab]).
    Logits(Box<tandem::logits::LogitsArgs>),
    /// Plan where every tensor goes (-ngl, -ot, --cpu-moe, --fit) and the memory of each device, from headers only.
    Plan(Box<tandem::plan::PlanArgs>),
    /// Generate text: the prompt through the chat template, tokens streamed to stdout (--chat: interactive).
    Run(Box<tandem::run::RunArgs>),
    /// Print the token ids of a text, as llama.cpp tokenizes it.
    Tokenize(tandem::tokenize::TokenizeArgs),
    /// Serve the model over gRPC (continuous batching, prompt cache, health, metrics); no -m: a demo model.
    Serve(Box<tandem::serve::ServeArgs>),
    /// Measure prefill and decode speed as llama-bench (-p -n -d -r) or llama-sweep-bench (--sweep) does, with the decode roofline.
    Bench(Box<tandem::bench::BenchArgs>),
    /// Write a model with a real model's shapes and random weights (kimi-k2.5), for speed tests where the real file is not at hand.
    Synth(tandem::synth::SynthArgs),
}

#[derive(Args)]
struct InspectArgs {
    /// The model: a .gguf file, or any shard of a split model (NAME-00001-of-00013.gguf).
    #[arg(value_name = "MODEL")]
    model: PathBuf,
    /// Print JSON for machines instead of text.
    #[arg(long)]
    json: bool,
    /// Leave out the per-tensor table (totals are still printed).
    #[arg(long)]
    no_tensors: bool,
    #[command(flatten)]
    load: LoadArgs,
}

/// How model files are brought into memory (llama.cpp's flags).
#[derive(Args)]
struct LoadArgs {
    /// Read the files into memory instead of memory-mapping them.
    #[arg(long)]
    no_mmap: bool,
    /// Lock the model's memory so it is never paged out.
    #[arg(long)]
    mlock: bool,
}

impl LoadArgs {
    fn options(&self) -> LoadOptions {
        LoadOptions { mmap: !self.no_mmap, mlock: self.mlock }
    }
}

fn inspect(args: &InspectArgs) -> anyhow::Result<()> {
    let model = GgufModel::open(&args.model, args.load.options())?;
    let report = Report::new(&args.model.display().to_string(), &model);
    let out = if args.json {
        let mut s = serde_json::to_string_pretty(&report)?;
        s.push('\n');
        s
    } else {
        report.to_text(!args.no_tensors)
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|_| stdout.flush()) {
        // A closed pipe (`tandem inspect m.gguf | head`) is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}

/// A forward pass allocates and frees working buffers of hundreds of KiB to MiB at every op. glibc
/// serves sizes above its mmap threshold with fresh mappings, gives the pool threads arenas of
/// their own that it shrinks as soon as memory is freed, and trims the main heap, so every step
/// would fault in and zero those pages again (about 80,000 page faults a second in a prefill).
/// One arena that keeps what it has.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_buffers_in_the_heap() {
    // SAFETY: mallopt only changes allocator tuning; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// Runs a command after downloading its `-hf` / `--model-url` model, if it names one.
fn with_model<A: Clone>(
    args: &A,
    model: impl Fn(&mut A) -> &mut tandem::cli::ModelArgs,
    run: impl Fn(&A) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut args = args.clone();
    model(&mut args).resolve()?;
    run(&args)
}

fn main() -> ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    keep_buffers_in_the_heap();
    // a model file truncated while mapped: one line and exit 1, not a core dump (serve recovers)
    tandem_gguf::guard::install(tandem_gguf::guard::Mode::Exit);
    let cli = match Cli::try_parse_from(tandem::cli::normalize_args(std::env::args_os())) {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            eprintln!("tandem: error: {}", tandem::cli::one_line(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    let prefix = if matches!(cli.command, Command::Serve(_)) { "tandem serve" } else { "tandem" };
    if let Err(e) = tandem::logging::init(&cli.log, prefix) {
        eprintln!("tandem: error: {}", tandem::cli::one_line(&format!("{e:#}")));
        return ExitCode::from(2);
    }
    let result = match &cli.command {
        Command::Inspect(args) => inspect(args),
        Command::Logits(args) => with_model(&**args, |a| &mut a.model, tandem::logits::run),
        Command::Plan(args) => with_model(&**args, |a| &mut a.model, tandem::plan::run),
        Command::Run(args) => with_model(&**args, |a| &mut a.model, tandem::run::run),
        Command::Tokenize(args) => with_model(args, |a| &mut a.model, tandem::tokenize::run),
        Command::Serve(args) => tandem::serve::run(args),
        Command::Bench(args) => with_model(&**args, |a| &mut a.model, tandem::bench::run),
        Command::Synth(args) => tandem::synth::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem: error: {}", tandem::cli::printable(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    /// clap's own consistency checks (unique argument names and flags across the flattened
    /// structs) run only in debug builds as a command parses; here they run in every build, for
    /// every subcommand.
    #[test]
    fn every_command_line_definition_is_consistent() {
        <super::Cli as clap::CommandFactory>::command().debug_assert();
    }
}
