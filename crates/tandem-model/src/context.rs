//! A loaded model and a context to run it: batches split into micro-batches (`-ub`), several
//! sequences per batch, logits for the positions asked for.

use crate::common::{Head, Ubatch};
use crate::config::{Arch, Keys, RopeConfig};
use crate::exec::{DevId, Exec, Tensor};
use crate::kv_cache::{CacheType, KvCache, KvLayout};
use crate::weights::{Weight, WeightLoader};
use crate::{deepseek2, llama, qwen3moe, Error, Result};
use std::collections::HashMap;
use std::sync::Arc;
use tandem_gguf::GgufModel;

/// What [`Model::pack_weights`] packed.
#[derive(Clone, Debug, Default)]
pub struct PackReport {
    pub tensors: usize,
    /// Bytes of the packed copies.
    pub bytes: u64,
    pub types: Vec<tandem_gguf::GgmlType>,
    /// Tensors left unpacked, with the reason (they run with the row-major kernels).
    pub failed: Vec<(String, String)>,
    /// With `--no-mmap`: the matrices whose read bytes were given back once
    /// packed, and how many bytes that was.
    pub released_tensors: usize,
    pub released_bytes: u64,
}

/// What repacking would copy ([`Model::packed_sources`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackedSources {
    pub tensors: usize,
    pub source_bytes: u64,
    pub packed_bytes: u64,
    /// Bytes in the file of the copied weights whose read bytes `--no-mmap` gives back.
    pub releasable_bytes: u64,
    /// The largest packed copy among those.
    pub largest_releasable: u64,
}

impl PackedSources {
    /// The memory the packing takes at its peak: the packed copies, less what the read bytes
    /// given back free when `releasing` (`--no-mmap`), one tensor at a time.
    pub fn peak_bytes(&self, releasing: bool) -> u64 {
        if !releasing || self.releasable_bytes == 0 {
            return self.packed_bytes;
        }
        (self.packed_bytes + self.largest_releasable).saturating_sub(self.releasable_bytes).max(self.largest_releasable)
    }
}

/// The layers of an architecture, between the embeddings and the output head.
pub(crate) trait Layers: Send + Sync {
    fn layout(&self) -> KvLayout;
    /// Runs layer `il` on the residual stream `x` (`[n_tokens][n_embd]`) in place.
    fn forward_layer(&self, il: usize, ex: &Exec, cache: &mut KvCache, ub: &Ubatch, x: &mut Tensor) -> Result<()>;
    /// The device that keeps layer `il`'s cache rows (where its attention runs).
    fn kv_device(&self, il: usize, ex: &Exec) -> DevId;
    /// The device the first layer starts on (the hidden state goes there).
    fn first_device(&self, ex: &Exec) -> DevId;
    /// The rotary embedding (its rows are made once per micro-batch).
    fn rope(&self) -> &RopeConfig;
    /// RMS norm epsilon of the output norm.
    fn eps(&self) -> f32;
}

/// A model bound to its GGUF file.
pub struct Model {
    arch: Arch,
    gguf: Arc<GgufModel>,
    head: Head,
    layers: Box<dyn Layers>,
    n_ctx_train: usize,
    /// The weights `--repack` packs (empty without it).
    packables: Vec<Weight>,
    /// Tensors whose own bytes stay in use after packing (bound twice, or read by rows).
    raw_readers: std::collections::HashSet<usize>,
    /// [`crate::fingerprint`] of the file, made at the first slot file saved or restored.
    fingerprint: std::sync::OnceLock<u64>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Model({}, {} layers, vocab {})", self.arch.name(), self.layers.layout().n_layer, self.head.n_vocab)
    }
}

impl Model {
    /// Binds every tensor of `gguf`; refuses unknown architectures, missing, misshapen or
    /// unsupported tensors, and tensors the architecture does not use, naming them.
    pub fn load(gguf: Arc<GgufModel>) -> Result<Model> {
        Model::load_with(gguf, false)
    }

