//! Command-line arguments shared by tandem's commands, spelled as llama.cpp spells them so that a
//! llama-server command line works with the binary name changed (DESIGN.md "Contracts").
//!
//! clap's short flags are one character; llama.cpp's multi-letter single-dash flags (`-ngl`,
//! `-ctk`, ...) are rewritten to their long forms by [`normalize_args`] before parsing.

use clap::Args;
use std::ffi::OsString;
use std::path::PathBuf;

/// llama.cpp's multi-letter single-dash flags and the long flag each one means.
pub const MULTI_LETTER_FLAGS: &[(&str, &str)] = &[
    ("-hf", "--hf-repo"),
    ("-hfr", "--hf-repo"),
    ("-hff", "--hf-file"),
    ("-hft", "--hf-token"),
    ("-mu", "--model-url"),
    ("-ngl", "--n-gpu-layers"),
    ("-ot", "--override-tensor"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-tb", "--threads-batch"),
    ("-ub", "--ubatch-size"),
    ("-np", "--parallel"),
    ("-npl", "--parallel"),
    ("-ncmoe", "--n-cpu-moe"),
    ("-cmoe", "--cpu-moe"),
    ("-mla", "--mla-use"),
    ("-amb", "--attn-max-batch"),
    ("-fa", "--flash-attn"),
    ("-fmoe", "--fused-moe"),
    ("-rtr", "--run-time-repack"),
    ("-nr", "--no-repack"),
    ("-ser", "--smart-expert-reduction"),
    ("-nkvo", "--no-kv-offload"),
    ("-dev", "--device"),
    ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"),
    ("-mg", "--main-gpu"),
    ("-fit", "--fit"),
    ("-fitt", "--fit-target"),
    ("-cb", "--cont-batching"),
    ("-nocb", "--no-cont-batching"),
    ("-sys", "--system-prompt"),
    ("-cnv", "--conversation"),
    ("-no-cnv", "--no-conversation"),
    ("-st", "--single-turn"),
    ("-to", "--timeout"),
    ("-kvu", "--kv-unified"),
];

/// Rewrites llama.cpp's multi-letter single-dash flags (also in `-ngl=99` form) to long flags.
/// Everything after a bare `--` is left alone.
pub fn normalize_args<I: IntoIterator<Item = OsString>>(args: I) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut rest = false;
    for a in args {
        if rest {
            out.push(a);
            continue;
        }
        let Some(s) = a.to_str() else {
            out.push(a);
            continue;
        };
        if s == "--" {
            rest = true;
            out.push(a);
            continue;
        }
        let (flag, value) = match s.split_once('=') {
            Some((f, v)) => (f, Some(v)),
            None => (s, None),
        };
        match MULTI_LETTER_FLAGS.iter().find(|(short, _)| *short == flag) {
            Some((_, long)) => out.push(match value {
                Some(v) => format!("{long}={v}").into(),
                None => (*long).into(),
            }),
            None => out.push(a),
        }
    }
    out
}

