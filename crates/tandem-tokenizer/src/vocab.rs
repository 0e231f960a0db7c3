//! The vocabulary from GGUF metadata (`tokenizer.ggml.*`), read as llama.cpp's
//! `llama_vocab::impl::load` reads it: token texts, types, scores, merges, special ids, the
//! add-BOS/EOS flags, the end-of-generation set and the text-based special-token fixes.

use crate::pretokenize::{supported_pre_tokenizers, PreTokenizer};
use crate::{Error, Result};
use std::collections::{BTreeSet, HashMap};
use tandem_gguf::{Array, Metadata, Value};

/// A setter of one special id, for tables of metadata keys and detected texts.
type Field = fn(&mut SpecialIds) -> &mut Option<u32>;

/// Token attributes (llama.cpp's `llama_token_attr` bits).
pub mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
}

/// Which algorithm turns words into tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabKind {
    /// Byte-level BPE with merges (`tokenizer.ggml.model = gpt2`).
    Bpe,
    /// SentencePiece BPE over scores, with `<0xXX>` byte fallback (`tokenizer.ggml.model = llama`).
    Spm,
}

/// Special token ids; `None` = the vocabulary has none.
#[derive(Clone, Debug, Default)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub mask: Option<u32>,
    pub fim_pre: Option<u32>,
    pub fim_suf: Option<u32>,
    pub fim_mid: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

pub(crate) struct Vocab {
    pub path: String,
    pub kind: VocabKind,
    pub texts: Vec<String>,
    pub attrs: Vec<u32>,
    pub scores: Vec<f32>,
    pub token_to_id: HashMap<String, u32>,
    /// `"left right"` -> rank (first occurrence wins, as in llama.cpp).
    pub merges: HashMap<String, u32>,
    pub pre: Option<PreTokenizer>,
    pub special: SpecialIds,
    pub eog: BTreeSet<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// Control, user-defined and unknown tokens, longest text first: matched in raw text.
    pub special_cache: Vec<u32>,
}

/// Texts llama.cpp recognises as end-of-turn, EOM and fill-in-the-middle tokens.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const FIM_PRE: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP: &[&str] = &["<|file_sep|>"];
/// Texts that always end generation (llama.cpp's EOG list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

fn int_array(meta: &Metadata, key: &str) -> Result<Option<Vec<i64>>> {
    let Some(v) = meta.get(key) else { return Ok(None) };
    let bad = || Error::BadVocab { path: meta.path().to_string(), msg: format!("{key} must be an integer array") };
    let Value::Array(a) = v else { return Err(bad()) };
    Ok(Some(match a {
        Array::I32(v) => v.iter().map(|&x| x as i64).collect(),
        Array::U32(v) => v.iter().map(|&x| x as i64).collect(),
        Array::I8(v) => v.iter().map(|&x| x as i64).collect(),
        Array::U8(v) => v.iter().map(|&x| x as i64).collect(),
        _ => return Err(bad()),
    }))
}

