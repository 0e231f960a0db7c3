//! `tandem.v1.InferenceService`: each call is translated, handed to the engine with a reply
//! channel, and the engine's events are streamed back as they come. The service answers
//! UNAVAILABLE until a model is ready and again once the server drains.

use crate::convert;
use crate::pb;
use crate::pb::inference_service_server::InferenceService;
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;
use tandem_engine::TemplateSource;
use tandem_engine::{EngineHandle, Event, Sink};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

/// Most token ids a Detokenize call may send.
const MAX_DETOKENIZE_IDS: usize = 1 << 20;

/// What is being served, described once when the model is ready.
#[derive(Clone, Debug, Default)]
pub struct ModelDescription {
    /// Shown as `name` (`--alias`, else general.name, else the file name).
    pub name: String,
    pub demo: bool,
    /// Where the weights run, one line.
    pub placement: String,
}

/// State shared by the service, the server and the metrics endpoint.
pub struct State {
    engine: OnceLock<(EngineHandle, pb::GetModelInfoResponse)>,
    draining: AtomicBool,
    /// Streams still open (their engine requests not yet ended).
    streams: watch::Sender<usize>,
    next_id: AtomicU64,
    /// `--api-key`s; none = every client is trusted (local use).
    api_keys: Vec<String>,
    /// Which key made each open request, for `Abort`.
    owners: Mutex<HashMap<String, (usize, u32)>>,
    conn_stats: OnceLock<crate::ServerStats>,
    reasoning: crate::reasoning::ReasoningFormat,
    sampling: crate::SamplingDefaults,
    metrics_on_api: bool,
    no_slots: bool,
    slot_save_path: Option<std::path::PathBuf>,
}

/// The API key a call was made with: its index in `--api-key`s (requests' extension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyIndex(pub usize);

impl State {
    pub(crate) fn new(options: &crate::Options) -> State {
        State {
            engine: OnceLock::new(),
            draining: AtomicBool::new(false),
            streams: watch::channel(0).0,
            next_id: AtomicU64::new(1),
            api_keys: options.api_keys.clone(),
            owners: Mutex::new(HashMap::new()),
            conn_stats: OnceLock::new(),
            reasoning: options.reasoning_format,
            sampling: options.sampling.clone(),
            metrics_on_api: options.metrics_on_api,
            no_slots: options.no_slots,
            slot_save_path: options.slot_save_path.clone(),
        }
    }

    /// `GET /metrics` is served on the HTTP API's ports too (`--metrics`).
    pub(crate) fn metrics_on_api(&self) -> bool {
        self.metrics_on_api
    }

    /// `GET /slots` answers (not `--no-slots`).
    pub(crate) fn slots_on(&self) -> bool {
        !self.no_slots
    }

    /// `--slot-save-path`, if given.
    pub(crate) fn slot_save_path(&self) -> Option<&std::path::Path> {
        self.slot_save_path.as_deref()
    }

    /// What a request gets for a sampling parameter it leaves out.
    pub(crate) fn sampling(&self) -> &crate::SamplingDefaults {
        &self.sampling
    }

    pub(crate) fn reasoning_format(&self) -> crate::reasoning::ReasoningFormat {
        self.reasoning
    }

    pub(crate) fn set_conn_stats(&self, stats: crate::ServerStats) {
        let _ = self.conn_stats.set(stats);
    }

    pub(crate) fn conn_stats(&self) -> Option<&crate::ServerStats> {
        self.conn_stats.get()
    }

