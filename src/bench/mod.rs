//! `tandem bench`: prefill and decode speed measured as llama.cpp's llama-bench does (`-p -n -d -r`),
//! or as llama-sweep-bench does (`--sweep -c -ub -n`), with the decode roofline: the weight bytes one
//! decoded token reads, over the memory read bandwidth measured on this machine.
//!
//! With `--parallel N,...` (llama-batched-bench's `-npl`), N sequences of `-p` prompt tokens are
//! prefilled in one batch, then decoded together `-n` steps, one token of each per step: the
//! aggregate and per-sequence speeds a batch pipeline sees.
//!
//! Every timed step runs on random tokens (seeded, uniform in the vocabulary) through
//! [`Context::decode`]; the KV cache is filled to the depth untimed and truncated back between steps.

use crate::cli::{CompatArgs, ModelArgs, PlacementArgs, RuntimeArgs};
use crate::load::{LoadSpec, Opened};
use anyhow::{bail, Context as _};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;
use tandem_model::demo::SplitMix64;
use tandem_model::{Batch, CacheType, Context, MlaMode};

/// The KV-cache sequence the benchmark uses.
mod memory;
mod plot;

pub use memory::active_bytes_per_token;
use memory::{default_bandwidth_bytes, measure_bandwidth, BANDWIDTH_RUNS};
use plot::plot;

const SEQ: usize = 0;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Where tensors go (`-ngl`, `-ot`, ...), as for run/serve; a GPU that cannot be used means
    /// one line on stderr and the CPU.
    #[command(flatten)]
    pub placement: PlacementArgs,
    /// Thread counts to test, comma-separated; each is used for decode and batches alike [default: all cores].
    #[arg(short = 't', long = "threads", value_name = "N,...", value_delimiter = ',', allow_negative_numbers = true)]
    pub threads: Vec<i64>,
    /// Prompt tokens timed as one batch (0 = no prefill test) [default: 512; not with --sweep].
    #[arg(short = 'p', long = "n-prompt", value_name = "N", allow_negative_numbers = true)]
    pub n_prompt: Option<i64>,
    /// Tokens decoded one at a time (0 = no decode test) [default: 128; with --sweep: -ub / 4].
    #[arg(short = 'n', long = "n-gen", value_name = "N", allow_negative_numbers = true)]
    pub n_gen: Option<i64>,
    /// Tokens already in the KV cache before each test, comma-separated [default: 0; not with --sweep].
    #[arg(short = 'd', long = "n-depth", value_name = "N,...", value_delimiter = ',', allow_negative_numbers = true)]
    pub depth: Vec<i64>,
    /// Repetitions of each test; the median time is reported [default: 3; with --sweep: 1].
    #[arg(short = 'r', long = "repetitions", value_name = "N", allow_negative_numbers = true)]
    pub repetitions: Option<i64>,
    /// Context size in tokens (0 = the model's training context) [default: what the tests need; required with --sweep].
    #[arg(short = 'c', long = "ctx-size", value_name = "N", allow_negative_numbers = true)]
    pub ctx_size: Option<i64>,
    /// Logical batch size: the most prompt tokens submitted to one decode call.
    #[arg(short = 'b', long = "batch-size", value_name = "N", default_value_t = 2048, allow_negative_numbers = true)]
    pub batch_size: i64,
    /// Physical micro-batch size: the most tokens computed in one forward pass (also -ub).
    #[arg(long = "ubatch-size", value_name = "N", default_value_t = 512, allow_negative_numbers = true)]
    pub ubatch_size: i64,
    /// KV cache type for K: f32, f16, bf16, q8_0, q4_0 (also -ctk).
    #[arg(long = "cache-type-k", value_name = "TYPE", default_value = "f16")]
    pub cache_type_k: String,
    /// KV cache type for V: f32, f16, bf16, q8_0, q4_0 (also -ctv).
    #[arg(long = "cache-type-v", value_name = "TYPE", default_value = "f16")]
    pub cache_type_v: String,
    /// MLA attention: auto (the default), absorbed (llama.cpp's arithmetic) or decompressed (see
    /// `tandem run --help`).
    #[arg(long = "mla", value_name = "absorbed|auto|decompressed", default_value = "auto")]
    pub mla: String,
    /// Memory for rebuilt MLA keys and values kept between prompt runs: auto or a size, 0 keeps
    /// none (see `tandem run --help`).
    #[arg(long = "mla-cache", value_name = "auto|SIZE", default_value = "auto")]
    pub mla_cache: String,
    /// llama-sweep-bench's method: at N_KV = 0, UB, 2 UB, ... up to -c, decode -n tokens (dropped), then prefill -ub.
    #[arg(long)]
    pub sweep: bool,
    /// Print one JSON object to stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Also draw S_PP and S_TG against N_KV, one line per thread count, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// No progress bar (it is hidden anyway when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Skip the untimed warm-up prefill and decode step.
    #[arg(long)]
    pub no_warmup: bool,
    /// Bring the cache to each -d depth with rows of zeros instead of a prefill: the tests at that
    /// depth cost the same (attention does not depend on the rows' values), for models whose
    /// prefill to 32K would take too long, such as `tandem synth` ones.
    #[arg(long)]
    pub zero_depth: bool,
    /// Sequences batched together, comma-separated (llama-batched-bench's -npl): each has -p
    /// prompt tokens prefilled in one batch, then -n decode steps of one token per sequence.
    #[arg(long = "parallel", value_name = "N,...", value_delimiter = ',', allow_negative_numbers = true)]
    pub parallel: Vec<i64>,
    /// Seed of the random tokens.
    #[arg(long, value_name = "N", default_value_t = 42)]
    pub seed: u64,
    /// Size of the read-bandwidth buffer in MiB (0 = do not measure) [default: 1 GiB or 4 x L3, capped by free RAM].
    #[arg(long = "bandwidth-mib", value_name = "MiB", allow_negative_numbers = true)]
    pub bandwidth_mib: Option<i64>,
    #[command(flatten)]
    pub compat: CompatArgs,
}

