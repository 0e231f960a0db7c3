//! Sampling, per request: logit biases, then repetition / presence / frequency penalties over a
//! window, then DRY, top-n-sigma, top-k, locally typical, top-p, min-p, XTC and temperature, then
//! a draw from a seeded ChaCha20 generator (the same seed gives the same tokens); temperature 0 is
//! greedy. The order is llama.cpp's default sampler chain (common/sampling.cpp: logit_bias;
//! penalties; dry; top_n_sigma; top_k; typical; top_p; min_p; xtc; temperature; dist); with mirostat
//! (1 or 2) it is llama.cpp's too: logit_bias; temperature; mirostat, no penalties. Each filter is
//! llama.cpp's arithmetic (tests/fixtures/sampling holds its survivors on fixed logits); the
//! random numbers are not llama.cpp's (std::mt19937), so a seed gives other tokens than there.
//!
//! Also here: [`StopMatcher`], which finds stop strings across token boundaries and holds back
//! text that might be the start of one, so a stop string is never emitted.

use crate::dry::{Dry, DryBreakers};
use crate::{Error, Result};
use rand_chacha::ChaCha20Rng;
use rand_core::{RngCore, SeedableRng};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// How to pick the next token. The defaults are llama.cpp's.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability adds up to `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = none).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens in the window by this (1 = off).
    pub repeat_penalty: f32,
    /// Subtract this from the logit of every token in the window (0 = off).
    pub presence_penalty: f32,
    /// Subtract this times the token's count in the window (0 = off).
    pub frequency_penalty: f32,
    /// How many of the last tokens the penalties look at (0 = none).
    pub penalty_last_n: usize,
    /// Seed of the random draw.
    pub seed: u64,
    /// Added to a token's logit before everything else (llama.cpp's `--logit-bias`, OpenAI's
    /// `logit_bias`); `-inf` bans the token. A token listed twice gets both.
    pub logit_bias: Vec<(u32, f32)>,
    /// Locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to
    /// this total probability (1 or more = off).
    pub typical_p: f32,
    /// Drop tokens whose logit is more than this many standard deviations below the largest
    /// (0 or less = off).
    pub top_n_sigma: f32,
    /// XTC: with this probability per token, drop every token at least `xtc_threshold` likely but
    /// the least likely of them (0 = off).
    pub xtc_probability: f32,
    /// XTC's threshold (above 0.5 = off).
    pub xtc_threshold: f32,
    /// Mirostat version (0 = off, 1, 2): a target surprise `mirostat_tau` learned at
    /// `mirostat_eta` instead of the filters and penalties.
    pub mirostat: u8,
    pub mirostat_tau: f32,
    pub mirostat_eta: f32,
    /// DRY ("don't repeat yourself"): a token that would extend a repeat of the last tokens
    /// longer than `dry_allowed_length` loses `dry_multiplier * dry_base^(length - allowed)`
    /// (0 = off).
    pub dry_multiplier: f32,
    /// DRY's base (below 1 = off).
    pub dry_base: f32,
    pub dry_allowed_length: u32,
    /// How many of the last tokens DRY looks at (0 = off).
    pub dry_penalty_last_n: u32,
    /// Texts that end a repeat for DRY (a repeat does not reach back across one).
    pub dry_sequence_breakers: Vec<String>,
}