/// A command-line parser's error message in one line: its lines joined, without the usage
/// summary and the pointer to `--help` (which the line ends with instead).
/// `message` safe to print on one line of a terminal: control characters (newlines, escape
/// sequences, carriage returns), which may come from a model file's keys and strings, are written as
/// `\n`, `\u{1b}`.
pub fn printable(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for c in message.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

pub fn one_line(message: &str) -> String {
    let parts: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .collect();
    let text = parts.join(" ");
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    format!("{text} (see --help)")
}

/// Which model to open and how its files are brought into memory.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// The model: a .gguf file, or any shard of a split model (NAME-00001-of-00013.gguf).
    #[arg(short = 'm', long = "model", value_name = "FILE", required_unless_present_any = ["hf_repo", "model_url"],
          conflicts_with_all = ["hf_repo", "model_url"])]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub hub: crate::hub::HubArgs,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// How a model's files are brought into memory and whether its weights are repacked.
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Read the files into memory instead of memory-mapping them.
    #[arg(long)]
    pub no_mmap: bool,
    /// Lock the model's memory so it is never paged out.
    #[arg(long)]
    pub mlock: bool,
    /// Repack the Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
    /// matrices the CPU multiplies into 16-row interleaved groups at load (faster prefill and
    /// decode, with AVX-512 or AVX2; a second copy of those weights in memory, made only when it
    /// fits).
    /// The default, as in llama.cpp; --no-repack turns it off.
    #[arg(long, overrides_with = "no_repack")]
    pub repack: bool,
    /// Use the weights as they are stored: no repacked copy (llama.cpp's -nr).
    #[arg(long = "no-repack", overrides_with = "repack")]
    pub no_repack: bool,
    /// Ask the kernel ahead for weights of a model mapped from storage: each layer's experts as
    /// soon as the router picks them, the next layer's weights while one runs (storage reads
    /// overlap the work). auto: when the CPU's part of the model exceeds the memory this process
    /// may take (MemAvailable, or a container's memory limit).
    #[arg(long = "read-ahead", value_name = "WHEN", value_enum, default_value_t = crate::load::ReadAhead::Auto)]
    pub read_ahead: crate::load::ReadAhead,
    /// Change the model's metadata before it is read, as llama.cpp: KEY=TYPE:VALUE with TYPE
    /// int, float, bool or str (e.g. deepseek2.expert_used_count=int:6); repeat the flag or
    /// separate with commas. The model's checks apply to the values as to the file's.
    #[arg(long = "override-kv", value_name = "KEY=TYPE:VALUE,...", value_delimiter = ',')]
    pub override_kv: Vec<String>,
}

impl LoadArgs {
    /// Whether the weights are repacked at load: unless `--no-repack` came after any `--repack`.
    pub fn repacks(&self) -> bool {
        !self.no_repack
    }

    pub fn load_options(&self) -> tandem_gguf::LoadOptions {
        tandem_gguf::LoadOptions { mmap: !self.no_mmap, mlock: self.mlock }
    }

    /// `--override-kv`'s keys and values; a malformed one is an error naming the flag.
    pub fn overrides(&self) -> anyhow::Result<Vec<(String, tandem_gguf::Value)>> {
        let parse = |s: &String| tandem_gguf::parse_kv_override(s).map_err(|e| anyhow::anyhow!("--override-kv {e}"));
        self.override_kv.iter().map(parse).collect()
    }
}

impl ModelArgs {
    /// The model file (after [`ModelArgs::resolve`] for `-hf`).
    pub fn path(&self) -> &std::path::Path {
        self.model.as_deref().unwrap_or(std::path::Path::new(""))
    }

    /// Downloads the model `-hf` / `--model-url` names (unless cached) and points `-m` at it.
    pub fn resolve(&mut self) -> anyhow::Result<()> {
        if self.model.is_none() && self.hub.wanted() {
            self.model = Some(self.hub.fetch()?);
        }
        Ok(())
    }
}

