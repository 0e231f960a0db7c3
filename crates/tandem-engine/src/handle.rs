//! Starting the engine and talking to it. [`Engine::start`] warms the model up, prefills the
//! system prompt and moves the context onto its own thread; [`EngineHandle`]s (cheap clones, any
//! thread) validate and submit requests, abort them, and read the statistics.

use crate::request::{CancelFlag, Prompt, Request, Sink, MAX_LOGPROBS};
use crate::scheduler::{Command, Scheduler, SlotAction, SlotDone, SlotTask};
use crate::slot::Job;
use crate::stats::Stats;
use crate::{Constraint, Error, Result, Sampler};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use tandem_model::{Batch, Context, Model};
use tandem_tokenizer::{message, ChatTemplate, TemplateSource, Tokenizer};

/// How the engine runs.
#[derive(Clone)]
pub struct EngineConfig {
    /// Slots: requests generated at the same time (`-np`).
    pub n_parallel: usize,
    /// Requests that may wait for a slot (`--queue-size`); more are refused.
    pub queue_size: usize,
    /// Server cap on generated tokens per request (`-n`; 0 = none but the context).
    pub max_tokens: u32,
    /// Most prompt tokens computed per step, shared by the slots reading their prompts.
    pub prefill_chunk: usize,
    /// A free slot is reused for its cache when it holds at least this share of the prompt.
    pub slot_similarity: f32,
    /// Text every Generate prompt starts with, prefilled once at start.
    pub system_prompt: Option<String>,
    /// A chat template (and where it came from) to use instead of the model's; with none here and
    /// none in the model, chatml.
    pub chat_template: Option<(String, TemplateSource)>,
    /// Prompt text may appear in the log (a prompt-cache divergence shows the text around it);
    /// else only positions and hashes do, as users' prompts are not the operator's to read.
    pub log_prompts: bool,
    /// Variables for the chat template (`--chat-template-kwargs`, e.g. `{"thinking": true}`);
    /// a request's `chat_template_kwargs` go over them.
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            n_parallel: 1,
            queue_size: 64,
            max_tokens: 0,
            prefill_chunk: 512,
            slot_similarity: 0.5,
            system_prompt: None,
            log_prompts: false,
            chat_template: None,
            template_kwargs: serde_json::Map::new(),
        }
    }
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("n_parallel", &self.n_parallel)
            .field("queue_size", &self.queue_size)
            .field("max_tokens", &self.max_tokens)
            .field("prefill_chunk", &self.prefill_chunk)
            .field("slot_similarity", &self.slot_similarity)
            .field("log_prompts", &self.log_prompts)
            .finish()
    }
}

/// What is being served.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub n_vocab: usize,
    /// Positions per slot.
    pub n_ctx: usize,
    pub system_prompt_tokens: usize,
}

/// State shared by the handles and the engine thread.
pub(crate) struct Shared {
    tx: Mutex<Sender<Command>>,
    pub config: EngineConfig,
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    template_source: TemplateSource,
    /// How the template writes tool calls.
    tool_format: crate::tool_format::ToolFormat,
    pub stats: Arc<Stats>,
    pub info: EngineInfo,
    sys: Vec<u32>,
    /// The most bytes of text one token stands for.
    max_piece_bytes: usize,
    /// Ids of queued and running requests.
    inflight: Mutex<HashMap<String, CancelFlag>>,
    /// Queued plus running requests.
    pending: AtomicUsize,
    next_id: AtomicU64,
    stopped: AtomicBool,
    /// Why the engine can no longer run (a model file changed while mapped).
    broken: Mutex<Option<String>>,
    grammars: std::sync::OnceLock<std::result::Result<crate::grammar::Grammars, String>>,
    /// The DRY sequence breakers last processed against the vocabulary (most requests give the
    /// same ones).
    dry_breakers: Mutex<Option<(Vec<String>, Arc<crate::DryBreakers>)>>,
}

