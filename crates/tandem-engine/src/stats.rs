//! Counters, gauges and histograms the engine keeps as it runs, lock-free, for a metrics endpoint
//! to read at any time. Names and units are the Prometheus ones the server exports.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bucket upper bounds in seconds for latencies (time to first token, end to end, queue).
pub const LATENCY_BUCKETS_S: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
/// Bucket upper bounds in seconds for the time between two tokens of one stream.
pub const INTER_TOKEN_BUCKETS_S: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];
/// Bucket upper bounds in tokens for where prompts diverge from the cached prefix.
pub const POSITION_BUCKETS: &[f64] = &[1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0];

/// A Prometheus histogram: cumulative buckets are computed when read.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One per bound, plus the overflow (+Inf) bucket; not cumulative.
    counts: Vec<AtomicU64>,
    /// f64 bits of the sum of observations.
    sum: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum: AtomicU64::new(0) }
    }

    pub fn observe(&self, v: f64) {
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some((f64::from_bits(bits) + v).to_bits()));
    }

    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// Cumulative counts per bound, then the total (the +Inf bucket).
    pub fn cumulative(&self) -> Vec<u64> {
        let mut acc = 0;
        self.counts
            .iter()
            .map(|c| {
                acc += c.load(Ordering::Relaxed);
                acc
            })
            .collect()
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum.load(Ordering::Relaxed))
    }
}

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Everything the engine measures.
#[derive(Debug)]
pub struct Stats {
    pub time_to_first_token: Histogram,
    pub inter_token: Histogram,
    pub end_to_end: Histogram,
    pub queue_time: Histogram,
    pub prompt_tokens: Counter,
    pub cached_prompt_tokens: Counter,
    pub generated_tokens: Counter,
    /// Requests that ended, by how: finished normally, cancelled or disconnected, failed.
    pub requests_finished: Counter,
    pub requests_cancelled: Counter,
    pub requests_failed: Counter,
    /// Requests refused at the door (queue full).
    pub requests_rejected: Counter,
    /// Prompts that shared a prefix with a slot's cache but then differed, and where.
    pub cache_divergences: Counter,
    pub cache_divergence_position: Histogram,
    /// Chat templates rendered (a request renders its prompt once, whatever its `n`).
    pub templates_rendered: Counter,
    /// Requests in a slot now / waiting for one.
    pub running: Gauge,
    pub waiting: Gauge,
    /// KV cache positions in use, over all slots, and the most there can be.
    pub kv_used_tokens: Gauge,
    pub kv_capacity_tokens: Gauge,
    /// Decode steps run (each one batch over the active slots).
    pub steps: Counter,
    /// Each device's ledger (launches, copies, host waits) after the last step; the CPU first.
    pub devices: std::sync::Mutex<Vec<(String, tandem_model::Counts)>>,
    /// Each slot after the last step (llama-server's `GET /slots`).
    pub slots: std::sync::Mutex<Vec<SlotView>>,
}

/// One slot as of the last step.
#[derive(Clone, Debug, Default)]
pub struct SlotView {
    /// The request at work in the slot; `None` when it is idle.
    pub request: Option<String>,
    /// Positions in the slot's KV cache (when idle: the prompt cache the next request may reuse).
    pub n_cached: usize,
    /// The request's prompt tokens, those reused from the cache and those in the cache so far.
    pub n_prompt_tokens: usize,
    pub n_prompt_cached: usize,
    pub n_prompt_processed: usize,
    pub n_decoded: u32,
    /// Tokens it may still generate before its length limit; `None`: only the context limits it.
    pub n_remain: Option<u32>,
    /// The sampling of the slot's current (or, when idle, last) request.
    pub sampling: Option<crate::SamplingParams>,
    pub stop: Vec<String>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            time_to_first_token: Histogram::new(LATENCY_BUCKETS_S),
            inter_token: Histogram::new(INTER_TOKEN_BUCKETS_S),
            end_to_end: Histogram::new(LATENCY_BUCKETS_S),
            queue_time: Histogram::new(LATENCY_BUCKETS_S),
            prompt_tokens: Counter::default(),
            cached_prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            requests_finished: Counter::default(),
            requests_cancelled: Counter::default(),
            requests_failed: Counter::default(),
            requests_rejected: Counter::default(),
            cache_divergences: Counter::default(),
            cache_divergence_position: Histogram::new(POSITION_BUCKETS),
            templates_rendered: Counter::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_used_tokens: Gauge::default(),
            kv_capacity_tokens: Gauge::default(),
            steps: Counter::default(),
            devices: std::sync::Mutex::default(),
            slots: std::sync::Mutex::default(),
        }
    }
}

impl Stats {
    /// Each device's ledger as of the last step.
    pub fn device_counts(&self) -> Vec<(String, tandem_model::Counts)> {
        self.devices.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Each slot as of the last step.
    pub fn slot_views(&self) -> Vec<SlotView> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Share of prompt tokens served from the prompt cache (0 before any prompt).
    pub fn prompt_cache_hit_ratio(&self) -> f64 {
        let p = self.prompt_tokens.get();
        if p == 0 {
            0.0
        } else {
            self.cached_prompt_tokens.get() as f64 / p as f64
        }
    }

    /// Share of the KV cache in use.
    pub fn kv_usage_ratio(&self) -> f64 {
        let cap = self.kv_capacity_tokens.get();
        if cap == 0 {
            0.0
        } else {
            self.kv_used_tokens.get() as f64 / cap as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 3.0] {
            h.observe(v);
        }
        assert_eq!(h.cumulative(), [2, 3, 4]);
        assert_eq!(h.count(), 4);
        assert_eq!(h.sum(), 6.0);
    }
}