/// Threads, context and batching, as llama.cpp names them.
#[derive(Args, Debug, Clone)]
pub struct RuntimeArgs {
    /// Threads for single-token (decode) steps (0 or less = all cores, as llama.cpp) [default: all cores].
    #[arg(short = 't', long = "threads", value_name = "N", allow_negative_numbers = true)]
    pub threads: Option<i64>,
    /// Threads for batches (prefill) (0 or less = all cores) [default: --threads].
    #[arg(long = "threads-batch", value_name = "N", allow_negative_numbers = true)]
    pub threads_batch: Option<i64>,
    /// Context size in tokens (0 = the model's training context).
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Logical batch size: the most tokens submitted to one decode call.
    #[arg(short = 'b', long = "batch-size", value_name = "N", default_value_t = 2048)]
    pub batch_size: usize,
    /// Physical micro-batch size: the most tokens computed in one forward pass.
    #[arg(long = "ubatch-size", value_name = "N", default_value_t = 512)]
    pub ubatch_size: usize,
    /// KV cache type for K: f32, f16, bf16, q8_0, q4_0.
    #[arg(long = "cache-type-k", value_name = "TYPE", default_value = "f16")]
    pub cache_type_k: String,
    /// KV cache type for V: f32, f16, bf16, q8_0, q4_0.
    #[arg(long = "cache-type-v", value_name = "TYPE", default_value = "f16")]
    pub cache_type_v: String,
    /// Parallel sequences (server slots).
    #[arg(long = "parallel", value_name = "N", default_value_t = 1)]
    pub parallel: usize,
    /// MLA attention (DeepSeek/Kimi): auto (the default) = keys and values rebuilt from the latent
    /// for long prompt runs on the CPU, where that takes fewer operations (1.5x faster prefill of
    /// 512 tokens at depth 3072; its logits differ from llama.cpp's less than llama.cpp's flash
    /// attention does), absorbed for decoding; absorbed = always over the cached latent,
    /// llama.cpp's arithmetic; decompressed = always rebuilt.
    #[arg(long = "mla", value_name = "absorbed|auto|decompressed", default_value = "auto")]
    pub mla: String,
    /// Memory for the keys and values the decompressed MLA form rebuilds from the cached latent,
    /// kept so that the next prompt of a sequence (a conversation's next turn, a long prompt's
    /// next micro-batch) rebuilds only its own rows: a size (e.g. 8GiB; 0 keeps none) or auto,
    /// half the host memory the placement plan leaves free (and at most half of what is
    /// available now). On Kimi K2 a position takes 4 MiB, on the bench model 192 KiB.
    #[arg(long = "mla-cache", value_name = "auto|SIZE", default_value = "auto")]
    pub mla_cache: String,
}

/// Where tensors go: llama.cpp's placement flags, plus `--gpu` to plan for hardware that is not
/// there. Turned into a `tandem_plan::PlanRequest` by `tandem::load::request`.
#[derive(Args, Debug, Clone, Default)]
pub struct PlacementArgs {
    /// Layers on the GPU, counted from the output end: 999 or `all` = every layer, `auto` = --fit.
    #[arg(long = "n-gpu-layers", visible_alias = "gpu-layers", value_name = "N")]
    pub n_gpu_layers: Option<tandem_plan::GpuLayers>,
    /// PATTERN=DEVICE[,PATTERN=DEVICE...]: tensors whose name matches the regex go to DEVICE
    /// (CPU, CUDA0, ...). Repeatable; rules are tried in order and the first match wins.
    #[arg(long = "override-tensor", value_name = "PATTERN=DEVICE,...")]
    pub override_tensor: Vec<String>,
    /// Keep every routed-expert tensor on the CPU.
    #[arg(long = "cpu-moe")]
    pub cpu_moe: bool,
    /// Keep the routed-expert tensors of the first N layers on the CPU.
    #[arg(long = "n-cpu-moe", value_name = "N")]
    pub n_cpu_moe: Option<u32>,
    /// Declare a GPU and the memory the plan may use on it, e.g. CUDA0=96GiB (repeatable).
    #[arg(long = "gpu", value_name = "CUDAn=SIZE")]
    pub gpu: Vec<String>,
    /// Fit the placement to the GPUs' memory [default: on when neither -ngl nor -ot is given].
    #[arg(long = "fit", value_name = "on|off", num_args = 0..=1, default_missing_value = "on",
          value_parser = ["on", "off"])]
    pub fit: Option<String>,
    /// Memory --fit leaves free on each GPU: MiB (as llama.cpp's -fitt), or a size like 2GiB [default: 1024].
    #[arg(long = "fit-target", value_name = "MiB")]
    pub fit_target: Option<String>,
    /// Host memory tandem may use, e.g. 768GiB [default: this machine's].
    #[arg(long = "host-memory", value_name = "SIZE")]
    pub host_memory: Option<String>,
    /// Keep the KV cache in host memory.
    #[arg(long = "no-kv-offload")]
    pub no_kv_offload: bool,
}