/// One result row: medians over the repetitions. `None` where that part was skipped (`-p 0`, `-n 0`).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub threads: usize,
    /// Sequences batched together (1 but with --parallel); S_PP and S_TG are their sums.
    pub n_parallel: usize,
    pub n_kv: usize,
    pub pp: usize,
    pub tg: usize,
    pub t_pp_s: Option<f64>,
    pub s_pp_tps: Option<f64>,
    pub t_tg_s: Option<f64>,
    pub s_tg_tps: Option<f64>,
    pub roofline_pct: Option<f64>,
    /// Per device other than the CPU (a GPU), what it did per decoded token in the decode test:
    /// launches, copies each way with their bytes, host waits (the executor's ledger).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu: BTreeMap<String, PerToken>,
    /// With a GPU: the CPU's time in its ops per decoded token (the routed experts, under `-ot
    /// exps=CPU`), in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_busy_s_per_token: Option<f64>,
    /// Page faults that waited for storage (major faults) per prompt token and per decoded token
    /// in the timed runs: a model that does not fit in memory reads its weights as it goes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub major_faults_per_pp_token: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub major_faults_per_tg_token: Option<f64>,
}

/// A device's ledger divided by the tokens decoded.
#[derive(Clone, Debug, Serialize)]
pub struct PerToken {
    pub launches: f64,
    pub h2d: f64,
    pub h2d_bytes: f64,
    pub d2h: f64,
    pub d2h_bytes: f64,
    pub syncs: f64,
}

impl PerToken {
    fn of(c: &tandem_model::Counts, tokens: usize) -> PerToken {
        let n = tokens.max(1) as f64;
        PerToken {
            launches: c.launches as f64 / n,
            h2d: c.h2d as f64 / n,
            h2d_bytes: c.h2d_bytes as f64 / n,
            d2h: c.d2h as f64 / n,
            d2h_bytes: c.d2h_bytes as f64 / n,
            syncs: c.syncs as f64 / n,
        }
    }

    /// `CUDA0 per decoded token: 1234 launches, 3 copies up (1.2 KiB), 2 down (30.0 KiB), 2 host waits`.
    fn line(&self, dev: &str) -> String {
        format!(
            "{dev} per decoded token: {:.0} launches, {:.1} copies up ({:.1} KiB), {:.1} down ({:.1} KiB), {:.1} host waits",
            self.launches,
            self.h2d,
            self.h2d_bytes / 1024.0,
            self.d2h,
            self.d2h_bytes / 1024.0,
            self.syncs
        )
    }
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Report<'a> {
    model: String,
    threads: &'a [usize],
    active_bytes_per_token: u64,
    read_bandwidth_gbs: BTreeMap<String, f64>,
    /// The weights were repacked (not `--no-repack`, and the machine runs the packed kernels).
    repack: bool,
    rows: &'a [Row],
}

