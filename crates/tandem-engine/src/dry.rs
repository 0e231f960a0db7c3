//! DRY ("don't repeat yourself"), llama.cpp's sampler from koboldcpp: a token that would extend
//! a repeat of the last tokens beyond an allowed length loses `multiplier * base^(length -
//! allowed)`; a repeat does not reach back across a sequence breaker. The breakers are
//! processed against the vocabulary as llama.cpp does; the arithmetic is llama.cpp's
//! (tests/fixtures/sampling/llama_cpp_dry.json holds its penalties).

use crate::{Result, SamplingParams};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use tandem_tokenizer::Tokenizer;

/// DRY's sequence breakers against a vocabulary, as llama.cpp processes them
/// (`get_overlapping_token_sequences`): for every token that holds a breaker or can begin one,
/// the tokens that must follow it to complete the breaker (none: the token holds a whole one).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DryBreakers {
    heads: HashMap<u32, Vec<Vec<u32>>>,
}

impl DryBreakers {
    /// llama.cpp cuts a breaker to 40 bytes and a completion to 20 tokens.
    const MAX_BYTES: usize = 40;
    const MAX_TAIL: usize = 20;

    pub fn new(tok: &Tokenizer, breakers: &[String]) -> Result<DryBreakers> {
        let mut heads: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        // each token's text as llama.cpp's detokenizer gives one token alone (special tokens'
        // text included; SentencePiece: one leading space dropped)
        let strip = tok.add_space_prefix();
        let words: Vec<&[u8]> = (0..tok.n_vocab() as u32)
            .map(|id| {
                let w = tok.token_to_piece(id, true).unwrap_or_default();
                if strip {
                    w.strip_prefix(b" ").unwrap_or(w)
                } else {
                    w
                }
            })
            .collect();
        for b in breakers.iter().filter(|b| !b.is_empty()) {
            // (at a character boundary: the completion is tokenized as text)
            let mut end = b.len().min(Self::MAX_BYTES);
            while !b.is_char_boundary(end) {
                end -= 1;
            }
            let s = &b.as_bytes()[..end];
            // the completion after the breaker's first n bytes, by n
            let mut rests: HashMap<usize, Vec<u32>> = HashMap::new();
            for (id, word) in words.iter().enumerate() {
                if contains(word, s) {
                    heads.entry(id as u32).or_default().push(Vec::new());
                    continue;
                }
                // a suffix of the token that is a prefix of the breaker: the rest must follow
                for pos in (0..word.len()).filter(|&p| word[p] == s[0]) {
                    let n = (word.len() - pos).min(s.len());
                    if word[pos..pos + n] != s[..n] {
                        continue;
                    }
                    // (a completion that starts inside a character is not text: skipped)
                    let Ok(rest) = std::str::from_utf8(&s[n..]) else { continue };
                    let tail = match rests.get(&n) {
                        Some(t) => t.clone(),
                        None => {
                            let mut t = tok.encode(rest, false, false)?;
                            t.truncate(Self::MAX_TAIL);
                            rests.insert(n, t.clone());
                            t
                        }
                    };
                    let tails = heads.entry(id as u32).or_default();
                    if !tails.contains(&tail) {
                        tails.push(tail);
                    }
                }
            }
        }
        Ok(DryBreakers { heads })
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    match needle {
        [] => true,
        [b] => hay.contains(b),
        _ => hay.windows(needle.len()).any(|w| w == needle),
    }
}

/// DRY's state: the breakers and the last tokens.
#[derive(Clone, Debug, Default)]
pub(crate) struct Dry {
    breakers: Arc<DryBreakers>,
    last: VecDeque<u32>,
}

impl Dry {
    pub fn set_breakers(&mut self, breakers: Arc<DryBreakers>) {
        self.breakers = breakers;
    }

    /// Records a token in the window of the last `last_n`.
    pub fn accept(&mut self, token: u32, last_n: usize) {
        if self.last.len() == last_n {
            self.last.pop_front();
        }
        self.last.push_back(token);
    }