impl Shared {
    /// Stops taking requests for good because of `why` (logged once).
    pub fn break_down(&self, why: &str) {
        let mut broken = self.broken.lock().unwrap_or_else(|e| e.into_inner());
        if broken.is_none() {
            tracing::error!("{why}");
            *broken = Some(why.to_string());
        }
        self.stopped.store(true, Ordering::Release);
    }

    pub fn broken_reason(&self) -> Option<String> {
        self.broken.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// An error unless `k` is one of the slots (`what` names it).
    fn check_slot(&self, k: usize, what: &str) -> Result<()> {
        let n = self.config.n_parallel;
        match k < n {
            true => Ok(()),
            false => Err(Error::InvalidRequest(format!("{what} {k}: this server has {n} slots (0..{n}, -np)"))),
        }
    }

    fn unavailable(&self) -> Error {
        Error::Unavailable(self.broken_reason().unwrap_or_else(|| "the server is shutting down".into()))
    }

    pub fn release(&self, id: &str) {
        self.inflight.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The engine: its thread and a handle to it. Dropping it stops the thread.
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

/// Submits requests to the engine; clone freely.
#[derive(Clone)]
pub struct EngineHandle(Arc<Shared>);

impl Engine {
    /// Warms the model up with one token, prefills the system prompt, and starts the thread.
    pub fn start(mut ctx: Context, tokenizer: Tokenizer, config: EngineConfig) -> Result<Engine> {
        if config.n_parallel == 0 {
            return Err(Error::InvalidRequest("--parallel must be at least 1".into()));
        }
        let sys_seq = config.n_parallel;
        let warm_seq = config.n_parallel + 1;
        let warm_token = tokenizer.special_ids().bos.unwrap_or(0);
        ctx.decode(&Batch::sequence(&[warm_token], 0, warm_seq, false))?;
        ctx.truncate(warm_seq, 0);
        let sys = match config.system_prompt.as_deref() {
            Some(text) if !text.is_empty() => tokenizer.encode(text, true, true)?,
            _ => Vec::new(),
        };
        let n_ctx = ctx.params().n_ctx;
        if sys.len() >= n_ctx {
            return Err(Error::InvalidRequest(format!(
                "the system prompt is {} tokens, the context holds {n_ctx} per slot (raise -c)",
                sys.len()
            )));
        }
        if !sys.is_empty() {
            tracing::info!("prefilling the system prompt: {} tokens", sys.len());
        }
        for (k, chunk) in sys.chunks(config.prefill_chunk.max(1)).enumerate() {
            ctx.decode(&Batch::sequence(chunk, (k * config.prefill_chunk.max(1)) as u32, sys_seq, false))?;
        }
        let given = config.chat_template.clone();
        let (source, template_source) = tandem_tokenizer::choose_template(given, tokenizer.chat_template());
        if template_source == TemplateSource::Fallback {
            tracing::info!("the model has no chat template (tokenizer.chat_template): chat uses chatml, as llama-server; --chat-template NAME|JINJA or --chat-template-file F to choose");
        }
        let template = Some(ChatTemplate::new(&source, tokenizer.bos_text(), tokenizer.eos_text())?);
        let tool_format = crate::tool_format::ToolFormat::of_template(&source);
        let stats = Arc::new(Stats::default());
        stats.kv_capacity_tokens.set((n_ctx * config.n_parallel) as u64);
        // every slot idle until the scheduler's first step says otherwise
        *stats.slots.lock().unwrap_or_else(|e| e.into_inner()) = vec![Default::default(); config.n_parallel];
        let (tx, rx) = channel();
        let info = EngineInfo { n_vocab: ctx.model().n_vocab(), n_ctx, system_prompt_tokens: sys.len() };
        // the longest text one token stands for: a prompt of more bytes than twice that per
        // position cannot fit, and is refused before it is tokenized
        let max_piece_bytes = (0..tokenizer.n_vocab() as u32)
            .map(|id| tokenizer.token_to_piece(id, true).map_or(0, <[u8]>::len))
            .max()
            .unwrap_or(0)
            .max(4);
        let shared = Arc::new(Shared {
            max_piece_bytes,
            tx: Mutex::new(tx),
            model: ctx.model().clone(),
            tokenizer: Arc::new(tokenizer),
            template,
            template_source,
            tool_format,
            stats,
            info,
            sys: sys.clone(),
            inflight: Mutex::new(HashMap::new()),
            pending: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            broken: Mutex::new(None),
            grammars: std::sync::OnceLock::new(),
            dry_breakers: Mutex::new(None),
            config,
        });
        let scheduler = Scheduler::new(ctx, shared.clone(), sys_seq, sys);
        let on_thread = shared.clone();
        // The engine thread logs where the thread that started it does.
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let thread = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || {
                let _logging = tracing::dispatcher::set_default(&dispatch);
                // a bug must not leave clients waiting forever: the sinks are dropped (their
                // streams end with INTERNAL) and new requests are refused
                let run = std::panic::AssertUnwindSafe(|| scheduler.run(rx));
                if std::panic::catch_unwind(run).is_err() {
                    on_thread.stopped.store(true, Ordering::Release);
                    tracing::error!("the engine thread panicked; new requests are refused");
                }
            })
            .map_err(|e| Error::Unavailable(format!("starting the engine thread: {e}")))?;
        Ok(Engine { handle: EngineHandle(shared), thread: Some(thread) })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Fails whatever is queued or running with UNAVAILABLE and ends the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.handle.0.stopped.store(true, Ordering::Release);
        let _ = self.handle.0.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

impl EngineHandle {
    pub fn model(&self) -> &Arc<Model> {
        &self.0.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.0.tokenizer
    }

    pub fn config(&self) -> &EngineConfig {
        &self.0.config
    }

    pub fn info(&self) -> &EngineInfo {
        &self.0.info
    }

    /// The Jinja text of the chat template in use (the model's, a flag's or the fallback).
    pub fn chat_template(&self) -> Option<String> {
        self.0.template.as_ref().map(ChatTemplate::source)
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.0.stats
    }

    pub fn has_chat_template(&self) -> bool {
        self.0.template.is_some()
    }

    /// Where the chat template came from.
    pub fn chat_template_source(&self) -> TemplateSource {
        self.0.template_source
    }

    /// False once the engine has stopped (shutdown, or a bug ended its thread).
    pub fn is_running(&self) -> bool {
        !self.0.stopped.load(Ordering::Acquire)
    }

    /// The vocabulary as the grammar engine sees it, made at the first constrained request.
    fn grammars(&self) -> Result<&crate::grammar::Grammars> {
        let g =
            self.0.grammars.get_or_init(|| crate::grammar::Grammars::new(&self.0.tokenizer).map_err(|e| e.to_string()));
        g.as_ref().map_err(|e| Error::InvalidRequest(e.clone()))
    }

    /// Why the engine stopped for good, if it did (not a shutdown).
    pub fn broken(&self) -> Option<String> {
        self.0.broken_reason()
    }

    /// Checks that the model's files are as they were mapped; when one changed, the engine stops
    /// taking requests (its thread ends what runs with UNAVAILABLE before reading a page).
    pub fn check_files(&self) -> std::result::Result<(), String> {
        let r = self.0.model.gguf().check_unchanged();
        if let Err(why) = &r {
            self.0.break_down(why);
            // wakes the thread, which finds the change itself before its next batch
            let _ = self.0.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Stop);
        }
        r
    }

    /// Queued plus running requests.
    pub fn pending(&self) -> usize {
        self.0.pending.load(Ordering::Acquire)
    }

    /// Validates `req` and queues it; events go to `sink`. Returns the request's id.
    pub fn submit(&self, req: Request, sink: Box<dyn Sink>) -> Result<String> {
        let prepared = self.prepare(&req.prompt)?;
        self.submit_prepared(req, &prepared, sink)
    }

    /// A prompt tokenized (its chat template rendered once) for [`EngineHandle::submit_prepared`]:
    /// the server reads the rendered text (does it leave `<think>` open?) and submits the `n`
    /// choices of one chat request from it.
    pub fn prepare(&self, prompt: &Prompt) -> Result<Prepared> {
        let (tokens, rendered) = self.tokenize(prompt)?;
        Ok(Prepared { prompt: prompt.clone(), tokens, rendered })
    }

    /// [`EngineHandle::submit`] of a request whose prompt `prepared` holds (made by
    /// [`EngineHandle::prepare`] from the same prompt; another prompt is refused).
    pub fn submit_prepared(&self, req: Request, prepared: &Prepared, sink: Box<dyn Sink>) -> Result<String> {
        let s = &*self.0;
        if s.stopped.load(Ordering::Acquire) {
            return Err(s.unavailable());
        }
        if !prepared.is_for(&req.prompt) {
            return Err(Error::InvalidRequest("the prompt was prepared for another request".into()));
        }
        if let Some(k) = req.slot {
            s.check_slot(k, "slot (id_slot)")?;
        }
        let tokens = prepared.tokens.clone();
        let sampler = self.check(&req, &tokens)?;
        let matcher = match &req.constraint {
            Some(Constraint::ToolCall { tools, name, parallel }) => {
                // a forced call follows a thinking block the prompt left open
                let think_open = matches!(req.prompt, Prompt::Messages { .. })
                    && prepared.rendered().is_some_and(|r| r.trim_end().ends_with("<think>"));
                let lark = crate::tool_format::call_grammar(
                    s.tool_format,
                    tools,
                    name.as_deref(),
                    *parallel,
                    &s.tokenizer,
                    think_open,
                )?;
                Some(self.grammars()?.lark_matcher(lark, "tool_choice")?)
            }
            Some(c) => Some(self.grammars()?.matcher(c)?),
            None => None,
        };
        let id = if req.id.is_empty() {
            format!("req-{}", s.next_id.fetch_add(1, Ordering::Relaxed))
        } else {
            req.id.clone()
        };
        let cancel = CancelFlag::default();
        {
            let mut inflight = s.inflight.lock().unwrap_or_else(|e| e.into_inner());
            if inflight.contains_key(&id) {
                return Err(Error::AlreadyRunning(id));
            }
            let cap = s.config.n_parallel + s.config.queue_size;
            if s.pending.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| (p < cap).then_some(p + 1)).is_err() {
                s.stats.requests_rejected.add(1);
                return Err(Error::QueueFull(s.config.queue_size));
            }
            inflight.insert(id.clone(), cancel.clone());
        }
        let span = tracing::info_span!("request", id = %id);
        let job = Job { id: id.clone(), req, tokens, sampler, cancel, sink, matcher, span };
        if s.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Submit(Box::new(job))).is_err() {
            s.release(&id);
            return Err(Error::Unavailable("the engine has stopped".into()));
        }
        Ok(id)
    }

    /// Saves, restores or erases slot `slot`'s cache once the slot is idle (waiting for a running
    /// request to end); blocks until done. A restored cache serves the next prompt that starts
    /// with its tokens, as the cache of a slot's last request does.
    pub fn slot_action(&self, slot: usize, action: SlotAction) -> Result<SlotDone> {
        let s = &*self.0;
        if s.stopped.load(Ordering::Acquire) {
            return Err(s.unavailable());
        }
        s.check_slot(slot, "slot")?;
        let (reply, answer) = channel();
        let task = SlotTask { slot, action, reply };
        if s.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Slot(task)).is_err() {
            return Err(Error::Unavailable("the engine has stopped".into()));
        }
        answer.recv().unwrap_or_else(|_| Err(Error::Unavailable("the engine has stopped".into())))
    }