/// The validated flags.
#[derive(Debug)]
struct Plan {
    threads: Vec<usize>,
    sweep: bool,
    pp: usize,
    tg: usize,
    depths: Vec<usize>,
    reps: usize,
    /// `None`: as large as the tests need.
    ctx: Option<usize>,
    batch: usize,
    ubatch: usize,
    mla: MlaMode,
    /// `--parallel`: the batch widths to test (empty: the single-sequence tests).
    parallel: Vec<usize>,
}

fn count(flag: &str, v: i64) -> anyhow::Result<usize> {
    usize::try_from(v).map_err(|_| anyhow::anyhow!("{flag} {v}: must be 0 or more"))
}

fn positive(flag: &str, v: i64) -> anyhow::Result<usize> {
    match count(flag, v)? {
        0 => bail!("{flag} 0: must be 1 or more"),
        n => Ok(n),
    }
}

impl Plan {
    fn new(a: &BenchArgs) -> anyhow::Result<Plan> {
        let threads = if a.threads.is_empty() {
            vec![std::thread::available_parallelism().map_or(1, |n| n.get())]
        } else {
            a.threads.iter().map(|&t| positive("-t", t)).collect::<anyhow::Result<_>>()?
        };
        let batch = positive("-b", a.batch_size)?;
        // As llama.cpp: a micro-batch is never larger than the batch.
        let ubatch = positive("-ub", a.ubatch_size)?.min(batch);
        let ctx = a.ctx_size.map(|c| count("-c", c)).transpose()?;
        // Checked here, before the model loads (the loader parses them again).
        CacheType::from_name(&a.cache_type_k).with_context(|| format!("-ctk {}", a.cache_type_k))?;
        CacheType::from_name(&a.cache_type_v).with_context(|| format!("-ctv {}", a.cache_type_v))?;
        let mla = MlaMode::from_name(&a.mla).with_context(|| format!("--mla {}", a.mla))?;
        let tg = a.n_gen.map(|n| count("-n", n)).transpose()?;
        let reps = a.repetitions.map(|r| positive("-r", r)).transpose()?;
        let depths: Vec<usize> = a.depth.iter().map(|&d| count("-d", d)).collect::<anyhow::Result<_>>()?;
        let (pp, tg, depths, reps) = if a.sweep {
            if a.n_prompt.is_some() {
                bail!("-p does not apply to --sweep: each row prefills -ub tokens");
            }
            if !depths.is_empty() {
                bail!("-d does not apply to --sweep: the rows run at N_KV = 0, -ub, 2 x -ub, ... up to -c");
            }
            if ctx.is_none() {
                bail!("--sweep needs -c: the context the sweep fills");
            }
            // llama-sweep-bench's default: a quarter of a micro-batch of decode steps per row.
            (ubatch, tg.unwrap_or((ubatch / 4).max(1)), vec![], reps.unwrap_or(1))
        } else {
            let pp = a.n_prompt.map(|p| count("-p", p)).transpose()?.unwrap_or(512);
            let tg = tg.unwrap_or(128);
            if pp == 0 && tg == 0 {
                bail!("-p 0 and -n 0: nothing to measure");
            }
            (pp, tg, if depths.is_empty() { vec![0] } else { depths }, reps.unwrap_or(3))
        };
        let parallel: Vec<usize> =
            a.parallel.iter().map(|&n| positive("--parallel", n)).collect::<anyhow::Result<_>>()?;
        if !parallel.is_empty() {
            if a.sweep {
                bail!("--parallel does not apply to --sweep");
            }
            if depths.iter().any(|&d| d > 0) {
                bail!("-d does not apply to --parallel: each sequence starts empty, as in llama-batched-bench");
            }
        }
        Ok(Plan { threads, sweep: a.sweep, pp, tg, depths, reps, ctx, batch, ubatch, mla, parallel })
    }

    /// The context to allocate, given the model's training context (for `-c 0`).
    fn n_ctx(&self, n_ctx_train: usize) -> anyhow::Result<usize> {
        let ctx = self.ctx.map(|c| if c == 0 { n_ctx_train } else { c });
        if self.sweep {
            let c = ctx.unwrap_or(n_ctx_train);
            if self.ubatch > c {
                bail!("-ub {} is larger than -c {c}", self.ubatch);
            }
            if self.tg > c {
                bail!("-n {} decode steps do not fit in -c {c}: no sweep row", self.tg);
            }
            return Ok(c);
        }
        // each sequence of --parallel keeps its prompt while it decodes
        let need = match self.parallel.is_empty() {
            true => self.depths.iter().max().copied().unwrap_or(0) + self.pp.max(self.tg),
            false => self.pp + self.tg,
        };
        match ctx {
            Some(c) if c < need => bail!(
                "-c {c} is too small: -d {} + max(-p {}, -n {}) = {need} positions are needed",
                self.depths.iter().max().copied().unwrap_or(0),
                self.pp,
                self.tg
            ),
            Some(c) => Ok(c),
            None => Ok(need.max(1)),
        }
    }