    /// [`Model::load`], with `--repack`: matrices in a packable type and shape get a packed copy
    /// for CPU products (where the machine has the kernel for it; see [`Model::pack_weights`]).
    pub fn load_with(gguf: Arc<GgufModel>, repack: bool) -> Result<Model> {
        let md = gguf.metadata();
        let arch = Arch::from_name(md.get_str("general.architecture")?)?;
        let keys = Keys { md, arch: arch.name() };
        let loader = WeightLoader::with_repack(gguf.clone(), repack);
        let n_embd = keys.count("embedding_length", 1, crate::config::MAX_WIDTH)?;
        let head = Head::load(&loader, n_embd)?;
        let layers: Box<dyn Layers> = match arch {
            Arch::Llama => Box::new(llama::Llama::load(&keys, &loader, n_embd)?),
            Arch::Deepseek2 => Box::new(deepseek2::Deepseek2::load(&keys, &loader, n_embd)?),
            Arch::Qwen3Moe => Box::new(qwen3moe::Qwen3Moe::load(&keys, &loader, n_embd)?),
        };
        // DeepSeek V3's multi-token-prediction layer (`blk.N.nextn.*`) is not used for decoding.
        loader.check_all_used(|name| name.contains(".nextn."))?;
        let n_ctx_train = keys.count("context_length", 1, crate::config::MAX_CTX)?;
        let packables = loader.packables();
        let raw_readers = loader.raw_readers();
        Ok(Model { arch, gguf, head, layers, n_ctx_train, packables, raw_readers, fingerprint: Default::default() })
    }

    /// Bytes the packed copies (`--repack`) of the weights `skip` does not name take.
    pub fn packed_bytes(&self, skip: &dyn Fn(&str) -> bool) -> u64 {
        self.packables.iter().filter(|w| !skip(&w.name)).map(|w| w.packed_size() as u64).sum()
    }

    /// What repacking the weights `skip` does not name copies: how many, their bytes in the file,
    /// the bytes of their packed copies, and the bytes in the file of those whose read bytes are
    /// given back once packed when the file was read into memory (`--no-mmap`).
    pub fn packed_sources(&self, skip: &dyn Fn(&str) -> bool) -> PackedSources {
        let mut r = PackedSources::default();
        for w in self.packables.iter().filter(|w| !skip(&w.name)) {
            r.tensors += 1;
            r.source_bytes += w.source_len();
            r.packed_bytes += w.packed_size() as u64;
            if w.releasable(&self.raw_readers) {
                r.releasable_bytes += w.source_len();
                r.largest_releasable = r.largest_releasable.max(w.packed_size() as u64);
            }
        }
        r
    }

    /// The memory repacking the weights `skip` does not name takes at its peak: the packed
    /// copies, less what the read bytes given back free (`--no-mmap`), one tensor at a time.
    pub fn repack_need(&self, skip: &dyn Fn(&str) -> bool) -> u64 {
        self.packed_sources(skip).peak_bytes(self.gguf.can_release())
    }

    /// Leaves every weight not packed yet as it is (`why` is what [`Weight::pack_result`] says).
    pub fn keep_unpacked(&self, why: &str) {
        for w in &self.packables {
            w.keep_unpacked(why);
        }
    }