/// llama.cpp's DRY sequence breakers.
pub const DRY_SEQUENCE_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
            logit_bias: Vec::new(),
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: 64,
            dry_sequence_breakers: DRY_SEQUENCE_BREAKERS.map(String::from).to_vec(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, ..SamplingParams::default() }
    }

    /// DRY takes part (llama.cpp: a multiplier, a base of 1 or more and a window).
    pub fn dry_on(&self) -> bool {
        self.dry_multiplier != 0.0 && self.dry_base >= 1.0 && self.dry_penalty_last_n != 0
    }

    /// Rejects values no sampler can use; the message names the parameter.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, v: f32, want: &str| Err(Error::InvalidParam(format!("{name} = {v}: must be {want}")));
        if !self.temperature.is_finite() {
            return bad("temperature", self.temperature, "a finite number");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "in [0, 1]");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad("repeat_penalty", self.repeat_penalty, "a positive number");
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", self.presence_penalty, "a finite number");
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", self.frequency_penalty, "a finite number");
        }
        if !(self.typical_p.is_finite() && self.typical_p >= 0.0) {
            return bad("typical_p", self.typical_p, "a number >= 0 (1 or more = off)");
        }
        if !self.top_n_sigma.is_finite() {
            return bad("top_n_sigma", self.top_n_sigma, "a finite number (0 or less = off)");
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return bad("xtc_probability", self.xtc_probability, "in [0, 1]");
        }
        if !(0.0..=1.0).contains(&self.xtc_threshold) {
            return bad("xtc_threshold", self.xtc_threshold, "in [0, 1] (above 0.5 = off)");
        }
        if self.mirostat > 2 {
            return bad("mirostat", f32::from(self.mirostat), "0 (off), 1 or 2");
        }
        if !(self.mirostat_tau.is_finite() && self.mirostat_tau >= 0.0) {
            return bad("mirostat_tau", self.mirostat_tau, "a number >= 0");
        }
        if !(self.mirostat_eta.is_finite() && self.mirostat_eta >= 0.0) {
            return bad("mirostat_eta", self.mirostat_eta, "a number >= 0");
        }
        if !(self.dry_multiplier.is_finite() && self.dry_multiplier >= 0.0) {
            return bad("dry_multiplier", self.dry_multiplier, "a number >= 0 (0 = off)");
        }
        if !self.dry_base.is_finite() {
            return bad("dry_base", self.dry_base, "a finite number (below 1 = off)");
        }
        if self.dry_sequence_breakers.len() > MAX_DRY_BREAKERS {
            return Err(Error::InvalidParam(format!(
                "dry_sequence_breakers: {} of them, at most {MAX_DRY_BREAKERS}",
                self.dry_sequence_breakers.len()
            )));
        }
        if let Some(&(t, b)) = self.logit_bias.iter().find(|(_, b)| b.is_nan() || *b == f32::INFINITY) {
            return bad(&format!("logit_bias of token {t}"), b, "a finite number or -inf (a ban)");
        }
        Ok(())
    }
}

/// The most DRY sequence breakers a request may give (each is matched against every token).
pub const MAX_DRY_BREAKERS: usize = 64;

/// A sampler for one request: its parameters, random state and penalty window.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    window: VecDeque<u32>,
    /// Mirostat's learned maximum surprise (starts at twice its target).
    mu: f32,
    dry: Option<Dry>,
}

