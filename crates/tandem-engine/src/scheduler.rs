//! The engine thread: it owns the model context and runs continuous batching. Every step decodes
//! one token for each generating slot and up to `prefill_chunk` prompt tokens of slots still
//! reading their prompt, all in one batch, so a long prompt never stalls the others for more than
//! one chunk. Between steps it takes new requests, aborts, disconnects and deadlines.

use crate::handle::Shared;
use crate::request::{Failure, FinishReason, LengthLimit};
use crate::slot::{end_queued, Active, End, Job, Next};
use std::collections::VecDeque;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;
use tandem_model::{Batch, Context};

/// Tokens of context shown on each side when a prompt diverges from a cached prefix.
const DIVERGENCE_CONTEXT_TOKENS: usize = 8;
/// Tokens a prompt must share with a cache (beyond the system prompt) before its divergence is
/// worth reporting: every prompt shares BOS and perhaps a word with some cache.
const DIVERGENCE_MIN_SHARED: usize = 4;

pub(crate) enum Command {
    Submit(Box<Job>),
    /// A slot's cache saved, restored or erased (done once the slot is idle).
    Slot(SlotTask),
    /// Fail everything with UNAVAILABLE and end the thread.
    Stop,
}

/// What `POST /slots/{id}` does with a slot's cache (llama-server's slot actions).
#[derive(Clone, Debug)]
pub enum SlotAction {
    /// Writes the slot's cached positions and their tokens to the file.
    Save(std::path::PathBuf),
    /// Replaces the slot's cache with the file's: a prompt that starts with its tokens is not
    /// computed again.
    Restore(std::path::PathBuf),
    /// Forgets the slot's cache.
    Erase,
}

/// What a slot action did: the positions saved, restored or erased, the file's bytes (none for
/// an erase) and how long it took.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotDone {
    pub tokens: usize,
    pub bytes: u64,
    pub ms: f64,
}

/// A slot action on its way to the engine thread, with where its answer goes.
pub(crate) struct SlotTask {
    pub slot: usize,
    pub action: SlotAction,
    pub reply: std::sync::mpsc::Sender<crate::Result<SlotDone>>,
}

/// A sequence of the KV cache and the tokens it holds.
pub(crate) struct Slot {
    seq: usize,
    /// Tokens whose KV is cached for `seq`, in order.
    cache: Vec<u32>,
    /// Step of last use, for least-recently-used choice.
    last_used: u64,
    active: Option<Active>,
}

pub(crate) struct Scheduler {
    ctx: Context,
    shared: Arc<Shared>,
    slots: Vec<Slot>,
    queue: VecDeque<Job>,
    /// Slot actions waiting for their slot to be idle, in arrival order.
    slot_tasks: VecDeque<SlotTask>,
    /// The KV sequence that holds the system prompt, and its tokens.
    sys_seq: usize,
    sys: Vec<u32>,
    step: u64,
}