    /// The N_KV of each sweep row: as llama-sweep-bench, every multiple of -ub whose decode
    /// steps and micro-batch each fit the context from there (`-c 3584 -ub 512` ends at 3072).
    fn sweep_depths(&self, n_ctx: usize) -> Vec<usize> {
        (0..).map(|i| i * self.ubatch).take_while(|&d| d + self.ubatch.max(self.tg) <= n_ctx).collect()
    }
}

/// The random tokens: [`SplitMix64`], a small, seeded generator (quality is not a concern here).
struct Rng(SplitMix64);

impl Rng {
    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2^-32 for any vocabulary).
    fn below(&mut self, n: usize) -> u32 {
        ((self.0.next_u64() as u128 * n as u128) >> 64) as u32
    }

    fn tokens(&mut self, n: usize, n_vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(n_vocab)).collect()
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The model and context of one thread count, with the progress bar its decode calls advance.
struct Runner<'a> {
    ctx: Context,
    rng: Rng,
    batch: usize,
    n_vocab: usize,
    pb: &'a ProgressBar,
}

impl Runner<'_> {
    /// Appends `n` random tokens in decode calls of at most `-b` tokens (each split into micro-batches
    /// by the context), logits for the last token of each call, as llama-bench submits a prompt.
    fn prefill(&mut self, n: usize) -> anyhow::Result<()> {
        let tokens = self.rng.tokens(n, self.n_vocab);
        for chunk in tokens.chunks(self.batch) {
            let start = self.ctx.seq_len(SEQ) as u32;
            self.ctx.decode(&Batch::sequence(chunk, start, SEQ, false))?;
            self.pb.inc(chunk.len() as u64);
        }
        Ok(())
    }

    /// Decodes `n` random tokens one at a time.
    fn generate(&mut self, n: usize) -> anyhow::Result<()> {
        for _ in 0..n {
            let t = self.rng.below(self.n_vocab);
            let start = self.ctx.seq_len(SEQ) as u32;
            self.ctx.decode(&Batch::sequence(&[t], start, SEQ, true))?;
            self.pb.inc(1);
        }
        Ok(())
    }

    /// Sequences `0..np`, each appending `n` random tokens, in one batch (decode calls of at most
    /// `-b` tokens), logits for each sequence's last token, as llama-batched-bench.
    fn prefill_all(&mut self, np: usize, n: usize) -> anyhow::Result<()> {
        let mut all = Batch::default();
        for seq in 0..np {
            let b = Batch::sequence(&self.rng.tokens(n, self.n_vocab), self.ctx.seq_len(seq) as u32, seq, false);
            all.tokens.extend(b.tokens);
            all.pos.extend(b.pos);
            all.seq.extend(b.seq);
            all.logits.extend(b.logits);
        }
        for start in (0..all.len()).step_by(self.batch.max(1)) {
            let end = (start + self.batch).min(all.len());
            let chunk = Batch {
                tokens: all.tokens[start..end].to_vec(),
                pos: all.pos[start..end].to_vec(),
                seq: all.seq[start..end].to_vec(),
                logits: all.logits[start..end].to_vec(),
            };
            self.ctx.decode(&chunk)?;
            self.pb.inc(chunk.len() as u64);
        }
        Ok(())
    }

    /// `n` steps, each decoding one random token of every sequence `0..np` together.
    fn generate_all(&mut self, np: usize, n: usize) -> anyhow::Result<()> {
        for _ in 0..n {
            let mut b = Batch::default();
            for seq in 0..np {
                b.tokens.push(self.rng.below(self.n_vocab));
                b.pos.push(self.ctx.seq_len(seq) as u32);
                b.seq.push(seq);
                b.logits.push(true);
            }
            self.ctx.decode(&b)?;
            self.pb.inc(np as u64);
        }
        Ok(())
    }

    /// Brings the cache to exactly `depth` tokens (untimed): by a prefill, or with zero rows.
    fn fill_to(&mut self, depth: usize, zeros: bool) -> anyhow::Result<()> {
        let len = self.ctx.seq_len(SEQ);
        if len > depth {
            self.ctx.truncate(SEQ, depth);
        } else if zeros {
            self.ctx.append_zero_rows(SEQ, depth - len)?;
            self.pb.inc((depth - len) as u64);
        } else {
            self.prefill(depth - len)?;
        }
        Ok(())
    }

    fn timed(&mut self, f: impl FnOnce(&mut Self) -> anyhow::Result<()>) -> anyhow::Result<f64> {
        let start = Instant::now();
        f(self)?;
        Ok(start.elapsed().as_secs_f64())
    }
}

