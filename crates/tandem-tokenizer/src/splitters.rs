//! Hand-written pre-tokenizer splitters, ported line by line from llama.cpp's src/unicode.cpp
//! (`unicode_regex_split_custom_*`). llama.cpp uses these instead of its regex engine for the
//! patterns below, and their behaviour is what every llama.cpp tokenization is measured against,
//! including where it differs from the original regex.
//!
//! Each takes the text's code points and flags and the current split (lengths in code points)
//! and returns the finer split.

use crate::unicode::{is_han, to_lower, Flags};

/// `_get_cpt` beyond the segment.
const OUT_OF_RANGE: u32 = 0xFFFF_FFFF;

/// One segment of the current split, with llama.cpp's `_get_cpt` / `_get_flags` / `_add_token`.
struct Seg<'a> {
    cpts: &'a [u32],
    flags: &'a [Flags],
    ini: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<usize>,
}

impl Seg<'_> {
    fn cpt(&self, pos: usize) -> u32 {
        if self.ini <= pos && pos < self.end {
            self.cpts[pos]
        } else {
            OUT_OF_RANGE
        }
    }
    fn flags(&self, pos: usize) -> Flags {
        if self.ini <= pos && pos < self.end {
            self.flags[pos]
        } else {
            Flags::default()
        }
    }
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `pos` (case-insensitive unless `exact_case`): its length.
    fn contraction(&self, pos: usize, exact_case: bool) -> usize {
        if self.cpt(pos) != '\'' as u32 || pos + 1 >= self.end {
            return 0;
        }
        let low = |c: u32| if exact_case { c } else { to_lower(c) };
        let next = low(self.cpt(pos + 1));
        if [b's', b't', b'm', b'd'].iter().any(|&c| next == c as u32) {
            return 2;
        }
        if pos + 2 < self.end {
            let next2 = low(self.cpt(pos + 2));
            let is = |a: u8, b: u8| next == a as u32 && next2 == b as u32;
            if is(b'r', b'e') || is(b'v', b'e') || is(b'l', b'l') {
                return 3;
            }
        }
        0
    }

    /// The shared tail of the llama3 / qwen2 / kimi splitters: `\s*[\r\n]+|\s+(?!\S)|\s+`, else one
    /// code point. Returns the new position.
    fn whitespace_tail(&mut self, pos: usize) -> usize {
        let mut n_ws = 0;
        let mut last_end_r_or_n = 0;
        while self.flags(pos + n_ws).is_whitespace() {
            let c = self.cpt(pos + n_ws);
            if c == '\r' as u32 || c == '\n' as u32 {
                last_end_r_or_n = pos + n_ws + 1;
            }
            n_ws += 1;
        }
        let end = if last_end_r_or_n > 0 { last_end_r_or_n } else { self.spaces_end(pos, n_ws) };
        self.add(end);
        end
    }

    /// Where a run of `n_ws` whitespace code points at `pos` ends as `\s+(?!\S)|\s+` takes it
    /// (before its last one when more follows), else one code point.
    fn spaces_end(&self, pos: usize, n_ws: usize) -> usize {
        if n_ws > 1 && self.cpt(pos + n_ws) != OUT_OF_RANGE {
            pos + n_ws - 1
        } else if n_ws > 0 {
            pos + n_ws
        } else {
            pos + 1
        }
    }

    /// ` ?[^\s\p{L}\p{N}]+[\r\n]*` (llama3 / qwen2 / kimi) if it matches at `pos`. llama.cpp's ports
    /// differ in whether the first test looks at the code point's own flags or the one after the
    /// space; `first_own` = the former.
    fn punct_run(&mut self, pos: usize, first_own: bool) -> Option<usize> {
        let cpt = self.cpt(pos);
        let flags = self.flags(pos);
        let mut f2 = if cpt == ' ' as u32 { self.flags(pos + 1) } else { flags };
        let gate = if first_own { flags.any() } else { f2.any() };
        if f2.is_whitespace() || f2.is_letter() || f2.is_number() || !gate {
            return None;
        }
        let mut pos = pos + usize::from(cpt == ' ' as u32);
        while !(f2.is_whitespace() || f2.is_letter() || f2.is_number()) && f2.any() {
            pos += 1;
            f2 = self.flags(pos);
        }
        let mut c2 = self.cpt(pos);
        while c2 == '\r' as u32 || c2 == '\n' as u32 {
            pos += 1;
            c2 = self.cpt(pos);
        }
        self.add(pos);
        Some(pos)
    }

    /// `\p{N}{1,3}` at `pos` (a number): groups of three.
    fn digits_by_three(&mut self, mut pos: usize) -> usize {
        let mut ini = pos;
        while self.flags(pos).is_number() {
            pos += 1;
            if pos - ini >= 3 {
                self.add(pos);
                ini = pos;
            }
        }
        self.add(pos);
        pos
    }
}