    /// Makes the packed copies (`--repack`) now instead of at first use, except of the weights
    /// `skip` names (those a GPU holds): calls `progress(done, total)` in bytes of source tensors.
    pub fn pack_weights(&self, skip: &dyn Fn(&str) -> bool, progress: &mut dyn FnMut(u64, u64)) -> PackReport {
        let todo: Vec<&Weight> = self.packables.iter().filter(|w| !skip(&w.name)).collect();
        let total: u64 = todo.iter().map(|w| w.source_len()).sum();
        let (mut done, mut report) = (0u64, PackReport::default());
        for w in &todo {
            match w.pack_result() {
                Some(Ok(p)) => {
                    report.tensors += 1;
                    report.bytes += p.bytes().len() as u64;
                    if !report.types.contains(&w.ty) {
                        report.types.push(w.ty);
                    }
                    let given = w.release_source(&self.raw_readers);
                    if given > 0 {
                        report.released_tensors += 1;
                        report.released_bytes += given;
                    }
                }
                Some(Err(e)) => report.failed.push((w.name.clone(), e.to_string())),
                None => {}
            }
            done += w.source_len();
            progress(done, total);
        }
        report
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The hash slot files carry to name this model ([`crate::fingerprint`]), made once: it reads
    /// every metadata value, the vocabulary included.
    pub fn fingerprint(&self) -> u64 {
        *self.fingerprint.get_or_init(|| crate::fingerprint(&self.gguf))
    }

    pub fn gguf(&self) -> &GgufModel {
        &self.gguf
    }

    pub fn n_vocab(&self) -> usize {
        self.head.n_vocab
    }

    pub fn n_embd(&self) -> usize {
        self.head.n_embd
    }

    pub fn n_layer(&self) -> usize {
        self.layers.layout().n_layer
    }

    pub fn n_ctx_train(&self) -> usize {
        self.n_ctx_train
    }

    /// Whether the model attends with multi-head latent attention that has a decompressed form
    /// (`attn_k_b` / `attn_v_b`), which `--mla` and `--mla-cache` concern.
    pub fn is_mla(&self) -> bool {
        self.gguf.tensors().any(|t| t.info.name.ends_with(".attn_k_b.weight"))
    }
}

/// Tokens to decode: token `i` is at position `pos[i]` of sequence `seq[i]`; `logits[i]` asks for
/// its logits. Each sequence's positions must continue its cache without gaps.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub pos: Vec<u32>,
    pub seq: Vec<usize>,
    pub logits: Vec<bool>,
}

