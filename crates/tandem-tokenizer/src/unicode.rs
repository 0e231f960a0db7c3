//! Code point classification and GPT-2's byte <-> character mapping, as llama.cpp's
//! src/unicode.cpp does them (the category table is llama.cpp's own, see `unicode_data`).

use crate::unicode_data::RANGES;
use std::sync::OnceLock;

pub(crate) const UNDEFINED: u8 = 0x01;
pub(crate) const NUMBER: u8 = 0x02; // \p{N}
pub(crate) const LETTER: u8 = 0x04; // \p{L}
#[allow(dead_code)] // listed for completeness: llama.cpp's flag layout
pub(crate) const SEPARATOR: u8 = 0x08; // \p{Z}
pub(crate) const ACCENT_MARK: u8 = 0x10; // \p{M}
pub(crate) const PUNCTUATION: u8 = 0x20; // \p{P}
pub(crate) const SYMBOL: u8 = 0x40; // \p{S}
#[allow(dead_code)]
pub(crate) const CONTROL: u8 = 0x80; // \p{C}

/// What llama.cpp calls whitespace (`unicode_set_whitespace`): Unicode White_Space.
const WHITESPACE: [u32; 25] = [
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006,
    0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
];

/// llama.cpp's `unicode_cpt_flags`: one general category plus the whitespace bit. The default
/// (all clear) is what llama.cpp returns for positions outside the text being split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags {
    pub category: u8,
    pub whitespace: bool,
}

impl Flags {
    pub fn of(cpt: u32) -> Flags {
        if cpt >= 0x110000 {
            return Flags { category: UNDEFINED, whitespace: false };
        }
        let i = RANGES.partition_point(|&(start, _)| start <= cpt) - 1;
        Flags { category: RANGES[i].1, whitespace: WHITESPACE.binary_search(&cpt).is_ok() }
    }
    pub fn is_number(self) -> bool {
        self.category & NUMBER != 0
    }
    pub fn is_letter(self) -> bool {
        self.category & LETTER != 0
    }
    pub fn is_whitespace(self) -> bool {
        self.whitespace
    }
    /// llama.cpp's `as_uint() != 0`: false only outside the text.
    pub fn any(self) -> bool {
        self.category != 0 || self.whitespace
    }
}

/// llama.cpp's `unicode_cpt_is_han` (the Kimi-K2 pre-tokenizer's `\p{Han}`).
pub(crate) fn is_han(cpt: u32) -> bool {
    matches!(cpt,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F | 0x2B740..=0x2B81F
        | 0x2B820..=0x2CEAF | 0x2CEB0..=0x2EBEF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

/// llama.cpp lowercases one code point before comparing it with `s t m d r e v l` (contractions);
/// its table maps no non-ASCII code point to one of those letters, so ASCII lowercasing is exact.
pub(crate) fn to_lower(cpt: u32) -> u32 {
    if (b'A' as u32..=b'Z' as u32).contains(&cpt) {
        cpt + 32
    } else {
        cpt
    }
}

struct ByteMap {
    to_char: [char; 256],
    /// Index = code point; `u16::MAX` = not a byte character. Covers U+0000..U+0143.
    to_byte: Vec<u16>,
}

fn byte_map() -> &'static ByteMap {
    static MAP: OnceLock<ByteMap> = OnceLock::new();
    MAP.get_or_init(|| {
        // GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to U+0100 + n
        let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let mut to_char = ['\0'; 256];
        let mut to_byte = vec![u16::MAX; 0x144];
        let mut n = 0;
        for b in 0..256u32 {
            let c = if printable(b) {
                b
            } else {
                n += 1;
                255 + n
            };
            to_char[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
            to_byte[c as usize] = b as u16;
        }
        ByteMap { to_char, to_byte }
    })
}

/// The character GPT-2's byte-level BPE writes for `byte`.
pub(crate) fn byte_to_char(byte: u8) -> char {
    byte_map().to_char[byte as usize]
}

/// The byte a GPT-2 byte character stands for.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    byte_map().to_byte.get(c as usize).and_then(|&b| u8::try_from(b).ok())
}

/// Byte-encodes a word the way llama.cpp's `unicode_byte_encoding_process` does.
pub(crate) fn byte_encode(word: &str) -> String {
    word.bytes().map(byte_to_char).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_mapping_round_trips() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(char_to_byte('中'), None);
    }

    #[test]
    fn categories_follow_llama_cpp() {
        assert!(Flags::of('a' as u32).is_letter());
        assert!(Flags::of('7' as u32).is_number());
        assert!(Flags::of(' ' as u32).is_whitespace());
        assert_eq!(Flags::of(' ' as u32).category, SEPARATOR);
        assert_eq!(Flags::of('!' as u32).category, PUNCTUATION);
        assert_eq!(Flags::of('+' as u32).category, SYMBOL);
        assert_eq!(Flags::of(0x0301).category, ACCENT_MARK);
        assert_eq!(Flags::of(0).category, CONTROL);
        assert!(Flags::of(0x3000).is_whitespace());
        assert!(is_han('中' as u32) && !is_han('か' as u32));
    }
}