/// The chat template, as llama.cpp takes it.
/// llama.cpp's sampling flags, shared by `run` (this run's parameters) and `serve` (what a request
/// that leaves one out gets, as llama-server). Unset flags keep the defaults the caller gives.
#[derive(Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Sampling temperature (0 = greedy: always the most likely token) [default: 0.8].
    #[arg(long = "temp", value_name = "T", allow_negative_numbers = true)]
    pub temp: Option<f32>,
    /// Random seed (-1 = a new one each run or request, as without it).
    #[arg(short = 's', long = "seed", value_name = "N", allow_negative_numbers = true)]
    pub seed: Option<i64>,
    /// Keep the K most likely tokens (0 or less = all) [default: 40].
    #[arg(long = "top-k", value_name = "K", allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Keep the most likely tokens up to this total probability (1 = all) [default: 0.95].
    #[arg(long = "top-p", value_name = "P", allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0 = none) [default: 0.05].
    #[arg(long = "min-p", value_name = "P", allow_negative_numbers = true)]
    pub min_p: Option<f32>,
    /// Penalise repeating the last --repeat-last-n tokens (1 = off) [default: 1].
    #[arg(long = "repeat-penalty", value_name = "X", allow_negative_numbers = true)]
    pub repeat_penalty: Option<f32>,
    /// How many recent tokens the penalties look at (-1 = the whole context) [default: 64].
    #[arg(long = "repeat-last-n", value_name = "N", allow_negative_numbers = true)]
    pub repeat_last_n: Option<i64>,
    /// Subtract X from the logit of every recent token (0 = off) [default: 0].
    #[arg(long = "presence-penalty", value_name = "X", allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    /// Subtract X times its count from the logit of every recent token (0 = off) [default: 0].
    #[arg(long = "frequency-penalty", value_name = "X", allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    /// Add BIAS to a token's logit, e.g. `-l 15043+1`, `-l 15043-1`; `-l 15043-inf` bans the token
    /// (repeatable). A request's own logit_bias replaces these.
    #[arg(short = 'l', long = "logit-bias", value_name = "TOKEN_ID(+/-)BIAS", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Locally typical sampling: keep tokens of typical surprise up to probability P (1 = off) [default: 1].
    #[arg(long = "typical", value_name = "P", allow_negative_numbers = true)]
    pub typical: Option<f32>,
    /// Drop tokens more than N standard deviations of the logits below the top (0 or less = off) [default: -1].
    #[arg(long = "top-nsigma", value_name = "N", allow_negative_numbers = true)]
    pub top_nsigma: Option<f32>,
    /// XTC: the chance per token of dropping the likeliest tokens (0 = off) [default: 0].
    #[arg(long = "xtc-probability", value_name = "P", allow_negative_numbers = true)]
    pub xtc_probability: Option<f32>,
    /// XTC: how likely a token must be to be dropped (above 0.5 = off) [default: 0.1].
    #[arg(long = "xtc-threshold", value_name = "T", allow_negative_numbers = true)]
    pub xtc_threshold: Option<f32>,
    /// Mirostat 1 or 2 instead of the other samplers and the penalties (0 = off) [default: 0].
    #[arg(long = "mirostat", value_name = "N", allow_negative_numbers = true)]
    pub mirostat: Option<i64>,
    /// Mirostat's learning rate, eta [default: 0.1].
    #[arg(long = "mirostat-lr", value_name = "ETA", allow_negative_numbers = true)]
    pub mirostat_lr: Option<f32>,
    /// Mirostat's target entropy, tau [default: 5].
    #[arg(long = "mirostat-ent", value_name = "TAU", allow_negative_numbers = true)]
    pub mirostat_ent: Option<f32>,
    /// DRY: penalise a token that would extend a repeat of the last tokens (0 = off) [default: 0].
    #[arg(long = "dry-multiplier", value_name = "X", allow_negative_numbers = true)]
    pub dry_multiplier: Option<f32>,
    /// DRY's base: the penalty is multiplier * base^(repeat length - allowed length) [default: 1.75].
    #[arg(long = "dry-base", value_name = "X", allow_negative_numbers = true)]
    pub dry_base: Option<f32>,
    /// DRY: repeats up to this long go unpenalised [default: 2].
    #[arg(long = "dry-allowed-length", value_name = "N", allow_negative_numbers = true)]
    pub dry_allowed_length: Option<i64>,
    /// DRY: how many recent tokens it looks at (0 = off, -1 = the whole context) [default: 64].
    #[arg(long = "dry-penalty-last-n", value_name = "N", allow_negative_numbers = true)]
    pub dry_penalty_last_n: Option<i64>,
    /// A DRY sequence breaker, in place of the defaults ('\n', ':', '"', '*'); repeatable;
    /// "none" for none.
    #[arg(long = "dry-sequence-breaker", value_name = "STRING")]
    pub dry_sequence_breaker: Vec<String>,
}