impl Batch {
    /// `tokens` of sequence `seq` from position `start`; logits for all of them or the last one.
    pub fn sequence(tokens: &[u32], start: u32, seq: usize, all_logits: bool) -> Batch {
        let n = tokens.len();
        Batch {
            tokens: tokens.to_vec(),
            pos: (start..start + n as u32).collect(),
            seq: vec![seq; n],
            logits: (0..n).map(|i| all_logits || i + 1 == n).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// How a context runs.
#[derive(Clone, Debug)]
pub struct ContextParams {
    /// Most positions per sequence (`-c`; 0 = the model's training context).
    pub n_ctx: usize,
    /// Most tokens per forward pass (`-ub`).
    pub n_ubatch: usize,
    pub cache_type_k: CacheType,
    pub cache_type_v: CacheType,
    /// How MLA models attend (`--mla`).
    pub mla: MlaMode,
    /// The most bytes of keys and values the decompressed MLA attention rebuilds from the cached
    /// latent and keeps for the next runs of the sequence (`--mla-cache`; 0: none kept, every run
    /// rebuilds every row). The logits are the same either way.
    pub mla_cache_bytes: usize,
}

/// [`ContextParams::mla_cache_bytes`] by default: 1 GiB (the command line sizes it from the
/// memory left free, `--mla-cache auto`).
pub const DEFAULT_MLA_CACHE_BYTES: usize = 1 << 30;

impl Default for ContextParams {
    fn default() -> Self {
        ContextParams {
            n_ctx: 4096,
            n_ubatch: 512,
            cache_type_k: CacheType::F16,
            cache_type_v: CacheType::F16,
            mla: MlaMode::Auto,
            mla_cache_bytes: DEFAULT_MLA_CACHE_BYTES,
        }
    }
}

/// The form of multi-head latent attention (deepseek2 files with `attn_k_b`/`attn_v_b`).
///
/// The two forms are the same function; they round differently. The absorbed form is llama.cpp's
/// arithmetic (its logits agree with llama.cpp's to ~1e-7 on quantized files). The decompressed
/// one cannot round the latent attention output to Q8 before `attn_v_b` as llama.cpp does, and
/// lands closer to llama.cpp's logits than llama.cpp's own flash-attention path does (1.09-1.18x
/// that distance; tests/logits.rs `mla_forms_match_llama_cpp` holds it under 1.25x), so `Auto`,
/// the faster of the two per run, is the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MlaMode {
    /// Per sequence and micro-batch, whichever form takes fewer operations: absorbed for
    /// decoding and short runs, decompressed for long prefills (where the backend has it).
    #[default]
    Auto,
    /// Always over the cached latent, as llama.cpp computes it.
    Absorbed,
    /// Keys and values rebuilt from the latent for every run of tokens (where the backend has it).
    Decompressed,
}

impl MlaMode {
    pub fn from_name(name: &str) -> Result<MlaMode> {
        match name.to_ascii_lowercase().as_str() {
            "auto" => Ok(MlaMode::Auto),
            "absorbed" => Ok(MlaMode::Absorbed),
            "decompressed" => Ok(MlaMode::Decompressed),
            _ => Err(Error::Model(format!("unknown MLA form '{name}' (use auto, absorbed or decompressed)"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MlaMode::Auto => "auto",
            MlaMode::Absorbed => "absorbed",
            MlaMode::Decompressed => "decompressed",
        }
    }
}

/// A model, the executor that runs it and a KV cache.
pub struct Context {
    model: Arc<Model>,
    exec: Exec,
    cache: KvCache,
    params: ContextParams,
    /// With [`Exec::reads_ahead`]: per layer, the file tensors the CPU reads in it other than
    /// the routed experts (the last entry: the output head's), asked for a layer ahead.
    ahead: Vec<Vec<usize>>,
}

impl Context {
    pub fn new(model: Arc<Model>, exec: Exec, mut params: ContextParams) -> Result<Context> {
        if params.n_ctx == 0 {
            params.n_ctx = model.n_ctx_train;
        }
        params.n_ubatch = params.n_ubatch.max(1);
        let layout = model.layers.layout();
        let layer_dev: Vec<DevId> = (0..layout.n_layer).map(|il| model.layers.kv_device(il, &exec)).collect();
        let mut cache =
            KvCache::new(layout, params.cache_type_k, params.cache_type_v, params.n_ctx, &exec, &layer_dev)?;
        cache.set_rebuilt_budget(params.mla_cache_bytes);
        let ahead = if exec.reads_ahead() { ahead_lists(&model.gguf, &exec, layout.n_layer) } else { Vec::new() };
        Ok(Context { model, exec, cache, params, ahead })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn params(&self) -> &ContextParams {
        &self.params
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub(crate) fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// The devices and placement the context runs on.
    pub fn exec(&self) -> &Exec {
        &self.exec
    }

    /// Positions cached for `seq`.
    pub fn seq_len(&self, seq: usize) -> usize {
        self.cache.seq_len(seq)
    }

    /// Forgets positions `n..` of `seq`.
    pub fn truncate(&mut self, seq: usize, n: usize) {
        self.cache.truncate(seq, n)
    }

    /// Makes `dst` start with the first `n` cached positions of `src`, without recomputing them.
    /// On error (no device memory for the copy) `dst` is empty.
    pub fn copy_prefix(&mut self, src: usize, dst: usize, n: usize) -> Result<()> {
        self.cache.copy_prefix(src, dst, n)
    }

    /// Grows `seq` by `n` positions whose cached rows are zeros, without computing them: for
    /// timing attention at depth (its cost does not depend on the rows' values) on a model whose
    /// prefill to that depth would take too long, such as a synthetic one (`tandem bench
    /// --zero-depth`). The logits after it mean nothing.
    pub fn append_zero_rows(&mut self, seq: usize, n: usize) -> Result<()> {
        self.cache.append_zero_rows(seq, n)
    }

    fn check(&self, batch: &Batch) -> Result<()> {
        let n = batch.len();
        if batch.pos.len() != n || batch.seq.len() != n || batch.logits.len() != n {
            return Err(Error::Batch("batch fields have different lengths".into()));
        }
        let n_vocab = self.model.n_vocab();
        let mut next: HashMap<usize, usize> = HashMap::new();
        for i in 0..n {
            let (tok, seq, pos) = (batch.tokens[i], batch.seq[i], batch.pos[i] as usize);
            if tok as usize >= n_vocab {
                return Err(Error::Batch(format!("token id {tok} is out of range (vocabulary of {n_vocab})")));
            }
            let want = next.entry(seq).or_insert_with(|| self.cache.seq_len(seq));
            if pos != *want {
                return Err(Error::Batch(format!("sequence {seq}: position {pos} given, {want} expected next")));
            }
            if pos >= self.params.n_ctx {
                return Err(Error::Batch(format!(
                    "sequence {seq}: position {pos} is beyond the context of {} tokens",
                    self.params.n_ctx
                )));
            }
            *want += 1;
        }
        Ok(())
    }

    /// Runs the batch; returns the logits of the tokens that asked for them, `[n][n_vocab]` in
    /// batch order. On error the cache is left as it was.
    pub fn decode(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        self.check(batch)?;
        let before: Vec<(usize, usize)> = batch.seq.iter().map(|&s| (s, self.cache.seq_len(s))).collect();
        let r = self.decode_checked(batch);
        if r.is_err() {
            for (s, len) in before {
                self.cache.truncate(s, len);
            }
        }
        r
    }

    fn decode_checked(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        let m = &*self.model;
        let n_embd = m.n_embd();
        let rope = m.layers.rope();
        let n_rot = rope.params.n_dims;
        let x_dev = m.layers.first_device(&self.exec);
        let mut logits = Vec::new();
        let mut start = 0;
        while start < batch.len() {
            let end = (start + self.params.n_ubatch).min(batch.len());
            let pos = &batch.pos[start..end];
            let ub = Ubatch {
                tokens: &batch.tokens[start..end],
                pos,
                seq: &batch.seq[start..end],
                mla: self.params.mla,
                rope: pos.iter().flat_map(|&p| rope.cache(p)).collect(),
                n_rot,
            };
            let wanted: Vec<usize> = (start..end).filter(|&i| batch.logits[i]).map(|i| i - start).collect();
            let mut out = Vec::new();
            let (exec, cache, ahead) = (&self.exec, &mut self.cache, &self.ahead);
            let mut embedded = Some(m.head.embed(ub.tokens)?);
            // The output head inside the step too: outside it, its product woke the pool's
            // threads from sleep (tens of µs per decoded token).
            exec.run_step(ub.len(), &mut || {
                let x0 = embedded.take().ok_or_else(|| Error::Model("a step ran twice".into()))?;
                let mut x = exec.begin_step(&ub, cache, x0, x_dev)?;
                let n_layer = m.layers.layout().n_layer;
                for il in 0..n_layer {
                    if !ahead.is_empty() {
                        m.ask_ahead(ahead, il, n_layer);
                    }
                    m.layers.forward_layer(il, exec, cache, &ub, &mut x)?;
                }
                cache.advance(ub.seq);
                if !wanted.is_empty() {
                    let rows = if wanted.len() == ub.len() { x } else { exec.gather_rows(&x, n_embd, &wanted)? };
                    let h = exec.rmsnorm(&rows, &m.head.output_norm, m.layers.eps())?;
                    out = exec.to_host(exec.matmul(&m.head.output, &h)?)?;
                }
                Ok(())
            })?;
            logits.extend_from_slice(&out);
            start = end;
        }
        Ok(logits)
    }
}

impl Model {
    /// Asks for the weights read after layer `il`: the next layer's (after the last layer, the
    /// output head's and the first layer's, for the next step).
    fn ask_ahead(&self, ahead: &[Vec<usize>], il: usize, n_layer: usize) {
        let next = if il + 1 == n_layer { [n_layer, 0] } else { [il + 1, il + 1] };
        let n = if next[0] == next[1] { 1 } else { 2 };
        for &i in next[..n].iter().filter_map(|&l| ahead.get(l)).flatten() {
            if let Some(t) = self.gguf.tensor_at(i) {
                tandem_gguf::read_ahead::will_need(self.gguf.data(t));
            }
        }
    }
}

/// [`Context::ahead`]: for each layer (and the output head after the last), the indices of the
/// tensors of `gguf` the CPU reads there, routed experts left out (they are asked for once
/// chosen) and tensors held by another device.
fn ahead_lists(gguf: &GgufModel, exec: &Exec, n_layer: usize) -> Vec<Vec<usize>> {
    let mut lists = vec![Vec::new(); n_layer + 1];
    for (i, t) in gguf.tensors().enumerate() {
        let name = t.info.name.as_str();
        if name.contains("_exps") || exec.holds_elsewhere(name) {
            continue;
        }
        let slot = match tandem_gguf::naming::layer_of(name) {
            Some(il) => il as usize,
            None if name.starts_with("output") => n_layer,
            None => continue,
        };
        if let Some(l) = lists.get_mut(slot) {
            l.push(i);
        }
    }
    lists
}