impl Sampler {
    /// A sampler whose DRY (if on) has no sequence breakers: see [`Sampler::with_dry_breakers`].
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        let rng = ChaCha20Rng::seed_from_u64(params.seed);
        let mu = 2.0 * params.mirostat_tau;
        let dry = (params.dry_on() && params.mirostat == 0).then(Dry::default);
        Ok(Sampler { params, rng, window: VecDeque::new(), mu, dry })
    }

    /// DRY's sequence breakers, processed against the vocabulary ([`DryBreakers::new`] of
    /// the parameters' `dry_sequence_breakers`).
    pub fn with_dry_breakers(mut self, breakers: Arc<DryBreakers>) -> Sampler {
        if let Some(d) = &mut self.dry {
            d.set_breakers(breakers);
        }
        self
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token (prompt or generated) in the penalty window.
    pub fn accept(&mut self, token: u32) {
        if let Some(d) = &mut self.dry {
            d.accept(token, self.params.dry_penalty_last_n as usize);
        }
        if self.params.penalty_last_n == 0 {
            return;
        }
        if self.window.len() == self.params.penalty_last_n {
            self.window.pop_front();
        }
        self.window.push_back(token);
    }

    /// Picks the next token from one row of logits. Does not [`accept`](Self::accept) it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let p = &self.params;
        let filters_drop_the_top = p.typical_p < 1.0 || self.xtc_on();
        if p.temperature <= 0.0 && (p.mirostat != 0 || !filters_drop_the_top) {
            return Ok(argmax(&self.adjusted(logits)?));
        }
        let mut cand = self.candidates(logits)?;
        if self.params.temperature <= 0.0 {
            return Ok(cand[0].0);
        }
        for c in &mut cand {
            c.1 /= self.params.temperature;
        }
        if self.params.mirostat != 0 {
            return Ok(self.mirostat(cand, logits.len()));
        }
        let probs = softmax(&cand);
        Ok(cand[self.draw(&probs)].0)
    }

    /// The logits with the biases added and, without mirostat, the penalties applied; an error
    /// when every token is banned.
    fn adjusted(&self, logits: &[f32]) -> Result<Vec<f32>> {
        if logits.is_empty() {
            return Err(Error::InvalidParam("no logits to sample from (empty vocabulary)".into()));
        }
        let mut logits = logits.to_vec();
        for &(t, b) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if self.params.mirostat == 0 {
            self.apply_penalties(&mut logits);
            if let Some(d) = &self.dry {
                d.apply(&self.params, &mut logits);
            }
        }
        if !logits.iter().any(|&l| l > f32::NEG_INFINITY) {
            return Err(Error::InvalidParam(
                "every token is banned (by logit_bias, the output constraint or ignore_eos)".into(),
            ));
        }
        Ok(logits)
    }

    fn xtc_on(&self) -> bool {
        self.params.xtc_probability > 0.0 && self.params.xtc_threshold <= 0.5
    }

    /// The tokens the filters leave to draw from, `(id, logit)` most likely first (before the
    /// temperature). With mirostat every token is left: it truncates after the temperature.
    pub(crate) fn candidates(&mut self, logits: &[f32]) -> Result<Vec<(u32, f32)>> {
        let logits = self.adjusted(logits)?;
        // banned tokens take no part (llama.cpp keeps them at -inf, where no filter keeps them
        // and no draw picks them)
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|c| *c.1 > f32::NEG_INFINITY).map(|(i, &l)| (i as u32, l)).collect();
        let p = &self.params;
        if p.mirostat != 0 {
            cand.sort_unstable_by(by_logit);
            return Ok(cand);
        }
        if p.top_n_sigma > 0.0 && cand.len() > 1 {
            top_n_sigma(&mut cand, p.top_n_sigma);
        }
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit);
        if p.typical_p < 1.0 {
            typical(&mut cand, p.typical_p);
        }
        if p.top_p < 1.0 {
            let probs = softmax(&cand);
            let mut sum = 0.0;
            let mut keep = cand.len();
            for (i, q) in probs.iter().enumerate() {
                sum += q;
                if sum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            // p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p)
            let threshold = cand[0].1 + p.min_p.ln();
            let keep = cand.iter().take_while(|c| c.1 >= threshold).count();
            cand.truncate(keep.max(1));
        }
        if self.xtc_on() && cand.len() >= 2 && self.uniform() as f32 <= self.params.xtc_probability {
            // every token at least as likely as the threshold but the last of them goes
            let probs = softmax_f32(&cand);
            let last = probs.iter().take_while(|&&q| q >= self.params.xtc_threshold).count().saturating_sub(1);
            cand.drain(..last);
        }
        Ok(cand)
    }

    /// Mirostat 1 or 2 on candidates most likely first, after the temperature: truncates, draws,
    /// and learns `mu` from the drawn token's surprise (llama.cpp's arithmetic, in f32).
    fn mirostat(&mut self, mut cand: Vec<(u32, f32)>, n_vocab: usize) -> u32 {
        let (tau, eta) = (self.params.mirostat_tau, self.params.mirostat_eta);
        cand.truncate(self.mirostat_keep(&cand, n_vocab));
        let probs = softmax_f32(&cand);
        let i = self.draw(&probs.iter().map(|&q| q as f64).collect::<Vec<_>>());
        self.mu -= eta * (-probs[i].log2() - tau);
        cand[i].0
    }

    /// How many of the candidates (most likely first) mirostat keeps at the current `mu`.
    fn mirostat_keep(&self, cand: &[(u32, f32)], n_vocab: usize) -> usize {
        let probs = softmax_f32(cand);
        if self.params.mirostat == 1 {
            // Zipf exponent s from the 100 most likely tokens, then the k that gives surprise mu
            let (mut sum_tb, mut sum_tt) = (0f32, 0f32);
            for i in 0..99.min(probs.len() - 1) {
                let t = ((i + 2) as f32 / (i + 1) as f32).ln();
                sum_tb += t * (probs[i] / probs[i + 1]).ln();
                sum_tt += t * t;
            }
            let s = sum_tb / sum_tt;
            let eps = s - 1.0;
            let k = ((eps * 2f32.powf(self.mu)) / (1.0 - (n_vocab as f32).powf(-eps))).powf(1.0 / s);
            // NaN (one candidate) and negative k keep one, as llama.cpp's int(k)
            (k as usize).clamp(1, cand.len())
        } else {
            probs.iter().take_while(|&&q| -q.log2() <= self.mu).count().max(1)
        }
    }

    /// A uniform number in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An index drawn with the given probabilities.
    fn draw(&mut self, probs: &[f64]) -> usize {
        let r = self.uniform();
        let mut sum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            sum += q;
            if r < sum {
                return i;
            }
        }
        probs.len() - 1
    }

    /// llama.cpp's penalties sampler: repetition (divide/multiply), frequency and presence.
    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if self.window.is_empty()
            || (p.repeat_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0)
        {
            return;
        }
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in &self.window {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &n) in &counts {
            let Some(l) = logits.get_mut(t as usize) else { continue };
            if *l <= 0.0 {
                *l *= p.repeat_penalty;
            } else {
                *l /= p.repeat_penalty;
            }
            *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// The index of the largest logit (the first one on ties, like llama.cpp's greedy sampler).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Most likely first; ties: lower id first, like a stable sort.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// llama.cpp's top-n-sigma: drop logits below max - n * (their standard deviation).
fn top_n_sigma(cand: &mut Vec<(u32, f32)>, n: f32) {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let count = cand.len() as f32;
    let mean = cand.iter().map(|c| c.1).sum::<f32>() / count;
    let std = (cand.iter().map(|c| (c.1 - mean).powi(2)).sum::<f32>() / count).sqrt();
    cand.retain(|c| c.1 >= max - n * std);
}

/// llama.cpp's locally typical sampling on candidates most likely first: the tokens whose
/// surprise `-ln p` is closest to the entropy, until their probability passes `p`.
fn typical(cand: &mut Vec<(u32, f32)>, p: f32) {
    let probs = softmax_f32(cand);
    let entropy: f32 = probs.iter().map(|&q| -q * q.ln()).sum();
    let shifted: Vec<f32> = probs.iter().map(|&q| (-q.ln() - entropy).abs()).collect();
    let mut order: Vec<usize> = (0..cand.len()).collect();
    order.sort_by(|&a, &b| shifted[a].total_cmp(&shifted[b]));
    let mut sum = 0f32;
    let mut keep = order.len();
    for (i, &k) in order.iter().enumerate() {
        sum += probs[k];
        if sum > p {
            keep = i + 1;
            break;
        }
    }
    let mut kept: Vec<(u32, f32)> = order[..keep].iter().map(|&k| cand[k]).collect();
    kept.sort_unstable_by(by_logit);
    *cand = kept;
}

/// Probabilities as llama.cpp computes them (f32, from the largest logit).
fn softmax_f32(cand: &[(u32, f32)]) -> Vec<f32> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

fn softmax(cand: &[(u32, f32)]) -> Vec<f64> {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let exps: Vec<f64> = cand.iter().map(|c| (c.1 as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// Finds stop strings in streamed text. Text that could still become a stop string is held back
/// until it cannot; a stop string itself and everything after it are never emitted.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

/// What [`StopMatcher::push`] lets through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopOutput {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string was found: generation should end (after emitting `text`).
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new<S: AsRef<str>>(stops: &[S]) -> StopMatcher {
        let stops = stops.iter().map(|s| s.as_ref().to_string()).filter(|s| !s.is_empty()).collect();
        StopMatcher { stops, held: String::new(), stopped: false }
    }

    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.stopped {
            return StopOutput { text: String::new(), stopped: true };
        }
        self.held.push_str(text);
        // the earliest stop string wins
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return StopOutput { text, stopped: true };
        }
        // hold back the longest tail that is a prefix of some stop string
        let mut keep_from = self.held.len();
        for (i, _) in self.held.char_indices() {
            let tail = &self.held[i..];
            if self.stops.iter().any(|s| s.starts_with(tail)) {
                keep_from = i;
                break;
            }
        }
        let text = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        StopOutput { text, stopped: false }
    }

    /// The end of the stream: whatever was held back is not a stop string after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 2.9, 0.0]
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&logits()).unwrap(), 1);
        assert_eq!(argmax(&[1.0, 5.0, 5.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
            ..SamplingParams::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..64).map(|_| s.sample(&logits()).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        assert_ne!(draw(&p), draw(&SamplingParams { seed: 43, ..p.clone() }));
        // a high temperature over six candidates reaches more than one of them
        assert!(draw(&p).iter().collect::<std::collections::HashSet<_>>().len() > 2);
    }

    #[test]
    fn filters_restrict_the_candidates() {
        let base = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..SamplingParams::default() };
        for (p, allowed) in [
            (SamplingParams { top_k: 2, ..base.clone() }, vec![1, 4]),
            (SamplingParams { top_p: 0.3, ..base.clone() }, vec![1]),
            (SamplingParams { min_p: 0.6, ..base.clone() }, vec![1, 4, 2]),
        ] {
            for seed in 0..50 {
                let mut s = Sampler::new(SamplingParams { seed, ..p.clone() }).unwrap();
                let t = s.sample(&logits()).unwrap();
                assert!(allowed.contains(&t), "{p:?} gave {t}");
            }
        }
    }

    #[test]
    fn penalties_follow_llama_cpp() {
        let p = SamplingParams {
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(p).unwrap();
        s.accept(1);
        s.accept(1);
        s.accept(3);
        let mut l = logits();
        s.apply_penalties(&mut l);
        assert_eq!(l[1], 3.0 / 2.0 - 2.0 * 0.25 - 0.5);
        assert_eq!(l[3], -2.0 - 0.25 - 0.5); // a negative logit is multiplied
        assert_eq!(s.sample(&logits()).unwrap(), 4); // token 1 is penalised below token 4
    }

    #[test]
    fn logit_bias_comes_before_the_penalties_and_can_ban() {
        // token 1 (3.0) is the argmax; -inf bans it, token 4 (2.9) is next
        let ban = SamplingParams { logit_bias: vec![(1, f32::NEG_INFINITY)], ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(ban).unwrap().sample(&logits()).unwrap(), 4);
        // a bias lifts token 3 (-1.0) to 3.5; ids past the vocabulary are the engine's to reject
        let lift = SamplingParams { logit_bias: vec![(3, 4.5), (99, 1.0)], ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(lift).unwrap().sample(&logits()).unwrap(), 3);
        // the bias goes first: 2.5 + 1.5 = 4.0, then the repeat penalty halves it to 2.0
        let p = SamplingParams { logit_bias: vec![(2, 1.5)], repeat_penalty: 2.0, ..SamplingParams::greedy() };
        let mut s = Sampler::new(p).unwrap();
        s.accept(2);
        assert_eq!(s.sample(&logits()).unwrap(), 1);
        // sampled, a banned token is never drawn
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            logit_bias: vec![(1, f32::NEG_INFINITY), (4, f32::NEG_INFINITY)],
            ..SamplingParams::default()
        };
        for seed in 0..50 {
            let t = Sampler::new(SamplingParams { seed, ..p.clone() }).unwrap().sample(&logits()).unwrap();
            assert!(t != 1 && t != 4, "seed {seed} drew banned token {t}");
        }
        // banning everything is an error, not token 0
        let all = SamplingParams { logit_bias: (0..6).map(|t| (t, f32::NEG_INFINITY)).collect(), ..p };
        let e = Sampler::new(all).unwrap().sample(&logits()).unwrap_err();
        assert!(e.to_string().contains("every token is banned"), "{e}");
        for b in [f32::NAN, f32::INFINITY] {
            let e = Sampler::new(SamplingParams { logit_bias: vec![(7, b)], ..SamplingParams::default() }).unwrap_err();
            assert!(e.to_string().contains("logit_bias of token 7"), "{e}");
        }
    }

    /// Each filter keeps the tokens llama.cpp's keeps on the same logits
    /// (scripts/gen_sampler_fixtures.py).
    #[test]
    fn filters_keep_what_llama_cpps_keep() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/sampling/llama_cpp_samplers.json");
        let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let off = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..SamplingParams::default() };
        let cases = f["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 57);
        for c in cases {
            let logits: Vec<f32> = f["logits"][c["logits"].as_str().unwrap()]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            let v = c["value"].as_f64().unwrap() as f32;
            let p = match c["sampler"].as_str().unwrap() {
                "typical" => SamplingParams { typical_p: v, ..off.clone() },
                "top_n_sigma" => SamplingParams { top_n_sigma: v, ..off.clone() },
                "xtc" => SamplingParams { xtc_probability: 1.0, xtc_threshold: v, ..off.clone() },
                "mirostat1" => SamplingParams { mirostat: 1, mirostat_tau: v, ..off.clone() },
                "mirostat2" => SamplingParams { mirostat: 2, mirostat_tau: v, ..off.clone() },
                other => panic!("{other}"),
            };
            let mut s = Sampler::new(p.clone()).unwrap();
            let mut cand = s.candidates(&logits).unwrap();
            if p.mirostat != 0 {
                cand.truncate(s.mirostat_keep(&cand, logits.len()));
            }
            let mut kept: Vec<u64> = cand.iter().map(|c| u64::from(c.0)).collect();
            kept.sort_unstable();
            let want: Vec<u64> = c["kept"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            assert_eq!(kept, want, "{c}");
        }
    }

    #[test]
    fn mirostat_learns_its_target_surprise() {
        // on a flat distribution a low target keeps few tokens: mu falls from 2 tau as the draws
        // are more surprising than tau
        let flat = vec![0.0; 64];
        let p = SamplingParams {
            mirostat: 2,
            mirostat_tau: 3.0,
            mirostat_eta: 0.5,
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(p).unwrap();
        assert_eq!(s.mu, 6.0);
        let t = s.sample(&flat).unwrap();
        assert!(t < 64);
        // every token has surprise 6 = mu: all kept, drawn surprise 6, mu = 6 - 0.5 * (6 - 3)
        assert_eq!(s.mu, 4.5);
        s.sample(&flat).unwrap();
        // none has surprise <= 4.5: one kept, surprise 0, mu = 4.5 - 0.5 * (0 - 3)
        assert_eq!(s.mu, 6.0);
        // temperature 0 with mirostat is greedy, as llama.cpp's temperature before it
        let g = SamplingParams { mirostat: 1, temperature: 0.0, ..SamplingParams::default() };
        assert_eq!(Sampler::new(g).unwrap().sample(&logits()).unwrap(), 1);
    }

    #[test]
    fn typical_and_xtc_apply_at_temperature_zero_too() {
        // XTC drops the two tokens above 0.2 but the less likely: greedy then takes token 4
        let logits = logits();
        let p = SamplingParams { xtc_probability: 1.0, xtc_threshold: 0.2, ..SamplingParams::greedy() };
        let mut s = Sampler::new(p).unwrap();
        let cand = s.candidates(&logits).unwrap();
        assert!(!cand.iter().any(|c| c.0 == 1), "{cand:?}");
        assert_eq!(
            Sampler::new(SamplingParams { xtc_probability: 1.0, xtc_threshold: 0.2, ..SamplingParams::greedy() })
                .unwrap()
                .sample(&logits)
                .unwrap(),
            cand[0].0
        );
    }

    #[test]
    fn invalid_params_are_rejected() {
        let e = Sampler::new(SamplingParams { top_p: 0.0, ..SamplingParams::default() }).unwrap_err();
        assert!(e.to_string().contains("top_p"), "{e}");
        assert!(Sampler::new(SamplingParams { temperature: f32::NAN, ..SamplingParams::default() }).is_err());
    }

    #[test]
    fn stop_strings_are_found_across_pieces_and_never_emitted() {
        let mut m = StopMatcher::new(&["</end>", "STOP"]);
        let mut out = String::new();
        let mut stopped = false;
        for piece in ["Hello <", "/e", "x> and </", "en", "d> tail"] {
            let o = m.push(piece);
            out.push_str(&o.text);
            if o.stopped {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(out, "Hello </ex> and ");
        // held-back text that never becomes a stop string comes out at the end
        let mut m = StopMatcher::new(&["STOP"]);
        assert_eq!(m.push("a ST").text, "a ");
        assert_eq!(m.push("O").text, "");
        assert_eq!(m.finish(), "STO");
        let mut m = StopMatcher::new::<&str>(&[]);
        assert_eq!(m.push("anything").text, "anything");
    }
}