/// Builds a row from the times of the repetitions.
fn row(threads: usize, n_kv: usize, pp: usize, tg: usize, t_pp: &mut [f64], t_tg: &mut [f64]) -> Row {
    batch_row(threads, 1, n_kv, pp, tg, t_pp, t_tg)
}

/// A row of `np` sequences: the speeds count every sequence's tokens.
fn batch_row(threads: usize, np: usize, n_kv: usize, pp: usize, tg: usize, t_pp: &mut [f64], t_tg: &mut [f64]) -> Row {
    let part = |n: usize, times: &mut [f64]| {
        if n == 0 || times.is_empty() {
            return (None, None);
        }
        let t = median(times).max(1e-9);
        (Some(t), Some((n * np) as f64 / t))
    };
    let (t_pp_s, s_pp_tps) = part(pp, t_pp);
    let (t_tg_s, s_tg_tps) = part(tg, t_tg);
    Row {
        threads,
        n_parallel: np,
        n_kv,
        pp,
        tg,
        t_pp_s,
        s_pp_tps,
        t_tg_s,
        s_tg_tps,
        roofline_pct: None,
        gpu: BTreeMap::new(),
        cpu_busy_s_per_token: None,
        major_faults_per_pp_token: None,
        major_faults_per_tg_token: None,
    }
}

/// This process's major page faults so far (those that read from storage).
fn major_faults() -> u64 {
    // SAFETY: getrusage writes only the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable rusage.
    match unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } {
        0 => u.ru_majflt as u64,
        _ => 0,
    }
}

const TABLE_HEADER: &str = "|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |\n\
                            |-------|--------|--------|----------|----------|----------|----------|";

const BATCH_HEADER: &str =
    "|    PP |     TG |    B |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | S_TG/seq |      T s |    S t/s |\n\
     |-------|--------|------|----------|----------|----------|----------|----------|----------|----------|";

/// llama-batched-bench's line, with the decode speed each sequence sees.
fn batch_line(r: &Row) -> String {
    let f = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    let total = r.t_pp_s.unwrap_or(0.0) + r.t_tg_s.unwrap_or(0.0);
    let tokens = r.n_parallel * (r.pp + r.tg);
    format!(
        "|{:>6} | {:>6} | {:>4} | {:>8} | {:>8} | {:>8} | {:>8} | {:>8} | {:>8} | {:>8} |",
        r.pp,
        r.tg,
        r.n_parallel,
        f(r.t_pp_s, 3),
        f(r.s_pp_tps, 2),
        f(r.t_tg_s, 3),
        f(r.s_tg_tps, 2),
        f(r.s_tg_tps.map(|s| s / r.n_parallel as f64), 2),
        f(Some(total), 3),
        f((total > 0.0).then(|| tokens as f64 / total), 2)
    )
}

fn table_line(r: &Row) -> String {
    let f = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    format!(
        "|{:>6} | {:>6} | {:>6} | {:>8} | {:>8} | {:>8} | {:>8} |",
        r.pp,
        r.tg,
        r.n_kv,
        f(r.t_pp_s, 3),
        f(r.s_pp_tps, 2),
        f(r.t_tg_s, 3),
        f(r.s_tg_tps, 2)
    )
}

/// Where the text goes: stdout, or stderr when stdout carries the JSON. Writes pause the progress bar.
struct Out<'a> {
    json: bool,
    pb: &'a ProgressBar,
}

impl Out<'_> {
    fn line(&self, s: &str) -> anyhow::Result<()> {
        self.pb.suspend(|| {
            let r = if self.json {
                writeln!(std::io::stderr().lock(), "{s}")
            } else {
                let mut o = std::io::stdout().lock();
                writeln!(o, "{s}").and_then(|_| o.flush())
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                r => r.context("writing the table"),
            }
        })
    }
}

/// Tokens the progress bar counts for one thread count: warm-up, cache fills and timed tokens.
fn progress_total(plan: &Plan, n_ctx: usize, warmup: bool) -> u64 {
    let warm = if warmup { plan.pp.min(plan.ubatch) + plan.tg.min(1) } else { 0 } as u64;
    let timed = (plan.reps * (plan.pp + plan.tg)) as u64;
    if plan.sweep {
        return warm + plan.sweep_depths(n_ctx).len() as u64 * timed;
    }
    if !plan.parallel.is_empty() {
        return warm + plan.parallel.iter().map(|&np| (np * plan.reps * (plan.pp + plan.tg)) as u64).sum::<u64>();
    }
    let mut len = 0usize;
    let mut fill = 0u64;
    for &d in &plan.depths {
        fill += d.saturating_sub(len) as u64;
        len = d;
    }
    warm + fill + plan.depths.len() as u64 * timed
}