/// Length of the longest common prefix.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Scheduler {
    pub fn new(ctx: Context, shared: Arc<Shared>, sys_seq: usize, sys: Vec<u32>) -> Scheduler {
        let n = shared.config.n_parallel;
        let slots = (0..n).map(|seq| Slot { seq, cache: Vec::new(), last_used: 0, active: None }).collect();
        Scheduler { ctx, shared, slots, queue: VecDeque::new(), slot_tasks: VecDeque::new(), sys_seq, sys, step: 0 }
    }

    /// Nothing to do until a command arrives (a slot action waiting for a slot that has just
    /// become free is something to do).
    fn idle(&self) -> bool {
        self.queue.is_empty() && self.slot_tasks.is_empty() && self.slots.iter().all(|s| s.active.is_none())
    }

    pub fn run(mut self, rx: Receiver<Command>) {
        loop {
            if self.idle() {
                self.publish();
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.command(cmd) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                if !self.command(cmd) {
                    return;
                }
            }
            self.sweep();
            // before admitting: a request sent after a restore finds the restored cache
            self.slot_work();
            self.admit();
            self.publish();
            // the weights' pages are about to be read: not if the file changed under the mapping
            if let Err(why) = self.shared.model.gguf().check_unchanged() {
                self.shared.break_down(&why);
            }
            if self.shared.broken_reason().is_none() {
                self.decode_step();
            }
            if let Some(why) = self.shared.broken_reason() {
                // no more batches: what runs, is queued or is on its way ends UNAVAILABLE
                self.end_all(&why);
                while let Ok(cmd) = rx.try_recv() {
                    if let Command::Submit(job) = cmd {
                        self.release(&job.id);
                        end_queued(*job, End::Failed(Failure::Unavailable(why.clone())), &self.shared.stats);
                    }
                }
                return;
            }
        }
    }

    /// Returns false when the thread should end.
    fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(job) => {
                self.queue.push_back(*job);
                true
            }
            Command::Slot(task) => {
                self.slot_tasks.push_back(task);
                true
            }
            Command::Stop => {
                let why = self.shared.broken_reason().unwrap_or_else(|| "the server is shutting down".into());
                self.end_all(&why);
                false
            }
        }
    }

    /// Fails every queued and running request with UNAVAILABLE saying `why`.
    fn end_all(&mut self, why: &str) {
        let end = || End::Failed(Failure::Unavailable(why.to_string()));
        for job in std::mem::take(&mut self.queue) {
            self.release(&job.id);
            end_queued(job, end(), &self.shared.stats);
        }
        for i in 0..self.slots.len() {
            self.end_slot(i, end());
        }
        for task in std::mem::take(&mut self.slot_tasks) {
            let _ = task.reply.send(Err(crate::Error::Unavailable(why.to_string())));
        }
        self.publish();
    }

    /// Runs the slot actions whose slot is idle; the others wait for theirs.
    fn slot_work(&mut self) {
        let mut waiting = VecDeque::new();
        while let Some(task) = self.slot_tasks.pop_front() {
            if self.slots[task.slot].active.is_some() {
                waiting.push_back(task);
                continue;
            }
            let started = Instant::now();
            let done = self.slot_action(task.slot, &task.action);
            let ms = started.elapsed().as_secs_f64() * 1e3;
            match &done {
                Ok((tokens, bytes)) => {
                    tracing::info!(slot = task.slot, action = ?task.action, tokens, bytes, ms, "slot action done")
                }
                Err(e) => tracing::warn!(slot = task.slot, action = ?task.action, "slot action failed: {e}"),
            }
            let _ = task.reply.send(done.map(|(tokens, bytes)| SlotDone { tokens, bytes, ms }));
        }
        self.slot_tasks = waiting;
        self.publish();
    }

    /// Saves, restores or erases the cache of idle slot `i`: the positions and file bytes.
    fn slot_action(&mut self, i: usize, action: &SlotAction) -> crate::Result<(usize, u64)> {
        let seq = self.slots[i].seq;
        match action {
            SlotAction::Save(path) => {
                let bytes = self.ctx.save_sequence(seq, &self.slots[i].cache, path)?;
                Ok((self.slots[i].cache.len(), bytes))
            }
            SlotAction::Restore(path) => {
                let restored = self.ctx.restore_sequence(seq, path);
                // a refused file leaves the rows as they were, one that failed midway none
                let kept = self.ctx.seq_len(seq);
                self.slots[i].cache.truncate(kept);
                let (tokens, bytes) = restored?;
                self.slots[i].cache = tokens;
                self.step += 1;
                self.slots[i].last_used = self.step;
                Ok((self.slots[i].cache.len(), bytes))
            }
            SlotAction::Erase => {
                let n = self.slots[i].cache.len();
                self.ctx.truncate(seq, 0);
                self.slots[i].cache.clear();
                Ok((n, 0))
            }
        }
    }

    /// Ends requests that were aborted, whose client left, or whose deadline passed.
    fn sweep(&mut self) {
        let now = Instant::now();
        let why = |cancelled: bool, closed: bool, deadline: Option<Instant>| {
            if closed {
                Some(End::Disconnected)
            } else if cancelled {
                Some(End::Finished(FinishReason::Cancelled))
            } else if deadline.is_some_and(|d| now >= d) {
                Some(End::Failed(Failure::DeadlineExceeded))
            } else {
                None
            }
        };
        let mut kept = VecDeque::with_capacity(self.queue.len());
        for job in std::mem::take(&mut self.queue) {
            match why(job.cancel.is_cancelled(), job.sink.is_closed(), job.req.deadline) {
                Some(end) => {
                    self.release(&job.id);
                    end_queued(job, end, &self.shared.stats);
                }
                None => kept.push_back(job),
            }
        }
        self.queue = kept;
        for i in 0..self.slots.len() {
            let end = match &self.slots[i].active {
                Some(a) => why(a.job.cancel.is_cancelled(), a.job.sink.is_closed(), a.job.req.deadline),
                None => None,
            };
            if let Some(end) = end {
                self.end_slot(i, end);
            }
        }
    }

    /// Forgets a request's id and frees its place in the queue bound.
    fn release(&self, id: &str) {
        self.shared.release(id);
    }

    fn end_slot(&mut self, i: usize, end: End) {
        if let Some(a) = self.slots[i].active.take() {
            self.release(&a.job.id);
            // the gauges count the slot free before the client hears the end
            self.publish();
            a.end(end, &self.shared.stats);
        }
    }

    /// Moves queued requests into free slots, in arrival order: a request that names its slot
    /// (`id_slot`) into that one once it is free (the others pass it meanwhile); the others into
    /// the one whose cache shares the most of the prompt if that share reaches
    /// `--slot-prompt-similarity`, else the least recently used.
    fn admit(&mut self) {
        let mut waiting = VecDeque::new();
        while let Some(job) = self.queue.pop_front() {
            let free: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].active.is_none()).collect();
            if free.is_empty() {
                waiting.push_back(job);
                break;
            }
            if let Some(k) = job.req.slot {
                match free.contains(&k) {
                    true => self.start(k, job),
                    false => waiting.push_back(job),
                }
                continue;
            }
            let best = free.iter().copied().max_by_key(|&i| (common_prefix(&self.slots[i].cache, &job.tokens), i));
            let lru = free.iter().copied().min_by_key(|&i| (self.slots[i].last_used, i));
            let (Some(best), Some(lru)) = (best, lru) else {
                waiting.push_back(job);
                break;
            };
            let share = common_prefix(&self.slots[best].cache, &job.tokens) as f32 / job.tokens.len().max(1) as f32;
            let i = if share > 0.0 && share >= self.shared.config.slot_similarity { best } else { lru };
            self.start(i, job);
        }
        waiting.append(&mut self.queue);
        self.queue = waiting;
    }

    /// Puts `job` in slot `i`, reusing the longest prefix of the slot's cache or the system prompt.
    fn start(&mut self, i: usize, job: Job) {
        let span = job.span.clone();
        let _in = span.enter();
        let now = Instant::now();
        self.shared.stats.queue_time.observe((now - job.req.arrived).as_secs_f64());
        let seq = self.slots[i].seq;
        let prompt = &job.tokens;
        let mut common = common_prefix(&self.slots[i].cache, prompt);
        let sys_common = common_prefix(&self.sys, prompt);
        // Where the copy cannot be made (no device memory for it), the slot starts empty.
        if sys_common > common {
            match self.ctx.copy_prefix(self.sys_seq, seq, sys_common) {
                Ok(()) => {
                    self.slots[i].cache = self.sys[..sys_common].to_vec();
                    common = sys_common;
                }
                Err(_) => {
                    self.slots[i].cache.clear();
                    common = 0;
                }
            }
        }
        self.find_divergence(prompt, sys_common);
        // at least the last prompt token is computed, for its logits
        let cached = common.min(prompt.len().saturating_sub(1));
        self.ctx.truncate(seq, cached);
        self.slots[i].cache.truncate(cached);
        self.step += 1;
        self.slots[i].last_used = self.step;
        let stats = &self.shared.stats;
        stats.prompt_tokens.add(prompt.len() as u64);
        stats.cached_prompt_tokens.add(cached as u64);
        let mut job = job;
        for &t in &job.tokens {
            job.sampler.accept(t);
        }
        tracing::info!(slot = i, prompt_tokens = job.tokens.len(), cached_tokens = cached, "request started");
        self.slots[i].active = Some(Active::new(job, cached, self.shared.config.max_tokens, now));
    }

    /// Reports where the prompt stops matching the cache that shares most of it (any slot's, or
    /// the system prompt) when that share is more than a coincidence.
    fn find_divergence(&self, prompt: &[u32], sys_common: usize) {
        let best = self.slots.iter().enumerate().map(|(k, s)| (common_prefix(&s.cache, prompt), k)).max();
        if let Some((common, k)) = best {
            let cache = &self.slots[k].cache;
            if common >= sys_common + DIVERGENCE_MIN_SHARED && common < cache.len() && common < prompt.len() {
                self.diverged(cache, prompt, common, &format!("slot {k}'s cache"));
            }
        }
        if sys_common >= DIVERGENCE_MIN_SHARED && sys_common < self.sys.len() && sys_common < prompt.len() {
            self.diverged(&self.sys, prompt, sys_common, "the system prompt");
        }
    }

    /// Logs and counts where a prompt stopped matching a cached prefix (a timestamp in a system
    /// prompt, say), so users can find what defeats their prompt cache.
    fn diverged(&self, cached: &[u32], prompt: &[u32], at: usize, what: &str) {
        let stats = &self.shared.stats;
        stats.cache_divergences.add(1);
        stats.cache_divergence_position.observe(at as f64);
        if !self.shared.config.log_prompts {
            // where, and hashes that tell two prompts apart, without their text
            let hash = |ids: &[u32]| {
                use std::hash::{DefaultHasher, Hash, Hasher};
                let mut h = DefaultHasher::new();
                ids.hash(&mut h);
                h.finish() as u32
            };
            let end = |ids: &[u32]| (at + DIVERGENCE_CONTEXT_TOKENS).min(ids.len());
            tracing::info!(
                "prompt cache: the prompt ({} tokens) diverges from {what} at token {at}: next tokens hash {:08x} cached, {:08x} prompt (--log-prompts shows the text)",
                prompt.len(),
                hash(&cached[at..end(cached)]),
                hash(&prompt[at..end(prompt)]),
            );
            return;
        }
        let text = |ids: &[u32]| {
            let end = (at + DIVERGENCE_CONTEXT_TOKENS).min(ids.len());
            self.shared.tokenizer.decode(&ids[at..end], true).unwrap_or_default()
        };
        let before = at.saturating_sub(DIVERGENCE_CONTEXT_TOKENS);
        let shared_text = self.shared.tokenizer.decode(&prompt[before..at], true).unwrap_or_default();
        tracing::info!(
            "prompt cache: the prompt ({} tokens) diverges from {what} at token {at}: after {shared_text:?}, cached {:?}, prompt {:?}",
            prompt.len(),
            text(cached),
            text(prompt)
        );
    }

    /// Updates the gauges.
    fn publish(&self) {
        let s = &self.shared.stats;
        s.running.set(self.slots.iter().filter(|s| s.active.is_some()).count() as u64);
        s.waiting.set(self.queue.len() as u64);
        let used: usize = self.slots.iter().map(|s| self.ctx.seq_len(s.seq)).sum::<usize>();
        s.kv_used_tokens.set((used + self.ctx.seq_len(self.sys_seq)) as u64);
        let mut views = s.slots.lock().unwrap_or_else(|e| e.into_inner());
        views.resize_with(self.slots.len(), Default::default);
        for (v, slot) in views.iter_mut().zip(&self.slots) {
            v.n_cached = slot.cache.len();
            let Some(a) = &slot.active else {
                v.request = None;
                continue;
            };
            // what a request keeps is copied once, when it arrives in the slot
            if v.request.as_deref() != Some(a.job.id.as_str()) {
                v.request = Some(a.job.id.clone());
                v.sampling = Some(a.job.req.sampling.clone());
                v.stop.clone_from(&a.job.req.stop);
            }
            v.n_prompt_tokens = a.job.tokens.len();
            v.n_prompt_cached = a.cached;
            v.n_prompt_processed = a.prefilled;
            v.n_decoded = a.generated;
            v.n_remain = (a.limit.1 != LengthLimit::Context).then(|| a.limit.0.saturating_sub(a.generated));
        }
    }

    /// One batch: a token for every generating slot, then prompt chunks.
    fn decode_step(&mut self) {
        let mut batch = Batch::default();
        // (slot, tokens added to its cache, wants logits)
        let mut parts: Vec<(usize, usize, bool)> = Vec::new();
        let push = |batch: &mut Batch, seq: usize, pos: usize, t: u32, logits: bool| {
            batch.tokens.push(t);
            batch.pos.push(pos as u32);
            batch.seq.push(seq);
            batch.logits.push(logits);
        };
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(t) = s.active.as_ref().and_then(|a| a.pending) {
                push(&mut batch, s.seq, s.cache.len(), t, true);
                parts.push((i, 1, true));
            }
        }
        let mut budget = self.shared.config.prefill_chunk.max(1);
        // oldest admitted first, so prompts are read in arrival order
        let mut prefilling: Vec<usize> =
            (0..self.slots.len()).filter(|&i| self.slots[i].active.as_ref().is_some_and(|a| a.in_prefill())).collect();
        prefilling.sort_by_key(|&i| self.slots[i].active.as_ref().map(|a| a.admitted));
        for i in prefilling {
            if budget == 0 {
                break;
            }
            let s = &self.slots[i];
            let Some(a) = &s.active else { continue };
            let n = (a.prompt_len() - a.prefilled).min(budget);
            let last = a.prefilled + n == a.prompt_len();
            for (k, &t) in a.job.tokens[a.prefilled..a.prefilled + n].iter().enumerate() {
                push(&mut batch, s.seq, s.cache.len() + k, t, last && k + 1 == n);
            }
            parts.push((i, n, last));
            budget -= n;
        }
        if batch.is_empty() {
            return;
        }
        self.shared.stats.steps.add(1);
        let faults = tandem_model::guard::faults();
        let decoded = self.ctx.decode(&batch);
        if tandem_model::guard::faults() != faults {
            // a model page could not be read (the file was truncated during the batch): its
            // results are zeros' work, thrown away, and the engine stops
            let why = self.shared.model.gguf().check_unchanged().err().unwrap_or_else(|| {
                "a model file could not be read while mapped (SIGBUS); restart the server".to_string()
            });
            tracing::error!("a model page faulted during a batch (SIGBUS): the batch is discarded");
            self.shared.break_down(&why);
            return;
        }
        *self.shared.stats.devices.lock().unwrap_or_else(|e| e.into_inner()) = self.ctx.exec().ledgers();
        let logits = match decoded {
            Ok(l) => l,
            Err(e) => {
                // the cache is as it was: fail the requests of this batch, keep the server up
                let msg = format!("decoding failed: {e}");
                tracing::error!("{msg}");
                for (i, _, _) in parts {
                    self.end_slot(i, End::Failed(Failure::Internal(msg.clone())));
                }
                return;
            }
        };
        let n_vocab = self.ctx.model().n_vocab();
        let n_ctx = self.ctx.params().n_ctx;
        let mut row = 0;
        for (i, n, wants) in parts {
            let slot = &mut self.slots[i];
            let Some(a) = slot.active.as_mut() else { continue };
            if let Some(t) = a.pending.take() {
                slot.cache.push(t);
            } else {
                let from = a.prefilled;
                slot.cache.extend_from_slice(&a.job.tokens[from..from + n]);
                a.prefilled += n;
            }
            if !wants {
                continue;
            }
            let Some(l) = logits.get(row * n_vocab..(row + 1) * n_vocab) else {
                self.end_slot(i, End::Failed(Failure::Internal("the model returned too few logits".into())));
                continue;
            };
            row += 1;
            let cache_len = slot.cache.len();
            match a.on_logits(l, &self.shared.tokenizer, &self.shared.stats, cache_len, n_ctx) {
                Next::Continue => {}
                Next::End(end) => self.end_slot(i, end),
            }
        }
    }
}