/// llama.cpp's `--logit-bias` value: a token id, `+` or `-`, and the bias (`inf` allowed).
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let bad = || format!("{s:?}: want TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf");
    let at = s.find(['+', '-']).ok_or_else(bad)?;
    let id: u32 = s[..at].parse().map_err(|_| bad())?;
    let bias: f32 = s[at + 1..].parse().map_err(|_| bad())?;
    if bias.is_nan() || bias.is_sign_negative() {
        return Err(bad());
    }
    Ok((id, if s.as_bytes()[at] == b'-' { -bias } else { bias }))
}

impl SamplingArgs {
    /// The seed given, if any: a negative one (llama.cpp's -1) asks for a new one, as none does.
    pub fn given_seed(&self) -> Option<u64> {
        self.seed.and_then(|s| u64::try_from(s).ok())
    }

    /// Every `--logit-bias` token is one of the model's `n_vocab`.
    pub fn check_vocab(&self, n_vocab: usize) -> anyhow::Result<()> {
        match self.logit_bias.iter().find(|(t, _)| *t as usize >= n_vocab) {
            Some((t, _)) => anyhow::bail!("--logit-bias: token {t} is not in the vocabulary ({n_vocab} tokens)"),
            None => Ok(()),
        }
    }

    /// `d` with the flags given, in llama.cpp's meaning (top-k 0 or less keeps every token,
    /// repeat-last-n -1 is the whole context; the seed is `d`'s unless one is given), checked
    /// as a request's would be.
    pub fn params(&self, d: tandem_engine::SamplingParams) -> anyhow::Result<tandem_engine::SamplingParams> {
        let penalty_last_n = match self.repeat_last_n {
            None => d.penalty_last_n,
            Some(-1) => usize::MAX,
            Some(n) if n >= 0 => usize::try_from(n).unwrap_or(usize::MAX),
            Some(n) => anyhow::bail!("--repeat-last-n {n}: must be -1 (the whole context), 0 (off) or more"),
        };
        let p = tandem_engine::SamplingParams {
            temperature: self.temp.unwrap_or(d.temperature),
            top_k: self.top_k.map_or(d.top_k, |k| usize::try_from(k.max(0)).unwrap_or(usize::MAX)),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            penalty_last_n,
            seed: self.given_seed().unwrap_or(d.seed),
            logit_bias: if self.logit_bias.is_empty() { d.logit_bias } else { self.logit_bias.clone() },
            typical_p: self.typical.unwrap_or(d.typical_p),
            top_n_sigma: self.top_nsigma.unwrap_or(d.top_n_sigma),
            xtc_probability: self.xtc_probability.unwrap_or(d.xtc_probability),
            xtc_threshold: self.xtc_threshold.unwrap_or(d.xtc_threshold),
            mirostat: match self.mirostat {
                None => d.mirostat,
                Some(m) => u8::try_from(m)
                    .ok()
                    .filter(|&m| m <= 2)
                    .ok_or_else(|| anyhow::anyhow!("--mirostat {m}: must be 0 (off), 1 or 2"))?,
            },
            mirostat_tau: self.mirostat_ent.unwrap_or(d.mirostat_tau),
            mirostat_eta: self.mirostat_lr.unwrap_or(d.mirostat_eta),
            dry_multiplier: self.dry_multiplier.unwrap_or(d.dry_multiplier),
            // below 1 keeps the default, as llama.cpp's --dry-base
            dry_base: self.dry_base.filter(|&b| b >= 1.0).unwrap_or(d.dry_base),
            dry_allowed_length: match self.dry_allowed_length {
                None => d.dry_allowed_length,
                Some(n) => {
                    u32::try_from(n).map_err(|_| anyhow::anyhow!("--dry-allowed-length {n}: must be 0 or more"))?
                }
            },
            dry_penalty_last_n: match self.dry_penalty_last_n {
                None => d.dry_penalty_last_n,
                Some(-1) => u32::MAX,
                Some(n) => u32::try_from(n).map_err(|_| {
                    anyhow::anyhow!("--dry-penalty-last-n {n}: must be -1 (the whole context), 0 (off) or more")
                })?,
            },
            dry_sequence_breakers: match self.dry_sequence_breaker.as_slice() {
                [] => d.dry_sequence_breakers,
                given => given.iter().filter(|b| *b != "none").cloned().collect(),
            },
        };
        p.validate().map_err(|e| anyhow::anyhow!("{e} (from the sampling flags)"))?;
        Ok(p)
    }
}