/// The runtime flags of the loader's spec: bench's tests set the context, batch and cache.
fn load_runtime(a: &BenchArgs, plan: &Plan) -> RuntimeArgs {
    let t = plan.threads.first().map(|&t| t as i64);
    RuntimeArgs {
        threads: t,
        threads_batch: t,
        ctx_size: plan.ctx.unwrap_or(0),
        batch_size: plan.batch,
        ubatch_size: plan.ubatch,
        cache_type_k: a.cache_type_k.clone(),
        cache_type_v: a.cache_type_v.clone(),
        parallel: 1,
        mla: a.mla.clone(),
        mla_cache: a.mla_cache.clone(),
    }
}

fn run_threads(
    opened: &Opened,
    plan: &Plan,
    n_ctx: usize,
    t: usize,
    a: &BenchArgs,
    out: &Out,
) -> anyhow::Result<Vec<Row>> {
    let model = &opened.model;
    // Repacking packs once (the first thread count); later ones find the copies made.
    let up = out.pb.suspend(|| opened.bring_up(t, t, n_ctx))?;
    for line in &up.notes {
        out.pb.suspend(|| tracing::info!("{line}"));
    }
    let ctx = up.ctx;
    let mut r = Runner { ctx, rng: Rng(SplitMix64(a.seed)), batch: plan.batch, n_vocab: model.n_vocab(), pb: out.pb };
    out.line(&format!(
        "\nmain: n_kv_max = {n_ctx}, n_batch = {}, n_ubatch = {}, n_threads = {t}, n_threads_batch = {t}, type_k = {}, type_v = {}, mla = {}, repetitions = {}\n",
        plan.batch,
        plan.ubatch,
        a.cache_type_k.to_ascii_lowercase(),
        a.cache_type_v.to_ascii_lowercase(),
        plan.mla.name(),
        plan.reps
    ))?;
    out.line(if plan.parallel.is_empty() { TABLE_HEADER } else { BATCH_HEADER })?;
    if !a.no_warmup {
        out.pb.set_message(format!("-t {t}: warm-up"));
        r.prefill(plan.pp.min(plan.ubatch))?;
        r.ctx.truncate(SEQ, 0);
        r.generate(plan.tg.min(1))?;
        r.ctx.truncate(SEQ, 0);
    }
    if !plan.parallel.is_empty() {
        return run_parallel(&mut r, plan, t, out);
    }
    let mut rows = Vec::new();
    let depths = if plan.sweep { plan.sweep_depths(n_ctx) } else { plan.depths.clone() };
    for &d in &depths {
        out.pb.set_message(format!("-t {t}: N_KV {d}"));
        r.fill_to(d, a.zero_depth)?;
        let (mut t_pp, mut t_tg) = (Vec::new(), Vec::new());
        let mut decode_ledger: Vec<tandem_model::Counts> = Vec::new();
        let (mut faults_pp, mut faults_tg) = (0u64, 0u64);
        for rep in 0..plan.reps {
            out.pb.set_message(format!("-t {t}: N_KV {d}, repetition {}/{}", rep + 1, plan.reps));
            // llama-sweep-bench decodes at N_KV first, then prefills the row's micro-batch there
            // (kept for the next row); llama-bench's tests each start at the depth.
            let order = if plan.sweep { [false, true] } else { [true, false] };
            for prefill in order {
                if prefill && plan.pp > 0 {
                    let f0 = major_faults();
                    t_pp.push(r.timed(|r| r.prefill(plan.pp))?);
                    faults_pp += major_faults() - f0;
                    if !plan.sweep {
                        r.ctx.truncate(SEQ, d);
                    }
                }
                if !prefill && plan.tg > 0 {
                    let base = r.ctx.seq_len(SEQ);
                    let before: Vec<_> = r.ctx.exec().ledgers().into_iter().map(|(_, c)| c).collect();
                    let f0 = major_faults();
                    t_tg.push(r.timed(|r| r.generate(plan.tg))?);
                    faults_tg += major_faults() - f0;
                    let after = r.ctx.exec().ledgers();
                    decode_ledger.resize(after.len(), tandem_model::Counts::default());
                    for ((sum, (_, a)), b) in decode_ledger.iter_mut().zip(&after).zip(&before) {
                        *sum = *sum + (*a - *b);
                    }
                    r.ctx.truncate(SEQ, base);
                }
            }
            // The sweep keeps the last repetition's prefill: the next row starts at N_KV + UB.
            if rep + 1 < plan.reps || !plan.sweep {
                r.ctx.truncate(SEQ, d);
            }
        }
        let mut row = row(t, d, plan.pp, plan.tg, &mut t_pp, &mut t_tg);
        out.line(&table_line(&row))?;
        let per = |faults: u64, n: usize| (n > 0).then(|| faults as f64 / n as f64);
        row.major_faults_per_pp_token = per(faults_pp, plan.pp * t_pp.len());
        row.major_faults_per_tg_token = per(faults_tg, plan.tg * t_tg.len());
        if faults_pp + faults_tg > 0 {
            let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
            out.line(&format!(
                "  page faults that waited for storage: {} per prompt token, {} per decoded token",
                f(row.major_faults_per_pp_token),
                f(row.major_faults_per_tg_token)
            ))?;
        }
        // Devices other than the CPU: what they did per decoded token; and the CPU's busy time.
        let decoded = plan.tg * t_tg.len();
        for ((name, _), c) in r.ctx.exec().ledgers().iter().zip(&decode_ledger).skip(1) {
            let per = PerToken::of(c, decoded);
            out.line(&format!("  {}", per.line(name)))?;
            row.gpu.insert(name.clone(), per);
        }
        if let (false, Some(cpu)) = (row.gpu.is_empty(), decode_ledger.first()) {
            let busy = cpu.busy_ns as f64 * 1e-9 / decoded.max(1) as f64;
            out.line(&format!(
                "  CPU per decoded token: {:.2} ms in its ops, of {:.2} ms",
                busy * 1e3,
                row.t_tg_s.map_or(0.0, |t| t / plan.tg.max(1) as f64 * 1e3)
            ))?;
            row.cpu_busy_s_per_token = Some(busy);
        }
        rows.push(row);
    }
    Ok(rows)
}