    /// Checks an `Authorization` header's value (`Bearer KEY`): the key's index, `None` when no
    /// keys are configured, `Err` when the key is missing or wrong.
    pub(crate) fn authorize(&self, header: Option<&[u8]>) -> Result<Option<KeyIndex>, &'static str> {
        if self.api_keys.is_empty() {
            return Ok(None);
        }
        let Some(value) = header else { return Err("an API key is required: Authorization: Bearer KEY") };
        let given = value.strip_prefix(b"Bearer ").unwrap_or(value).trim_ascii();
        // compares every key in full, so that timing tells nothing of how much of a key matched
        let mut found = None;
        for (i, k) in self.api_keys.iter().enumerate() {
            if constant_time_eq(k.as_bytes(), given) && found.is_none() {
                found = Some(KeyIndex(i));
            }
        }
        found.map(Some).ok_or("invalid API key")
    }

    /// Notes which key made request `id` (while it runs). A second request under the same id
    /// (refused by the engine as already running) does not take the first one's place.
    fn own(&self, id: &str, key: Option<KeyIndex>) {
        if let Some(k) = key {
            let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
            let e = owners.entry(id.to_string()).or_insert((k.0, 0));
            if e.0 == k.0 {
                e.1 += 1;
            }
        }
    }

    fn disown(&self, id: &str, key: Option<KeyIndex>) {
        if let Some(k) = key {
            let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(e) = owners.get_mut(id).filter(|e| e.0 == k.0) {
                e.1 -= 1;
                if e.1 == 0 {
                    owners.remove(id);
                }
            }
        }
    }

    /// Whether a caller with `key` may abort request `id`: any with no keys configured, else only
    /// one made with the same key.
    fn may_abort(&self, id: &str, key: Option<KeyIndex>) -> bool {
        match key {
            None => self.api_keys.is_empty(),
            Some(k) => self.owners.lock().unwrap_or_else(|e| e.into_inner()).get(id).is_some_and(|e| e.0 == k.0),
        }
    }

    /// The engine, once the model is ready and while the server is not draining.
    pub(crate) fn engine(&self) -> Result<&EngineHandle, Status> {
        if self.draining.load(Ordering::Acquire) {
            return Err(Status::unavailable("the server is shutting down"));
        }
        match self.engine.get() {
            Some((e, _)) if e.is_running() => Ok(e),
            Some((e, _)) => Err(Status::unavailable(e.broken().unwrap_or_else(|| "the engine has stopped".into()))),
            None => Err(Status::unavailable("the model is still loading")),
        }
    }

    pub(crate) fn engine_handle(&self) -> Option<&EngineHandle> {
        self.engine.get().map(|(e, _)| e)
    }

    pub(crate) fn set_engine(&self, engine: EngineHandle, desc: &ModelDescription) {
        let info = model_info(&engine, desc);
        let _ = self.engine.set((engine, info));
    }

    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// The served model's name (GetModelInfo's `name`), once it is ready.
    pub(crate) fn model_name(&self) -> Option<&str> {
        self.engine.get().map(|(_, info)| info.name.as_str())
    }

    /// A fresh id: `prefix` (with its separator, as each API spells its ids: `chatcmpl-`,
    /// `call_`, `msg_`, `toolu_`) and 128 random bits in hex, for ids the client did not choose:
    /// no client can guess another's id (to `Abort` it).
    pub(crate) fn new_id(&self, prefix: &str) -> String {
        let mut bits = [0u8; 16];
        if getrandom::fill(&mut bits).is_err() {
            // No OS randomness (never seen on Linux): std's hasher keys are random per process.
            use std::hash::{BuildHasher, Hasher};
            let n = self.next_id.fetch_add(1, Ordering::Relaxed);
            for half in bits.chunks_mut(8) {
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u64(n);
                half.copy_from_slice(&h.finish().to_le_bytes());
            }
        }
        format!("{prefix}{:032x}", u128::from_le_bytes(bits))
    }

    pub(crate) fn streams(&self) -> watch::Receiver<usize> {
        self.streams.subscribe()
    }
}

/// Counts an open stream, and remembers which API key made it, until the engine drops its sink.
pub(crate) struct StreamGuard(Arc<State>, String, Option<KeyIndex>);