#[derive(Args, Debug, Clone, Default)]
pub struct TemplateArgs {
    /// The chat template: a built-in name (chatml, llama3, deepseek3, deepseek-r1, kimi-k2, qwen,
    /// hermes) or Jinja text, instead of the model's [default: the model's; chatml if it has none].
    #[arg(long = "chat-template", value_name = "NAME|JINJA", conflicts_with = "chat_template_file")]
    pub chat_template: Option<String>,
    /// A file of Jinja to use as the chat template.
    #[arg(long = "chat-template-file", value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// More variables for the chat template, a JSON object, e.g. '{"thinking": true}' (a
    /// request's chat_template_kwargs go over them).
    #[arg(long = "chat-template-kwargs", value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
}

impl TemplateArgs {
    /// The template the flags give, if any.
    pub fn given(&self) -> anyhow::Result<Option<(String, tandem_tokenizer::TemplateSource)>> {
        if let Some(f) = &self.chat_template_file {
            let text =
                crate::tokenize::read_text_file(f).map_err(|e| anyhow::anyhow!("--chat-template-file: {e:#}"))?;
            return Ok(Some((text, tandem_tokenizer::TemplateSource::Given)));
        }
        match &self.chat_template {
            Some(v) => Ok(Some(tandem_tokenizer::resolve_template_arg(v).map_err(anyhow::Error::msg)?)),
            None => Ok(None),
        }
    }

    /// `--chat-template-kwargs` as an object (none: empty); anything else is an error.
    pub fn kwargs(&self) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
        let Some(text) = &self.chat_template_kwargs else { return Ok(serde_json::Map::new()) };
        match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(m)) => Ok(m),
            Ok(other) => anyhow::bail!("--chat-template-kwargs: {other} is not a JSON object"),
            Err(e) => anyhow::bail!("--chat-template-kwargs: not JSON ({e})"),
        }
    }
}

/// The flags of every command that runs a model for generation (`run`, `serve`, `plan`): how it
/// runs, where its tensors go, and llama.cpp's flags tandem accepts without needing them.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub placement: PlacementArgs,
    #[command(flatten)]
    pub compat: CompatArgs,
    /// llama.cpp's skip of the warm-up run (tandem runs none; `tandem bench` has its own).
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
}

impl EngineArgs {
    /// [`CompatArgs::notes`], and `--no-warmup`'s.
    pub fn notes(&self) -> Vec<String> {
        let mut n = self.compat.notes();
        if self.no_warmup {
            n.push("--no-warmup: tandem runs no warm-up at load".into());
        }
        n
    }

    /// [`EngineArgs::notes`] in the log, one `note:` line each.
    pub fn print_notes(&self) {
        for note in self.notes() {
            tracing::info!("note: {note}");
        }
    }
}