/// Runs `body` over every segment of `offsets`.
fn for_segments(cpts: &[u32], flags: &[Flags], offsets: &[usize], mut body: impl FnMut(&mut Seg)) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let mut seg = Seg { cpts, flags, ini: start, end: start + len, prev_end: start, out: &mut out };
        body(&mut seg);
        start += len;
    }
    out
}

/// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
pub(crate) fn gpt2(cpts: &[u32], flags: &[Flags], offsets: &[usize]) -> Vec<usize> {
    for_segments(cpts, flags, offsets, |s| {
        let mut pos = s.ini;
        while pos < s.end {
            let cpt = s.cpt(pos);
            let n = s.contraction(pos, true);
            if n > 0 {
                pos += s.add(pos + n);
                continue;
            }
            let space = cpt == ' ' as u32;
            let mut f2 = if space { s.flags(pos + 1) } else { s.flags(pos) };
            type Test = fn(Flags) -> bool;
            let runs: [Test; 3] = [
                |f| f.is_letter(),
                |f| f.is_number(),
                |f| !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.any(),
            ];
            if let Some(test) = runs.iter().find(|t| t(f2)) {
                pos += usize::from(space);
                while test(f2) {
                    pos += 1;
                    f2 = s.flags(pos);
                }
                s.add(pos);
                continue;
            }
            let mut n_ws = 0;
            while s.flags(pos + n_ws).is_whitespace() {
                n_ws += 1;
            }
            pos = s.spaces_end(pos, n_ws);
            s.add(pos);
        }
    })
}

/// Llama 3: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
/// with `single_digits`, Qwen2's variant (`\p{N}` instead of `\p{N}{1,3}`).
pub(crate) fn llama3(cpts: &[u32], flags: &[Flags], offsets: &[usize], single_digits: bool) -> Vec<usize> {
    for_segments(cpts, flags, offsets, |s| {
        let mut pos = s.ini;
        while pos < s.end {
            let cpt = s.cpt(pos);
            let f = s.flags(pos);
            let n = s.contraction(pos, false);
            if n > 0 {
                pos += s.add(pos + n);
                continue;
            }
            if !(cpt == '\r' as u32 || cpt == '\n' as u32 || f.is_number())
                && (f.is_letter() || s.flags(pos + 1).is_letter())
            {
                pos += 1;
                while s.flags(pos).is_letter() {
                    pos += 1;
                }
                s.add(pos);
                continue;
            }
            if f.is_number() {
                pos = if single_digits { pos + s.add(pos + 1) } else { s.digits_by_three(pos) };
                continue;
            }
            if let Some(p) = s.punct_run(pos, true) {
                pos = p;
                continue;
            }
            pos = s.whitespace_tail(pos);
        }
    })
}

/// Kimi K2 (tokenization_kimi.py): `[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|...|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
pub(crate) fn kimi_k2(cpts: &[u32], flags: &[Flags], offsets: &[usize]) -> Vec<usize> {
    for_segments(cpts, flags, offsets, |s| {
        let mut pos = s.ini;
        let letter = |s: &Seg, p: usize| s.flags(p).is_letter() && !is_han(s.cpt(p));
        while pos < s.end {
            let cpt = s.cpt(pos);
            let f = s.flags(pos);
            if is_han(cpt) {
                while is_han(s.cpt(pos)) {
                    pos += 1;
                }
                s.add(pos);
                continue;
            }
            let can_lead = !(cpt == '\r' as u32 || cpt == '\n' as u32 || f.is_letter() || f.is_number());
            if (f.is_letter() && !is_han(cpt)) || (can_lead && letter(s, pos + 1)) {
                if can_lead {
                    pos += 1;
                }
                // the leading character is followed by a letter here, so letters always follow
                while letter(s, pos) {
                    pos += 1;
                }
                if s.cpt(pos) == '\'' as u32 && pos + 1 < s.end {
                    pos += s.contraction(pos, false);
                }
                s.add(pos);
                continue;
            }
            if f.is_number() {
                pos = s.digits_by_three(pos);
                continue;
            }
            if let Some(p) = s.punct_run(pos, false) {
                pos = p;
                continue;
            }
            pos = s.whitespace_tail(pos);
        }
    })
}