impl StreamGuard {
    pub(crate) fn new(state: Arc<State>, id: &str, key: Option<KeyIndex>) -> StreamGuard {
        state.streams.send_modify(|n| *n += 1);
        state.own(id, key);
        StreamGuard(state, id.to_string(), key)
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.disown(&self.1, self.2);
        self.0.streams.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Equal bytes, in a time that depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

/// The engine's reply channel for one stream.
struct StreamSink {
    id: String,
    tx: mpsc::UnboundedSender<Result<pb::GenerateResponse, Status>>,
    /// Tools were offered: text streams until a call begins, the calls come with the finish.
    tools: Option<crate::tools::ToolStream>,
    /// Chat: thinking text apart from the answer.
    reasoning: Option<crate::reasoning::Splitter>,
    state: Arc<State>,
    generated: u32,
    /// The last event was sent.
    done: bool,
    _guard: StreamGuard,
}

impl Drop for StreamSink {
    fn drop(&mut self) {
        // dropped before the end: the engine stopped without finishing this request
        if !self.done {
            let _ = self.tx.send(Err(Status::internal("the engine stopped before the request finished")));
        }
    }
}

impl Sink for StreamSink {
    fn send(&mut self, event: Event) -> bool {
        self.done |= !matches!(event, Event::Token { .. });
        let mut calls = Vec::new();
        let mut thinking = String::new();
        let event = match (self.reasoning.as_mut(), event) {
            (Some(split), Event::Token { id, text, logprobs }) => {
                let (r, c) = split.push(&text);
                thinking = r;
                Event::Token { id, text: c, logprobs }
            }
            (Some(split), Event::Finished { text, finish }) => {
                let (mut r, mut c) = split.push(&text);
                let (r2, c2) = split.finish();
                r += &r2;
                c += &c2;
                thinking = r;
                Event::Finished { text: c, finish }
            }
            (_, e) => e,
        };
        let event = match (self.tools.as_mut(), event) {
            (Some(ts), Event::Token { id, text, logprobs }) => Event::Token { id, text: ts.push(&text), logprobs },
            (Some(ts), Event::Finished { text, finish }) => {
                let mut t = ts.push(&text);
                let (rest, found) = ts.finish();
                t += &rest;
                calls = found;
                Event::Finished { text: t, finish }
            }
            (_, e) => e,
        };
        let mut resp = convert::response(&self.id, event, &mut self.generated);
        if let Ok(r) = resp.as_mut() {
            r.reasoning_text = thinking;
        }
        if let Ok(Some(f)) = resp.as_mut().map(|r| r.finish.as_mut()) {
            if !calls.is_empty() {
                f.reason = pb::FinishReason::ToolCalls as i32;
                f.tool_calls = calls
                    .into_iter()
                    .map(|c| pb::ToolCall { id: self.state.new_id("call_"), name: c.name, arguments_json: c.arguments })
                    .collect();
            }
        }
        self.tx.send(resp).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// The gRPC service.
pub struct Service {
    state: Arc<State>,
}

impl Service {
    pub(crate) fn new(state: Arc<State>) -> Service {
        Service { state }
    }

    /// Submits a request (tokenizing it off the async threads) and returns its stream.
    async fn stream(
        &self,
        mut req: tandem_engine::Request,
        key: Option<KeyIndex>,
    ) -> Result<Response<ResponseStream>, Status> {
        use crate::reasoning::{ReasoningFormat, Splitter};
        let engine = self.state.engine()?.clone();
        if req.id.is_empty() {
            req.id = self.state.new_id("req-");
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let offered = matches!(&req.prompt, tandem_engine::Prompt::Messages { tools, .. } if !tools.is_empty());
        let mut sink = StreamSink {
            id: req.id.clone(),
            tx,
            tools: offered.then(crate::tools::ToolStream::default),
            reasoning: None,
            state: self.state.clone(),
            generated: 0,
            done: false,
            _guard: StreamGuard::new(self.state.clone(), &req.id, key),
        };
        let format = self.state.reasoning_format();
        tokio::task::spawn_blocking(move || {
            let prepared = engine.prepare(&req.prompt)?;
            // a chat's thinking apart from its answer (whether its template leaves `<think>` open)
            sink.reasoning = match prepared.rendered() {
                Some(r) if format != ReasoningFormat::None => Some(Splitter::new(format, Splitter::prompt_opens(r))),
                _ => None,
            };
            engine.submit_prepared(req, &prepared, Box::new(sink))
        })
        .await
        .map_err(|e| Status::internal(format!("submitting the request: {e}")))?
        .map_err(|e| convert::status(&e))?;
        // a stream ends after its finish message or its error
        let stream = UnboundedReceiverStream::new(rx);
        Ok(Response::new(Box::pin(stream.take_while_inclusive())))
    }
}

/// `take_while` that also yields the last item: a stream ends after the finish or the error.
trait TakeWhileInclusive: Stream<Item = Result<pb::GenerateResponse, Status>> + Sized + Send + 'static {
    fn take_while_inclusive(self) -> ResponseStream {
        let mut done = false;
        Box::pin(self.map_while(move |item| {
            if done {
                return None;
            }
            done = match &item {
                Ok(r) => r.finish.is_some(),
                Err(_) => true,
            };
            Some(item)
        }))
    }
}

impl<S: Stream<Item = Result<pb::GenerateResponse, Status>> + Sized + Send + 'static> TakeWhileInclusive for S {}

#[tonic::async_trait]
impl InferenceService for Service {
    type GenerateStream = ResponseStream;
    type ChatStream = ResponseStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let now = Instant::now();
        let deadline = convert::deadline(request.metadata(), now)?;
        let key = request.extensions().get::<KeyIndex>().copied();
        let req = convert::generate_request(request.into_inner(), deadline, now, self.state.sampling())?;
        self.stream(req, key).await
    }

    async fn chat(&self, request: Request<pb::ChatRequest>) -> Result<Response<Self::ChatStream>, Status> {
        let now = Instant::now();
        let deadline = convert::deadline(request.metadata(), now)?;
        let key = request.extensions().get::<KeyIndex>().copied();
        let req = convert::chat_request(request.into_inner(), deadline, now, self.state.sampling())?;
        self.stream(req, key).await
    }

    async fn tokenize(&self, request: Request<pb::TokenizeRequest>) -> Result<Response<pb::TokenizeResponse>, Status> {
        let engine = self.state.engine()?.clone();
        let r = request.into_inner();
        let out = tokio::task::spawn_blocking(move || -> Result<pb::TokenizeResponse, Status> {
            let tok = engine.tokenizer();
            let ids = tok
                .encode(&r.text, r.add_special, r.parse_special)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
            let pieces = ids
                .iter()
                .map(|&id| String::from_utf8_lossy(tok.token_to_piece(id, true).unwrap_or(&[])).into_owned())
                .collect();
            Ok(pb::TokenizeResponse { ids, pieces })
        })
        .await
        .map_err(|e| Status::internal(format!("tokenizing: {e}")))??;
        Ok(Response::new(out))
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let engine = self.state.engine()?;
        let r = request.into_inner();
        if r.ids.len() > MAX_DETOKENIZE_IDS {
            return Err(Status::invalid_argument(format!("{} token ids, at most {MAX_DETOKENIZE_IDS}", r.ids.len())));
        }
        let n_vocab = engine.info().n_vocab;
        if let Some((i, t)) = r.ids.iter().enumerate().find(|(_, &t)| t as usize >= n_vocab) {
            return Err(Status::invalid_argument(format!(
                "token id {t} at index {i} is outside the vocabulary of {n_vocab} tokens"
            )));
        }
        let text = engine.tokenizer().decode(&r.ids, r.special).map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(Response::new(pb::DetokenizeResponse { text }))
    }

    async fn get_model_info(
        &self,
        _request: Request<pb::GetModelInfoRequest>,
    ) -> Result<Response<pb::GetModelInfoResponse>, Status> {
        self.state.engine()?;
        match self.state.engine.get() {
            Some((_, info)) => Ok(Response::new(info.clone())),
            None => Err(Status::unavailable("the model is still loading")),
        }
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        // aborts are honoured while draining: they only shorten the drain
        let Some(engine) = self.state.engine_handle() else {
            return Err(Status::unavailable("the model is still loading"));
        };
        let key = request.extensions().get::<KeyIndex>().copied();
        let id = request.into_inner().request_id;
        // another key's request is as good as absent
        let found = self.state.may_abort(&id, key) && engine.abort(&id);
        Ok(Response::new(pb::AbortResponse { found }))
    }
}

/// GetModelInfo's answer, from the model's metadata and tensors.
fn model_info(engine: &EngineHandle, desc: &ModelDescription) -> pb::GetModelInfoResponse {
    let model = engine.model();
    let gguf = model.gguf();
    let md = gguf.metadata();
    let mut by_type: BTreeMap<String, (u32, u64)> = BTreeMap::new();
    for t in gguf.tensors() {
        let e = by_type.entry(t.info.ty.to_string()).or_default();
        e.0 += 1;
        e.1 += t.info.size;
    }
    let mut quant_types: Vec<pb::QuantType> =
        by_type.into_iter().map(|(ty, (tensors, bytes))| pb::QuantType { r#type: ty, tensors, bytes }).collect();
    quant_types.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.r#type.cmp(&b.r#type)));
    let tok = engine.tokenizer();
    let config = engine.config();
    let name = match (&desc.name, md.opt_str("general.name")) {
        (n, _) if !n.is_empty() => n.clone(),
        (_, Ok(Some(n))) => n.to_string(),
        _ => gguf.shards().first().map(|s| s.path().to_string()).unwrap_or_default(),
    };
    pb::GetModelInfoResponse {
        architecture: model.arch().name().to_string(),
        name,
        demo: desc.demo,
        vocab_size: model.n_vocab() as u32,
        n_layer: model.n_layer() as u32,
        n_embd: model.n_embd() as u32,
        context_train: model.n_ctx_train() as u32,
        context_per_slot: engine.info().n_ctx as u32,
        parallel: config.n_parallel as u32,
        max_tokens: config.max_tokens,
        queue_size: config.queue_size as u32,
        placement: desc.placement.clone(),
        weight_bytes: quant_types.iter().map(|q| q.bytes).sum(),
        quant_types,
        system_prompt_tokens: engine.info().system_prompt_tokens as u32,
        has_chat_template: engine.has_chat_template(),
        eog_token_ids: {
            let mut v: Vec<u32> = tok.eog_ids().collect();
            v.sort_unstable();
            v
        },
        bos_token_id: tok.special_ids().bos.filter(|_| tok.add_bos()),
        chat_template_source: match engine.chat_template_source() {
            TemplateSource::Model => "model".into(),
            TemplateSource::Builtin(name) => format!("builtin:{name}"),
            TemplateSource::Given => "given".into(),
            TemplateSource::Fallback => "chatml-fallback".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_128_random_bits() {
        let s = State::new(&crate::Options::default());
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| s.new_id("req-")).collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            let hex = id.strip_prefix("req-").unwrap();
            assert!(hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
        // Not a counter: consecutive ids share no long prefix.
        let (a, b) = (s.new_id("x-"), s.new_id("x-"));
        assert_ne!(a[..10], b[..10]);
    }

    #[test]
    fn api_keys_are_checked_and_scope_aborts() {
        let open = State::new(&crate::Options::default());
        assert_eq!(open.authorize(None), Ok(None));
        assert!(open.may_abort("x", None));
        let s = State::new(&crate::Options { api_keys: vec!["k-one".into(), "k-two".into()], ..Default::default() });
        assert!(s.authorize(None).is_err());
        assert!(s.authorize(Some(b"Bearer k-on")).is_err());
        assert!(s.authorize(Some(b"Bearer k-one2")).is_err());
        assert!(s.authorize(Some(b"Bearer ")).is_err());
        assert_eq!(s.authorize(Some(b"Bearer k-two")), Ok(Some(KeyIndex(1))));
        let g = StreamGuard::new(Arc::new(s), "r1", Some(KeyIndex(0)));
        assert!(g.0.may_abort("r1", Some(KeyIndex(0))));
        assert!(!g.0.may_abort("r1", Some(KeyIndex(1))));
        assert!(!g.0.may_abort("r1", None));
        let state = g.0.clone();
        // the same id again under another key (the engine refuses it) changes nothing
        drop(StreamGuard::new(state.clone(), "r1", Some(KeyIndex(1))));
        assert!(state.may_abort("r1", Some(KeyIndex(0))));
        drop(g);
        assert!(!state.may_abort("r1", Some(KeyIndex(0))), "forgotten once the request ends");
    }
}