/// llama.cpp / ik_llama.cpp flags that tandem accepts so that existing command lines work, but
/// does not need: each one set yields a one-line note of what tandem does instead.
#[derive(Args, Debug, Clone, Default)]
pub struct CompatArgs {
    /// ik_llama.cpp's MLA mode (ignored: tandem's MLA form is `--mla`).
    #[arg(long = "mla-use", value_name = "N")]
    pub mla_use: Option<u32>,
    /// ik_llama.cpp's attention batch cap in MiB (ignored: attention is chunked automatically).
    #[arg(long = "attn-max-batch", value_name = "MiB")]
    pub attn_max_batch: Option<u64>,
    /// ik_llama.cpp's merged Q/K/V projection (ignored).
    #[arg(long = "merge-qkv")]
    pub merge_qkv: bool,
    /// Render chat with Jinja templates (ignored: always on).
    #[arg(long)]
    pub jinja: bool,
    /// Continuous batching (ignored: always on).
    #[arg(long = "cont-batching")]
    pub cont_batching: bool,
    /// Disable continuous batching (ignored: always on).
    #[arg(long = "no-cont-batching")]
    pub no_cont_batching: bool,
    /// ik_llama.cpp's warm-up with a full batch (ignored).
    #[arg(long = "warmup-batch")]
    pub warmup_batch: bool,
    /// Flash attention: on, off, auto (llama-bench: 1, 0) (ignored: one attention path).
    #[arg(long = "flash-attn", value_name = "on|off|auto", num_args = 0..=1, default_missing_value = "on",
          value_parser = ["on", "off", "auto", "1", "0"])]
    pub flash_attn: Option<String>,
    /// ik_llama.cpp's fused MoE (ignored).
    #[arg(long = "fused-moe", value_name = "0|1", num_args = 0..=1, default_missing_value = "1",
          value_parser = ["0", "1"])]
    pub fused_moe: Option<String>,
    /// ik_llama.cpp's run-time repacking: what tandem does by default (--repack).
    #[arg(long = "run-time-repack", conflicts_with = "no_repack")]
    pub run_time_repack: bool,
    /// ik_llama.cpp's smart expert reduction K[,T] (ignored).
    #[arg(long = "smart-expert-reduction", value_name = "K[,T]")]
    pub smart_expert_reduction: Option<String>,
    /// llama.cpp's device list (ignored: declare GPUs with --gpu).
    #[arg(long = "device", value_name = "DEV,...")]
    pub device: Option<String>,
    /// llama.cpp's multi-GPU split mode (ignored: layers are split).
    #[arg(long = "split-mode", value_name = "MODE")]
    pub split_mode: Option<String>,
    /// llama.cpp's multi-GPU split proportions (ignored: proportional to --gpu budgets).
    #[arg(long = "tensor-split", value_name = "N0,N1,...")]
    pub tensor_split: Option<String>,
    /// llama.cpp's main GPU (ignored).
    #[arg(long = "main-gpu", value_name = "N")]
    pub main_gpu: Option<u32>,
    /// llama.cpp's NUMA placement: distribute, isolate, numactl (ignored).
    #[arg(long = "numa", value_name = "MODE")]
    pub numa: Option<String>,
    /// llama.cpp's thread priority (ignored).
    #[arg(long = "prio", value_name = "N", allow_negative_numbers = true)]
    pub prio: Option<i32>,
}

impl CompatArgs {
    /// [`CompatArgs::notes`] in the log, one `note:` line each.
    pub fn print_notes(&self) {
        for note in self.notes() {
            tracing::info!("note: {note}");
        }
    }

