//! The two merge algorithms, as llama.cpp runs them (src/llama-vocab.cpp):
//! byte-level BPE (`llm_tokenizer_bpe_session`: merges by rank inside each pre-tokenized word)
//! and SentencePiece BPE (`llm_tokenizer_spm_session`: merges by token score, byte fallback).

use crate::unicode::byte_encode;
use crate::vocab::Vocab;
use crate::{Error, Result};
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A piece of the word being merged: a byte range of it, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

/// Splits `word` into one symbol per character.
fn symbols_of(word: &str) -> Vec<Symbol> {
    let n = word.chars().count();
    word.char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol {
            prev: i.checked_sub(1),
            next: (i + 1 < n).then_some(i + 1),
            start,
            len: c.len_utf8(),
        })
        .collect()
}

/// Merges `right` into `left` and unlinks it.
fn merge(symbols: &mut [Symbol], left: usize, right: usize) {
    symbols[left].len += symbols[right].len;
    symbols[right].len = 0;
    symbols[left].next = symbols[right].next;
    if let Some(n) = symbols[right].next {
        symbols[n].prev = Some(left);
    }
}

/// A candidate BPE merge; the heap pops the lowest rank, then the leftmost.
#[derive(PartialEq, Eq)]
struct BpeBigram {
    rank: u32,
    left: usize,
    right: usize,
    text: String,
}

impl Ord for BpeBigram {
    fn cmp(&self, o: &Self) -> Ordering {
        o.rank.cmp(&self.rank).then(o.left.cmp(&self.left))
    }
}

impl PartialOrd for BpeBigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// Byte-level BPE of the words of one text fragment, appended to `out`.
pub(crate) fn bpe(vocab: &Vocab, words: &[&str], ignore_merges: bool, out: &mut Vec<u32>) {
    let mut key = String::new();
    for raw in words {
        let word = byte_encode(raw);
        if ignore_merges {
            if let Some(id) = vocab.text_to_token(&word) {
                out.push(id);
                continue;
            }
        }
        let mut sym = symbols_of(&word);
        let mut queue = BinaryHeap::new();
        let mut add = |sym: &[Symbol], queue: &mut BinaryHeap<BpeBigram>, l: Option<usize>, r: Option<usize>| {
            let (Some(l), Some(r)) = (l, r) else { return };
            let (a, b) = (sym[l], sym[r]);
            let (lt, rt) = (&word[a.start..a.start + a.len], &word[b.start..b.start + b.len]);
            if let Some(rank) = vocab.merge_rank(&mut key, lt, rt) {
                queue.push(BpeBigram { rank, left: l, right: r, text: format!("{lt}{rt}") });
            }
        };
        for i in 1..sym.len() {
            add(&sym, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(bg) = queue.pop() {
            let (l, r) = (sym[bg.left], sym[bg.right]);
            if l.len == 0 || r.len == 0 {
                continue;
            }
            // skip outdated bigrams: either side has changed since it was queued
            if l.len + r.len != bg.text.len()
                || word[l.start..l.start + l.len + r.len] != bg.text
                || l.next != Some(bg.right)
            {
                continue;
            }
            merge(&mut sym, bg.left, bg.right);
            let (prev, next) = (sym[bg.left].prev, sym[bg.left].next);
            add(&sym, &mut queue, prev, Some(bg.left));
            add(&sym, &mut queue, Some(bg.left), next);
        }
        for s in sym.iter().filter(|s| s.len > 0) {
            let text = &word[s.start..s.start + s.len];
            match vocab.text_to_token(text) {
                Some(id) => out.push(id),
                // llama.cpp looks up every byte of the (byte-encoded) symbol as a one-byte
                // string: only ASCII bytes can be tokens that way, the rest are dropped
                None => out.extend(
                    text.bytes().filter(u8::is_ascii).filter_map(|b| vocab.text_to_token(&(b as char).to_string())),
                ),
            }
        }
    }
}

/// A candidate SentencePiece merge; the heap pops the highest score, then the leftmost.
struct SpmBigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for SpmBigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for SpmBigram {}

impl Ord for SpmBigram {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

impl PartialOrd for SpmBigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// SentencePiece BPE of one (already whitespace-escaped) text fragment, appended to `out`.
pub(crate) fn spm(vocab: &Vocab, text: &str, out: &mut Vec<u32>) -> Result<()> {
    let mut sym = symbols_of(text);
    let mut queue = BinaryHeap::new();
    let add = |sym: &[Symbol], queue: &mut BinaryHeap<SpmBigram>, l: Option<usize>, r: Option<usize>| {
        let (Some(l), Some(r)) = (l, r) else { return };
        let size = sym[l].len + sym[r].len;
        let piece = &text[sym[l].start..sym[l].start + size];
        if let Some(id) = vocab.text_to_token(piece) {
            queue.push(SpmBigram { score: vocab.scores[id as usize], left: l, right: r, size });
        }
    };
    for i in 1..sym.len() {
        add(&sym, &mut queue, Some(i - 1), Some(i));
    }
    while let Some(bg) = queue.pop() {
        let (l, r) = (sym[bg.left], sym[bg.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
            continue;
        }
        merge(&mut sym, bg.left, bg.right);
        let (prev, next) = (sym[bg.left].prev, sym[bg.left].next);
        add(&sym, &mut queue, prev, Some(bg.left));
        add(&sym, &mut queue, Some(bg.left), next);
    }
    // walk the chain; a merged symbol is always a token (it was queued because it is one), so
    // llama.cpp's `resegment` reduces to: the token, or its bytes
    let mut i = if sym.is_empty() { None } else { Some(0) };
    while let Some(k) = i {
        let s = sym[k];
        let piece = &text[s.start..s.start + s.len];
        match vocab.text_to_token(piece) {
            Some(id) => out.push(id),
            None => {
                for b in piece.bytes() {
                    out.push(vocab.byte_to_token(b).or(vocab.special.unk).ok_or(Error::NoByteToken(b))?);
                }
            }
        }
        i = s.next;
    }
    Ok(())
}
