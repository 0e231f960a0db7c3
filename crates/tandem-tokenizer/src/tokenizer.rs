//! Text <-> tokens: llama.cpp's `llama_tokenize` (special-token partition, BOS/EOS, the merge
//! algorithms) and `llama_token_to_piece`, plus a streaming decoder that only ever emits whole
//! UTF-8 characters.

use crate::merge;
use crate::unicode::char_to_byte;
use crate::vocab::{attr, SpecialIds, Vocab, VocabKind};
use crate::{Error, Result};
use tandem_gguf::{GgufModel, Metadata};

/// A GGUF model's tokenizer.
pub struct Tokenizer {
    vocab: Vocab,
    /// `token_to_piece(id, special = true)` for every token (llama.cpp keeps the same cache).
    pieces: Vec<Vec<u8>>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.vocab.kind)
            .field("pre", &self.vocab.pre)
            .field("n_vocab", &self.n_vocab())
            .finish()
    }
}

/// Part of the input: raw text still to tokenize, or a special token found in it.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl Tokenizer {
    /// The tokenizer of a GGUF model (`tokenizer.ggml.*`, `tokenizer.chat_template`).
    pub fn from_gguf(model: &GgufModel) -> Result<Tokenizer> {
        Tokenizer::from_metadata(model.metadata())
    }

    pub fn from_metadata(meta: &Metadata) -> Result<Tokenizer> {
        let vocab = Vocab::load(meta)?;
        let chat_template = meta.opt_str("tokenizer.chat_template")?.map(str::to_string);
        let mut t = Tokenizer { vocab, pieces: Vec::new(), chat_template };
        t.pieces = (0..t.n_vocab() as u32).map(|id| t.piece_uncached(id)).collect();
        Ok(t)
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.n_tokens()
    }

    pub fn kind(&self) -> VocabKind {
        self.vocab.kind
    }

    /// `tokenizer.ggml.pre` as resolved (`None` for SentencePiece).
    pub fn pre_tokenizer(&self) -> Option<&str> {
        self.vocab.pre.as_ref().map(|p| p.name())
    }

    pub fn special_ids(&self) -> &SpecialIds {
        &self.vocab.special
    }

    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether text gets a leading space before tokenizing (SentencePiece); llama.cpp's
    /// detokenizer then drops one leading space of the first piece.
    pub fn add_space_prefix(&self) -> bool {
        self.vocab.add_space_prefix
    }

    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// Whether `id` ends generation (EOS, EOT, EOM and the tokens llama.cpp recognises by text).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// The end-of-generation tokens.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.vocab.eog.iter().copied()
    }

    /// A token's text as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// A token's attribute bits (`vocab::attr`).
    pub fn token_attr(&self, id: u32) -> Option<u32> {
        self.vocab.attrs.get(id as usize).copied()
    }

    /// The id of a token by its exact text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.text_to_token(text)
    }

    /// `tokenizer.chat_template`, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Text of the BOS / EOS tokens, for chat templates (`""` when there is none).
    pub fn bos_text(&self) -> &str {
        self.vocab.special.bos.and_then(|id| self.token_text(id)).unwrap_or("")
    }

    pub fn eos_text(&self) -> &str {
        self.vocab.special.eos.and_then(|id| self.token_text(id)).unwrap_or("")
    }

    /// Tokenizes `text` as llama.cpp's `llama_tokenize(vocab, text, add_special, parse_special)`:
    /// `add_special` adds BOS/EOS as the model asks; `parse_special` turns control-token texts in
    /// `text` (`<|im_start|>`, ...) into those tokens (user-defined tokens always are).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let v = &self.vocab;
        let mut out = Vec::new();
        let fragments = if text.is_empty() { Vec::new() } else { self.partition(text, parse_special) };
        if add_special && v.add_bos {
            out.extend(v.special.bos);
        }
        match v.kind {
            VocabKind::Bpe => {
                let pre = v
                    .pre
                    .as_ref()
                    .ok_or_else(|| Error::BadVocab { path: v.path.clone(), msg: "no pre-tokenizer".into() })?;
                for f in fragments {
                    match f {
                        Fragment::Text(t) => merge::bpe(v, &pre.split(t)?, pre.ignore_merges, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            VocabKind::Spm => {
                let mut prev_special = true; // a space is prefixed to text at the start or after a special
                for f in fragments {
                    match f {
                        Fragment::Text(t) => {
                            let spaced =
                                if v.add_space_prefix && prev_special { format!(" {t}") } else { t.to_string() };
                            merge::spm(v, &spaced.replace(' ', "\u{2581}"), &mut out)?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
        }
        if add_special && v.add_eos {
            out.extend(v.special.eos);
        }
        Ok(out)
    }

    /// llama.cpp's `tokenizer_st_partition`: special tokens, longest first, are cut out of the text.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = vec![Fragment::Text(text)];
        for &id in &self.vocab.special_cache {
            let a = self.vocab.attrs[id as usize];
            if !parse_special && a & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue; // user-defined tokens are cut out even without parse_special
            }
            let special = self.vocab.texts[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Fragment::Text(mut t) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = t.find(special) {
                    if at > 0 {
                        next.push(Fragment::Text(&t[..at]));
                    }
                    next.push(Fragment::Token(id));
                    t = &t[at + special.len()..];
                }
                if !t.is_empty() {
                    next.push(Fragment::Text(t));
                }
            }
            frags = next;
        }
        frags
    }

    /// llama.cpp's `token_to_piece` without the cache.
    fn piece_uncached(&self, id: u32) -> Vec<u8> {
        let v = &self.vocab;
        let (a, text) = (v.attrs[id as usize], v.texts[id as usize].as_str());
        if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if a & attr::NORMAL != 0 {
            return match v.kind {
                VocabKind::Spm => text.replace('\u{2581}', " ").into_bytes(),
                VocabKind::Bpe => decode_byte_chars(text),
            };
        }
        if a & attr::BYTE != 0 {
            // "<0xXX>"
            return text.get(3..5).and_then(|h| u8::from_str_radix(h, 16).ok()).map_or_else(Vec::new, |b| vec![b]);
        }
        Vec::new() // unused / undefined tokens have no text
    }

    /// The bytes of token `id` (possibly part of a UTF-8 character). With `special = false`,
    /// control and unknown tokens give nothing (llama.cpp's `llama_token_to_piece`).
    pub fn token_to_piece(&self, id: u32, special: bool) -> Result<&[u8]> {
        let a = self.vocab.attrs.get(id as usize).ok_or(Error::TokenOutOfRange { id, n_vocab: self.n_vocab() })?;
        if !special && a & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return Ok(&[]);
        }
        Ok(&self.pieces[id as usize])
    }

    /// The text of `ids` (pieces concatenated; invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32], special: bool) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_to_piece(id, special)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// llama.cpp's `llama_decode_text`: GPT-2 byte characters back to bytes; a character that is not
/// one becomes `[UNK_BYTE_0x..<token text>]`, as llama.cpp writes it.
fn decode_byte_chars(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// Turns a stream of token pieces into text, emitting each UTF-8 character once it is complete
/// (a character split across tokens comes out whole, with the token that completes it).
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds a piece; returns the text that is now complete. Invalid bytes become U+FFFD.
    pub fn push(&mut self, piece: &[u8]) -> String {
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        // an incomplete character at the end: wait for the next piece
                        None => {
                            rest = bad;
                            break;
                        }
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Ends the stream: bytes of an unfinished character become U+FFFD.
    pub fn finish(&mut self) -> String {
        let out =
            if self.pending.is_empty() { String::new() } else { String::from_utf8_lossy(&self.pending).into_owned() };
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_decoder_emits_whole_characters() {
        let mut d = StreamDecoder::new();
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(d.push(&euro[..1]), "");
        assert_eq!(d.push(&euro[1..2]), "");
        assert_eq!(d.push(&[euro[2], b'a']), "€a");
        let smile = "🙂".as_bytes();
        assert_eq!(d.push(&[b'x', smile[0], smile[1]]), "x");
        assert_eq!(d.push(&smile[2..]), "🙂");
        assert_eq!(d.push(&[0xFF, b'b']), "\u{FFFD}b");
        assert_eq!(d.push(&smile[..2]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn unknown_byte_characters_are_marked() {
        assert_eq!(decode_byte_chars("Ġa"), b" a");
        assert_eq!(decode_byte_chars("中"), b"[UNK_BYTE_0xe4b8ad\xe4\xb8\xad]".to_vec());
    }
}