    /// Cancels a queued or running request; its stream ends with `Cancelled` within one step.
    pub fn abort(&self, id: &str) -> bool {
        match self.0.inflight.lock().unwrap_or_else(|e| e.into_inner()).get(id) {
            Some(flag) => {
                flag.cancel();
                true
            }
            None => false,
        }
    }

    /// The prompt as the engine will see it: the system prompt's tokens first for Generate.
    pub fn prompt_tokens(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        Ok(self.tokenize(prompt)?.0)
    }

    /// [`EngineHandle::prompt_tokens`], and the rendered text of a chat prompt.
    fn tokenize(&self, prompt: &Prompt) -> Result<(Vec<u32>, Option<String>)> {
        let s = &*self.0;
        let tok = &s.tokenizer;
        let text_bytes = match prompt {
            Prompt::Text(text) => text.len(),
            Prompt::Chat(messages) => messages.iter().map(|(_, c)| c.len()).sum(),
            Prompt::Messages { messages, .. } => {
                messages.iter().filter_map(|m| m.get("content").and_then(|c| c.as_str())).map(str::len).sum()
            }
            Prompt::Tokens(_) => 0,
        };
        // at least this many tokens, with room for tokenizers that map a few bytes to more
        let fewest = text_bytes / (2 * s.max_piece_bytes);
        if fewest >= s.info.n_ctx {
            return Err(Error::InvalidRequest(format!(
                "the prompt is {text_bytes} bytes, at least {fewest} tokens; the context holds {} per slot",
                s.info.n_ctx
            )));
        }
        let mut rendered = None;
        let tokens = match prompt {
            Prompt::Text(text) => {
                if text.is_empty() {
                    return Err(Error::InvalidRequest("the prompt is empty".into()));
                }
                let mut ids = s.sys.clone();
                ids.extend(tok.encode(text, s.sys.is_empty(), true)?);
                ids
            }
            Prompt::Tokens(ids) => {
                if ids.is_empty() {
                    return Err(Error::InvalidRequest("the prompt is empty (no token ids)".into()));
                }
                let n_vocab = s.info.n_vocab;
                if let Some((i, t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= n_vocab) {
                    return Err(Error::InvalidRequest(format!(
                        "token id {t} at index {i} is outside the vocabulary of {n_vocab} tokens"
                    )));
                }
                let mut all = s.sys.clone();
                all.extend_from_slice(ids);
                all
            }
            Prompt::Chat(messages) => {
                if messages.is_empty() {
                    return Err(Error::InvalidRequest("the chat has no messages".into()));
                }
                tok.encode(rendered.insert(self.render_chat(messages)?), true, true)?
            }
            Prompt::Messages { messages, .. } => {
                if messages.is_empty() {
                    return Err(Error::InvalidRequest("the chat has no messages".into()));
                }
                tok.encode(rendered.insert(self.render_prompt(prompt)?), true, true)?
            }
        };
        Ok((tokens, rendered))
    }

    /// A chat prompt as the chat template renders it with an assistant prompt; an error for
    /// text and tokens.
    pub fn render_prompt(&self, prompt: &Prompt) -> Result<String> {
        match prompt {
            Prompt::Chat(messages) => self.render_chat(messages),
            Prompt::Messages { messages, tools, kwargs } => self.render_messages(messages, tools, kwargs),
            Prompt::Text(_) | Prompt::Tokens(_) => Err(Error::InvalidRequest("the prompt has no messages".into())),
        }
    }

    /// Renders OpenAI-shaped messages (tool calls and results included) and the tools offered
    /// with the chat template and an assistant prompt, the template's variables the engine's
    /// (`--chat-template-kwargs`) with `kwargs` over them.
    pub fn render_messages(
        &self,
        messages: &[serde_json::Value],
        tools: &[serde_json::Value],
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let s = &*self.0;
        let Some(t) = &s.template else { return Err(Error::NoChatTemplate) };
        s.stats.templates_rendered.add(1);
        let tools = (!tools.is_empty()).then_some(tools);
        let mut vars = s.config.template_kwargs.clone();
        vars.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        let text = t.render_with(messages, tools, true, &vars)?;
        let bos = s.tokenizer.bos_text();
        Ok(match text.strip_prefix(bos) {
            Some(rest) if s.tokenizer.add_bos() && !bos.is_empty() => rest.to_string(),
            _ => text,
        })
    }

    /// Renders chat messages with the model's template and an assistant prompt. A BOS the
    /// template writes is dropped when the tokenizer adds one anyway, as llama.cpp does.
    pub fn render_chat(&self, messages: &[(String, String)]) -> Result<String> {
        let s = &*self.0;
        let Some(t) = &s.template else { return Err(Error::NoChatTemplate) };
        s.stats.templates_rendered.add(1);
        let msgs: Vec<_> = messages.iter().map(|(r, c)| message(r, c)).collect();
        let text = t.render_with(&msgs, None, true, &s.config.template_kwargs)?;
        let bos = s.tokenizer.bos_text();
        Ok(match text.strip_prefix(bos) {
            Some(rest) if s.tokenizer.add_bos() && !bos.is_empty() => rest.to_string(),
            _ => text,
        })
    }

    /// Checks everything about a request except its prompt's tokens; returns its sampler.
    fn check(&self, req: &Request, tokens: &[u32]) -> Result<Sampler> {
        let n_ctx = self.0.info.n_ctx;
        if tokens.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty (it tokenizes to no tokens)".into()));
        }
        if tokens.len() >= n_ctx {
            return Err(Error::InvalidRequest(format!(
                "the prompt is {} tokens, the context holds {n_ctx} per slot",
                tokens.len()
            )));
        }
        let t = req.sampling.temperature;
        if t.is_nan() || t < 0.0 {
            return Err(Error::InvalidParam(format!("temperature = {t}: must be a number >= 0")));
        }
        if req.logprobs > MAX_LOGPROBS {
            return Err(Error::InvalidRequest(format!("logprobs = {}: at most {MAX_LOGPROBS}", req.logprobs)));
        }
        let mut sampling = req.sampling.clone();
        let tok = &self.0.tokenizer;
        let n_vocab = tok.n_vocab();
        if let Some((t, _)) = sampling.logit_bias.iter().find(|(t, _)| *t as usize >= n_vocab) {
            return Err(Error::InvalidParam(format!(
                "logit_bias: token {t} is not in the vocabulary ({n_vocab} tokens)"
            )));
        }
        for (text, bias) in &req.logit_bias_text {
            let ids = tok.encode(text, false, false)?;
            if ids.is_empty() {
                return Err(Error::InvalidParam(format!("logit_bias: {text:?} is no token")));
            }
            sampling.logit_bias.extend(ids.into_iter().map(|t| (t, *bias)));
        }
        let dry = sampling.dry_on().then(|| self.dry_breakers(&sampling.dry_sequence_breakers)).transpose()?;
        let sampler = Sampler::new(sampling)?;
        Ok(match dry {
            Some(b) => sampler.with_dry_breakers(b),
            None => sampler,
        })
    }

    /// DRY's `breakers` processed against the vocabulary, the last ones kept for the next request.
    fn dry_breakers(&self, breakers: &[String]) -> Result<Arc<crate::DryBreakers>> {
        let mut last = self.0.dry_breakers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, processed)) = last.as_ref().filter(|(b, _)| b.as_slice() == breakers) {
            return Ok(processed.clone());
        }
        let processed = Arc::new(crate::DryBreakers::new(&self.0.tokenizer, breakers)?);
        *last = Some((breakers.to_vec(), processed.clone()));
        Ok(processed)
    }
}

/// A prompt made ready by [`EngineHandle::prepare`]: its tokens and, for a chat, the text its
/// template rendered.
#[derive(Clone, Debug)]
pub struct Prepared {
    prompt: Prompt,
    tokens: Vec<u32>,
    rendered: Option<String>,
}

impl Prepared {
    /// The chat template's text (none for text and token prompts).
    pub fn rendered(&self) -> Option<&str> {
        self.rendered.as_deref()
    }

    /// The prompt's tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether these are `prompt`'s tokens.
    pub fn is_for(&self, prompt: &Prompt) -> bool {
        self.prompt == *prompt
    }
}