/// The `--parallel` rows of one thread count.
fn run_parallel(r: &mut Runner, plan: &Plan, t: usize, out: &Out) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &np in &plan.parallel {
        let (mut t_pp, mut t_tg) = (Vec::new(), Vec::new());
        for rep in 0..plan.reps {
            out.pb.set_message(format!("-t {t}: {np} sequences, repetition {}/{}", rep + 1, plan.reps));
            for seq in 0..np {
                r.ctx.truncate(seq, 0);
            }
            if plan.pp > 0 {
                t_pp.push(r.timed(|r| r.prefill_all(np, plan.pp))?);
            }
            if plan.tg > 0 {
                t_tg.push(r.timed(|r| r.generate_all(np, plan.tg))?);
            }
        }
        for seq in 0..np {
            r.ctx.truncate(seq, 0);
        }
        let row = batch_row(t, np, 0, plan.pp, plan.tg, &mut t_pp, &mut t_tg);
        out.line(&batch_line(&row))?;
        rows.push(row);
    }
    Ok(rows)
}

fn human_bytes(b: u64) -> String {
    if b >= GIB {
        format!("{:.2} GiB", b as f64 / GIB as f64)
    } else {
        format!("{:.2} MiB", b as f64 / MIB as f64)
    }
}

pub fn run(a: &BenchArgs) -> anyhow::Result<()> {
    a.compat.print_notes();
    let plan = Plan::new(a)?;
    let bw_bytes = match a.bandwidth_mib {
        Some(m) => count("--bandwidth-mib", m)? as u64 * MIB,
        None => default_bandwidth_bytes(),
    };
    if let Some(p) = &a.plot {
        // Fail now rather than after the whole benchmark.
        std::fs::File::create(p).with_context(|| format!("--plot: creating {}", p.display()))?;
    }
    let mut spec = LoadSpec::from_args(&a.model, &load_runtime(a, &plan), &a.placement)?;
    spec.progress = !a.no_progress;
    let opened = spec.open()?;
    let model = opened.model.clone();
    let gguf = model.gguf();
    let active = active_bytes_per_token(gguf).with_context(|| format!("{}", a.model.path().display()))?;
    let n_ctx = plan.n_ctx(model.n_ctx_train())?;

    let pb = if a.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    };
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} tokens ({elapsed} elapsed, eta {eta})")?
            .progress_chars("=> "),
    );
    let out = Out { json: a.json, pb: &pb };
    out.line(&format!(
        "model: {} ({}, {} layers, vocab {})",
        a.model.path().display(),
        model.arch().name(),
        model.n_layer(),
        model.n_vocab()
    ))?;
    out.line(&format!("active weights per decoded token: {} ({active} bytes)", human_bytes(active)))?;
    let (hint, light) = (tandem_cpu::Prefetch::detected(), tandem_cpu::Prefetch::detected_light());
    let light = if light == hint { String::new() } else { format!(", {light} for packed Q8_0") };
    out.line(&format!(
        "CPU kernels: {}, weight prefetch {hint}{light} (TANDEM_CPU_ISA, TANDEM_PREFETCH)",
        tandem_cpu::Isa::detected(),
    ))?;

    let bandwidth = if bw_bytes > 0 { measure_bandwidth(&plan.threads, bw_bytes, &pb) } else { BTreeMap::new() };
    if !bandwidth.is_empty() {
        let each: Vec<String> = bandwidth.iter().map(|(t, g)| format!("-t {t}: {g:.2} GB/s")).collect();
        out.line(&format!(
            "memory read bandwidth (best of {} passes over {}): {}",
            2 * BANDWIDTH_RUNS,
            human_bytes(bw_bytes),
            each.join(", ")
        ))?;
    }

    let per_t = progress_total(&plan, n_ctx, !a.no_warmup);
    pb.set_length(per_t * plan.threads.len() as u64);
    let mut rows = Vec::new();
    let mut bandwidth = bandwidth;
    for &t in &plan.threads {
        let mut rs = run_threads(&opened, &plan, n_ctx, t, a, &out)?;
        if let Some(before) = bandwidth.get(&t).copied() {
            // Measured again after the runs: on a shared host the bandwidth can change from minute
            // to minute, and the roofline takes the better of the two.
            let after = measure_bandwidth(&[t], bw_bytes, &pb).get(&t).copied().unwrap_or(0.0);
            out.line(&format!(
                "memory read bandwidth, -t {t}: {before:.2} GB/s before the runs, {after:.2} GB/s after"
            ))?;
            bandwidth.insert(t, before.max(after));
        }
        if let Some(&gbs) = bandwidth.get(&t) {
            // (one sequence's decode: the weights one token reads, per token)
            for r in rs.iter_mut().filter(|r| r.n_parallel == 1) {
                r.roofline_pct = r.s_tg_tps.map(|s| active as f64 * s / (gbs * 1e9) * 100.0);
            }
            if plan.tg > 0 && plan.parallel.is_empty() {
                let pct: Vec<String> = rs.iter().filter_map(|r| r.roofline_pct).map(|p| format!("{p:.1}%")).collect();
                out.line(&format!(
                    "\ndecode roofline, -t {t}: {gbs:.2} GB/s / {} per token = {:.2} t/s; S_TG by row: {}",
                    human_bytes(active),
                    gbs * 1e9 / active.max(1) as f64,
                    pct.join(" ")
                ))?;
            }
        }
        rows.extend(rs);
    }
    pb.finish_and_clear();

    if let Some(p) = &a.plot {
        plot(p, &rows, &plan.threads, &a.model.path().display().to_string())
            .with_context(|| format!("--plot: writing {}", p.display()))?;
        out.line(&format!("plot: {}", p.display()))?;
    }
    if a.json {
        let report = Report {
            model: a.model.path().display().to_string(),
            threads: &plan.threads,
            active_bytes_per_token: active,
            read_bandwidth_gbs: bandwidth.iter().map(|(t, g)| (t.to_string(), *g)).collect(),
            repack: a.model.load.repacks() && tandem_cpu::packed::packing_pays(),
            rows: &rows,
        };
        let mut o = std::io::stdout().lock();
        serde_json::to_writer(&mut o, &report)?;
        match writeln!(o).and_then(|_| o.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            r => r.context("writing to stdout")?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::memory::sum_slice;
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn random_tokens_are_seeded_and_in_range() {
        let a = Rng(SplitMix64(7)).tokens(1000, 13);
        assert_eq!(a, Rng(SplitMix64(7)).tokens(1000, 13));
        assert!(a.iter().all(|&t| t < 13));
        // Every id of a small vocabulary shows up.
        assert!((0..13).all(|id| a.contains(&id)));
    }

    #[test]
    fn sum_covers_every_word() {
        let v: Vec<u64> = (1..=1003).collect();
        assert_eq!(sum_slice(&v, false), 1003 * 1004 / 2);
        assert_eq!(sum_slice(&v, true), 1003 * 1004 / 2);
    }
}