    /// One line per flag that was given: what tandem does instead.
    pub fn notes(&self) -> Vec<String> {
        let mut n = Vec::new();
        let mut note = |given: bool, text: String| {
            if given {
                n.push(text);
            }
        };
        let v = |o: &Option<String>| o.clone().unwrap_or_default();
        note(self.mla_use.is_some(), format!("-mla {}: ignored; tandem's MLA form is set with --mla (auto, the default: keys and values rebuilt from the latent for long prompt runs; absorbed: over the latent KV cache, llama.cpp's arithmetic)", self.mla_use.unwrap_or(0)));
        note(self.attn_max_batch.is_some(), format!("-amb {}: ignored; tandem computes attention scores in chunks of {} cached positions, so their buffer does not grow with -c", self.attn_max_batch.unwrap_or(0), tandem_plan::ATTN_KV_CHUNK));
        note(self.merge_qkv, "--merge-qkv: ignored; deepseek2 has no separate Q/K/V projections to merge and tandem reads the others as stored".into());
        note(
            self.jinja,
            "--jinja: ignored; tandem always renders Jinja chat templates (the model's, or --chat-template)".into(),
        );
        note(self.cont_batching, "--cont-batching: ignored; continuous batching is always on".into());
        note(self.no_cont_batching, "--no-cont-batching: ignored; continuous batching is always on".into());
        note(self.warmup_batch, "--warmup-batch: ignored; tandem runs no warm-up batch at load".into());
        note(
            self.flash_attn.is_some(),
            format!("-fa {}: ignored; tandem has one attention path and picks it itself", v(&self.flash_attn)),
        );
        note(
            self.fused_moe.is_some(),
            "-fmoe: ignored; tandem has a single routed-expert path and no switch for it".into(),
        );
        note(
            self.run_time_repack,
            "-rtr: tandem repacks the matrices the CPU multiplies at load by default (a second copy in memory; the mapped file stays as it is; --no-repack turns it off)".into(),
        );
        note(
            self.smart_expert_reduction.is_some(),
            format!(
                "-ser {}: ignored; tandem always uses the model's expert_used_count experts",
                v(&self.smart_expert_reduction)
            ),
        );
        note(
            self.device.is_some(),
            format!(
                "-dev {}: ignored; declare GPUs with --gpu CUDA0=SIZE and place tensors with -ngl/-ot",
                v(&self.device)
            ),
        );
        note(
            self.split_mode.is_some(),
            format!("-sm {}: ignored; tandem splits whole layers across GPUs", v(&self.split_mode)),
        );
        note(
            self.tensor_split.is_some(),
            format!(
                "-ts {}: ignored; layers are split across GPUs in proportion to their --gpu memory",
                v(&self.tensor_split)
            ),
        );
        note(
            self.main_gpu.is_some(),
            format!("-mg {}: ignored; use -ot to pin tensors to a GPU", self.main_gpu.unwrap_or(0)),
        );
        note(
            self.numa.is_some(),
            format!("--numa {}: ignored; tandem does not place threads or memory by NUMA node", v(&self.numa)),
        );
        note(
            self.prio.is_some(),
            format!("--prio {}: ignored; tandem's threads keep the process's priority", self.prio.unwrap_or(0)),
        );
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &[&str]) -> Vec<String> {
        normalize_args(args.iter().map(OsString::from)).into_iter().map(|a| a.into_string().unwrap()).collect()
    }

    #[test]
    fn parser_errors_become_one_line() {
        let clap_text = "error: the following required arguments were not provided:\n  --model <FILE>\n\nUsage: tandem bench --model <FILE>\n\nFor more information, try '--help'.\n";
        assert_eq!(
            one_line(clap_text),
            "the following required arguments were not provided: --model <FILE> (see --help)"
        );
        assert_eq!(one_line("error: unexpected argument '-x' found\n"), "unexpected argument '-x' found (see --help)");
    }

    #[test]
    fn file_bytes_print_on_one_line() {
        assert_eq!(printable("key 'a\nb\x1b[31m\r' é"), "key 'a\\nb\\u{1b}[31m\\r' é");
    }

    #[test]
    fn multi_letter_flags_become_long_flags() {
        assert_eq!(
            norm(&["tandem", "-ngl", "999", "-ot", "exps=CPU", "-ctk=q8_0", "-t", "4", "-tb", "8", "-ub", "64"]),
            [
                "tandem",
                "--n-gpu-layers",
                "999",
                "--override-tensor",
                "exps=CPU",
                "--cache-type-k=q8_0",
                "-t",
                "4",
                "--threads-batch",
                "8",
                "--ubatch-size",
                "64"
            ]
        );
        // Values that look like flags and anything after `--` are left alone.
        assert_eq!(norm(&["x", "--", "-ngl"]), ["x", "--", "-ngl"]);
    }
}