    /// llama.cpp's DRY sampler (from koboldcpp): the longest repeats of the last tokens' end
    /// found earlier in the window (stopping at a sequence breaker), and a penalty on each token
    /// that would continue one beyond the allowed length.
    pub fn apply(&self, p: &SamplingParams, logits: &mut [f32]) {
        let d = self;
        let allowed = p.dry_allowed_length as usize;
        let n = d.last.len();
        if n <= allowed {
            return;
        }
        // `at(i)`: the i-th token from the end
        let at = |i: usize| d.last[n - 1 - i];
        // 1: the longest repeat may not reach back across the nearest breaker
        let mut rep_limit = n;
        for i in 0..n {
            let Some(tails) = d.breakers.heads.get(&at(i)) else { continue };
            let longest = tails
                .iter()
                .filter(|t| t.len() <= i && t.iter().enumerate().all(|(o, &tok)| tok == at(i - o - 1)))
                .map(Vec::len)
                .max();
            if let Some(l) = longest {
                rep_limit = i - l;
                break;
            }
        }
        if rep_limit < allowed {
            return;
        }
        // 2: for every position, how long a suffix of the window ends there (the Z-algorithm
        // backwards, capped at rep_limit, in llama.cpp's form)
        let mut count = vec![0usize; n];
        let last = n - 1;
        let (mut lt, mut rt) = (0usize, 0usize);
        for k in 1..n {
            if k > rt {
                let mut m = 0;
                while m + k < n && at(m) == at(m + k) {
                    m += 1;
                }
                count[last - k] = m.min(rep_limit);
                if m > 0 {
                    (lt, rt) = (k, k + m - 1);
                }
            } else {
                let pair = k - lt;
                let right = rt - k + 1;
                if count[last - pair] < right {
                    count[last - k] = count[last - pair].min(rep_limit);
                } else {
                    let mut i = rt + 1;
                    while i < n && at(i) == at(i - k) {
                        i += 1;
                    }
                    count[last - k] = (i - k).min(rep_limit);
                    (lt, rt) = (k, i - 1);
                }
            }
        }
        // 3: the token after each repeat would extend it
        let mut longest: HashMap<u32, usize> = HashMap::new();
        for (i, &len) in count.iter().enumerate().take(n - 1) {
            if len >= allowed {
                let e = longest.entry(at(n - 2 - i)).or_default();
                *e = (*e).max(len);
            }
        }
        // 4: the penalties, the exponent clamped below f32's overflow (llama.cpp's arithmetic)
        let max_exponent = if p.dry_base > 1.000001 { (88.722_84f32 / p.dry_base.ln()) as usize } else { 0 };
        for (&t, &len) in &longest {
            let single_breaker = d.breakers.heads.get(&t).is_some_and(|tails| tails.iter().any(Vec::is_empty));
            let Some(l) = logits.get_mut(t as usize).filter(|_| !single_breaker) else { continue };
            let mut exp = len - allowed;
            if max_exponent > 0 && exp > max_exponent {
                exp = max_exponent;
            }
            *l -= (f64::from(p.dry_multiplier) * f64::from(p.dry_base).powf(exp as f64)) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DRY subtracts what llama.cpp's subtracts after the same tokens, its sequence breakers
    /// processed against two of llama.cpp's vocabularies (BPE and SentencePiece) by tandem
    /// (scripts/gen_dry_fixtures.py).
    #[test]
    fn dry_penalizes_as_llama_cpps() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures");
        let f: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/sampling/llama_cpp_dry.json")).unwrap())
                .unwrap();
        let mut vocabs: HashMap<String, Tokenizer> = HashMap::new();
        let cases = f["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 70);
        let mut penalized = 0;
        for c in cases {
            let name = c["vocab"].as_str().unwrap();
            let tok = vocabs.entry(name.to_string()).or_insert_with(|| {
                let path = format!("{dir}/tokenizer/llama-cpp-vocab/{name}");
                let gguf = tandem_model::GgufModel::open(path, Default::default()).unwrap();
                Tokenizer::from_gguf(&gguf).unwrap()
            });
            let strings = |k: &str| -> Vec<String> {
                c[k].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
            };
            let p = SamplingParams {
                dry_multiplier: c["multiplier"].as_f64().unwrap() as f32,
                dry_base: c["base"].as_f64().unwrap() as f32,
                dry_allowed_length: c["allowed_length"].as_u64().unwrap() as u32,
                dry_penalty_last_n: c["penalty_last_n"].as_u64().unwrap() as u32,
                dry_sequence_breakers: strings("breakers"),
                ..SamplingParams::default()
            };
            let mut d = Dry::default();
            d.set_breakers(Arc::new(DryBreakers::new(tok, &p.dry_sequence_breakers).unwrap()));
            for t in c["history"].as_array().unwrap() {
                d.accept(t.as_u64().unwrap() as u32, p.dry_penalty_last_n as usize);
            }
            let mut logits = vec![0f32; tok.n_vocab()];
            d.apply(&p, &mut logits);
            let got: HashMap<u32, f32> =
                logits.iter().enumerate().filter(|(_, &l)| l != 0.0).map(|(i, &l)| (i as u32, l)).collect();
            let want: HashMap<u32, f32> = c["logits"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.parse().unwrap(), v.as_f64().unwrap() as f32))
                .collect();
            assert_eq!(got, want, "{name} {} {:?}", c["breakers"], c["history"]);
            penalized += want.len();
        }
        assert!(penalized > 100, "the fixture penalizes too little to test: {penalized}");
    }
}