impl Vocab {
    pub fn load(meta: &Metadata) -> Result<Vocab> {
        let path = meta.path().to_string();
        let bad = |msg: String| Error::BadVocab { path: path.clone(), msg };
        let model = meta.get_str("tokenizer.ggml.model")?;
        let pre_name = meta.opt_str("tokenizer.ggml.pre")?.unwrap_or("");
        let kind = match model {
            "gpt2" => VocabKind::Bpe,
            "llama" => VocabKind::Spm,
            _ => return Err(Error::UnknownModel { path, model: model.to_string() }),
        };
        let raw = meta.get_str_array("tokenizer.ggml.tokens")?;
        if raw.is_empty() {
            return Err(bad("tokenizer.ggml.tokens is empty".into()));
        }
        let n = raw.len();
        let texts: Vec<String> = raw
            .iter()
            .enumerate()
            .map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { t.clone() })
            .collect();
        let scores: Vec<f32> = match meta.get("tokenizer.ggml.scores") {
            None => vec![0.0; n],
            Some(Value::Array(Array::F32(v))) => v.clone(),
            Some(Value::Array(Array::I32(v))) => v.iter().map(|&x| x as f32).collect(),
            Some(_) => return Err(bad("tokenizer.ggml.scores must be an f32 or i32 array".into())),
        };
        if scores.len() < n {
            return Err(bad(format!("{} scores for {n} tokens", scores.len())));
        }
        let mut attrs = vec![attr::NORMAL; n];
        if let Some(types) = int_array(meta, "tokenizer.ggml.token_type")? {
            if types.len() < n {
                return Err(bad(format!("{} token types for {n} tokens", types.len())));
            }
            for (a, &t) in attrs.iter_mut().zip(&types) {
                *a = match t {
                    1 => attr::NORMAL,
                    2 => attr::UNKNOWN,
                    3 => attr::CONTROL,
                    4 => attr::USER_DEFINED,
                    5 => attr::UNUSED,
                    6 => attr::BYTE,
                    _ => 0,
                };
            }
        }
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in texts.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32); // a later duplicate wins, as in llama.cpp
        }

        let mut merges = HashMap::new();
        let (pre, mut special, mut add_bos, mut add_space_prefix) = match kind {
            VocabKind::Bpe => {
                let pre = match PreTokenizer::by_name(pre_name) {
                    Some(p) => p?,
                    None => {
                        let supported = supported_pre_tokenizers().join(", ");
                        return Err(Error::UnknownPre { path, pre: pre_name.to_string(), supported });
                    }
                };
                match meta.get("tokenizer.ggml.merges") {
                    Some(_) => {
                        for (i, m) in meta.get_str_array("tokenizer.ggml.merges")?.iter().enumerate() {
                            // llama.cpp splits at the first space after the first byte
                            let first_len = m.chars().next().map_or(0, char::len_utf8);
                            let key = match m[first_len..].find(' ') {
                                Some(p) => format!("{} {}", &m[..first_len + p], &m[first_len + p + 1..]),
                                None => " ".to_string(),
                            };
                            merges.entry(key).or_insert(i as u32);
                        }
                    }
                    None if pre_name == "kimi-k2" => {}
                    None => return Err(bad("tokenizer.ggml.merges is missing (a gpt2 tokenizer needs it)".into())),
                }
                // llama.cpp's BPE defaults: BOS = EOS = 11
                let sp = SpecialIds { bos: Some(11), eos: Some(11), ..SpecialIds::default() };
                let add_bos = pre.add_bos.unwrap_or(false);
                (Some(pre), sp, add_bos, false)
            }
            VocabKind::Spm => {
                (None, SpecialIds { bos: Some(1), eos: Some(2), unk: Some(0), ..SpecialIds::default() }, true, true)
            }
        };
        if let Some(v) = meta.opt_bool("tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }

        // special ids from metadata; out-of-range defaults are dropped, out-of-range values ignored
        let keys: [(&str, Field); 17] = [
            ("bos_token_id", |s| &mut s.bos),
            ("eos_token_id", |s| &mut s.eos),
            ("eot_token_id", |s| &mut s.eot),
            ("eom_token_id", |s| &mut s.eom),
            ("unknown_token_id", |s| &mut s.unk),
            ("seperator_token_id", |s| &mut s.sep),
            ("padding_token_id", |s| &mut s.pad),
            ("mask_token_id", |s| &mut s.mask),
            ("fim_pre_token_id", |s| &mut s.fim_pre),
            ("fim_suf_token_id", |s| &mut s.fim_suf),
            ("fim_mid_token_id", |s| &mut s.fim_mid),
            ("fim_pad_token_id", |s| &mut s.fim_pad),
            ("fim_rep_token_id", |s| &mut s.fim_rep),
            ("fim_sep_token_id", |s| &mut s.fim_sep),
            ("prefix_token_id", |s| &mut s.fim_pre),
            ("suffix_token_id", |s| &mut s.fim_suf),
            ("middle_token_id", |s| &mut s.fim_mid),
        ];
        for (key, field) in keys {
            let slot = field(&mut special);
            if slot.is_some_and(|id| id as usize >= n) {
                *slot = None;
            }
            let full = format!("tokenizer.ggml.{key}");
            if let Some(v) = meta.get(&full) {
                match v.as_i128().and_then(|i| u32::try_from(i).ok()) {
                    Some(id) if (id as usize) < n => *slot = Some(id),
                    Some(_) => {}
                    None => return Err(bad(format!("{full} must be a non-negative integer"))),
                }
            }
        }
        if let Some(v) = meta.opt_bool("tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        let add_eos = meta.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);

        let mut v = Vocab {
            path,
            kind,
            texts,
            attrs,
            scores,
            token_to_id,
            merges,
            pre,
            special,
            eog: BTreeSet::new(),
            add_bos,
            add_eos,
            add_space_prefix,
            special_cache: Vec::new(),
        };
        v.detect_specials();
        if v.add_bos && v.special.bos.is_none() {
            return Err(Error::BadVocab {
                path: v.path.clone(),
                msg: "add_bos_token is set but there is no BOS token".into(),
            });
        }
        if v.add_eos && v.special.eos.is_none() {
            return Err(Error::BadVocab {
                path: v.path.clone(),
                msg: "add_eos_token is set but there is no EOS token".into(),
            });
        }
        let mut cache: Vec<u32> = (0..n as u32)
            .filter(|&i| v.attrs[i as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
            .collect();
        cache.sort_by_key(|&i| std::cmp::Reverse(v.texts[i as usize].len()));
        v.special_cache = cache;
        Ok(v)
    }

    /// The lowest id whose text is one of `texts` (llama.cpp takes the first one its hash map
    /// yields; with one candidate per vocabulary, as in real models, that is the same token).
    fn find_text(&self, texts: &[&str]) -> Option<u32> {
        texts.iter().filter_map(|t| self.token_to_id.get(*t).copied()).min()
    }

    /// llama.cpp's text-based detection of EOT / FIM tokens, forced CONTROL, "unused" tokens and
    /// the end-of-generation set.
    fn detect_specials(&mut self) {
        let groups: [(&[&str], Field); 8] = [
            (EOT_TEXTS, |s| &mut s.eot),
            (&["<|eom_id|>"], |s| &mut s.eom),
            (FIM_PRE, |s| &mut s.fim_pre),
            (FIM_SUF, |s| &mut s.fim_suf),
            (FIM_MID, |s| &mut s.fim_mid),
            (FIM_PAD, |s| &mut s.fim_pad),
            (FIM_REP, |s| &mut s.fim_rep),
            (FIM_SEP, |s| &mut s.fim_sep),
        ];
        for (texts, field) in groups {
            if field(&mut self.special).is_none() {
                if let Some(id) = self.find_text(texts) {
                    *field(&mut self.special) = Some(id);
                    self.attrs[id as usize] |= attr::CONTROL;
                }
            }
        }
        for (a, t) in self.attrs.iter_mut().zip(&self.texts) {
            if *a & attr::CONTROL != 0 && t.contains("unused") {
                *a |= attr::UNUSED;
            }
        }
        let s = &self.special;
        self.eog.extend([s.fim_pad, s.fim_rep, s.fim_sep].into_iter().flatten());
        for t in EOG_TEXTS {
            if let Some(&id) = self.token_to_id.get(*t) {
                self.eog.insert(id);
                self.attrs[id as usize] |= attr::CONTROL;
            }
        }
        let s = &self.special;
        self.eog.extend([s.eos, s.eot, s.eom].into_iter().flatten());
        // o200k_harmony / solar-open: "<|end|>" is not the end when "<|return|>" + "<|call|>" exist
        let has = |v: &Vocab, t: &str| v.token_to_id.get(t).is_some_and(|id| v.eog.contains(id));
        let end_is_not_eog = has(self, "<|return|>") && has(self, "<|call|>")
            || (has(self, "<|call|>") || has(self, "<|calls|>")) && has(self, "<|flush|>");
        if has(self, "<|end|>") && end_is_not_eog {
            let id = self.token_to_id["<|end|>"];
            self.eog.remove(&id);
            self.attrs[id as usize] = attr::USER_DEFINED;
        }
        if has(self, "</s>") && (has(self, "<|tool_response>") || has(self, "<|plamo:eos|>")) {
            let id = self.token_to_id["</s>"];
            self.eog.remove(&id);
            self.attrs[id as usize] = attr::NORMAL;
        }
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = self.token_to_id.get(t) {
                self.attrs[id as usize] = attr::USER_DEFINED;
            }
        }
    }

    pub fn n_tokens(&self) -> usize {
        self.texts.len()
    }

    pub fn text_to_token(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The rank of merging `left` and `right`.
    pub fn merge_rank(&self, key_buf: &mut String, left: &str, right: &str) -> Option<u32> {
        key_buf.clear();
        key_buf.push_str(left);
        key_buf.push(' ');
        key_buf.push_str(right);
        self.merges.get(key_buf.as_str()).copied()
    }

    /// SentencePiece byte fallback: `<0xXX>`, else the byte as a one-character token.
    pub fn byte_to_token(&self, b: u8) -> Option<u32> {
        self.text_to_token(&format!("<0x{b:02X}>")).or_else(|| {
            if b < 0x80 {
                self.text_to_token(&(b as char).to_string())
            } else {
                None
            }
        })
    }
}
