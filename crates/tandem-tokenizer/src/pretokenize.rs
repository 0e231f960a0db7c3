//! Pre-tokenizers: how a BPE vocabulary cuts text into words before merging, chosen by
//! `tokenizer.ggml.pre` exactly as llama.cpp's src/llama-vocab.cpp chooses them.
//!
//! Every pre-tokenizer is a list of steps applied one after another, each splitting the pieces
//! the previous one left (llama.cpp's `unicode_regex_split`). A step is either one of llama.cpp's
//! hand-written splitters (`splitters`) or a regex. For regexes llama.cpp does something
//! particular that tandem reproduces: when the pattern uses `\p{..}` categories, every non-ASCII
//! code point of the text is first "collapsed" to one placeholder character per category (and
//! non-ASCII whitespace to `\v`), the categories in the pattern are rewritten to match those
//! placeholders, and the regex runs on the collapsed text. Without categories the regex runs on
//! the code points with non-ASCII whitespace replaced by `\v`.

use crate::splitters;
use crate::unicode::{self, Flags};
use crate::{Error, Result};

const DEEPSEEK3_CJK: &str = "[一-龥぀-ゟ゠-ヿ]+";
const DEEPSEEK3_WORDS: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
/// llama.cpp's letters of `deepseek-llm` (its regexes spell the Latin, Greek, Cyrillic, ... letter
/// ranges out instead of `\p{L}`).
const DEEPSEEK_LLM_LETTERS: &str = r##"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"##;
const DEEPSEEK_LLM_PUNCT: &str = r##"\s?[!-/:-~！-／：-～‘-‟　-。]+"##;
const DEEPSEEK_CJK: &str = "[一-龥ࠀ-一가-퟿]+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One splitting step.
#[derive(Clone, Copy, Debug)]
enum StepSpec {
    /// GPT-2's `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`.
    Gpt2,
    Llama3,
    Qwen2,
    KimiK2,
    Regex(&'static str),
}

/// A pre-tokenizer family and the vocabulary flags llama.cpp sets with it.
struct Family {
    names: &'static [&'static str],
    steps: &'static [StepSpec],
    /// A word that is itself a token is taken whole, without merging (llama.cpp's `ignore_merges`).
    ignore_merges: bool,
    /// `add_bos` before `tokenizer.ggml.add_bos_token` is read.
    add_bos: Option<bool>,
}

use StepSpec::*;

const FAMILIES: &[Family] = &[
    Family {
        names: &["default"],
        steps: &[Regex(r"[\p{P}\$\+<=>\^~\|]+"), Gpt2, Regex(r"\p{N}+"), Regex("[0-9][0-9][0-9]")],
        ignore_merges: false,
        add_bos: None,
    },
    Family {
        names: &["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        steps: &[Llama3],
        ignore_merges: true,
        add_bos: Some(true),
    },
    Family { names: &["dbrx", "smaug-bpe"], steps: &[Llama3], ignore_merges: false, add_bos: None },
    Family {
        names: &["deepseek-llm"],
        steps: &[
            Regex("[\r\n]"),
            Regex(DEEPSEEK_LLM_LETTERS),
            Regex(DEEPSEEK_LLM_PUNCT),
            Regex(r"\s+$"),
            Regex(DEEPSEEK_CJK),
            Regex(r"\p{N}+"),
        ],
        ignore_merges: false,
        add_bos: None,
    },
    Family {
        names: &["deepseek-coder"],
        steps: &[Regex("[\r\n]"), Regex(r"\s?\p{L}+"), Regex(r"\s?\p{P}+"), Regex(DEEPSEEK_CJK), Regex(r"\p{N}")],
        ignore_merges: false,
        add_bos: None,
    },
    Family {
        names: &["deepseek-v3", "hunyuan-dense", "joyai-llm"],
        steps: &[Regex(r"\p{N}{1,3}"), Regex(DEEPSEEK3_CJK), Regex(DEEPSEEK3_WORDS)],
        ignore_merges: false,
        add_bos: None,
    },
    Family { names: &["kimi-k2"], steps: &[KimiK2], ignore_merges: false, add_bos: None },
    Family {
        names: &["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open"],
        steps: &[Qwen2],
        ignore_merges: false,
        add_bos: None,
    },
    Family {
        names: &["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
        steps: &[Regex(r"\p{N}"), Gpt2],
        ignore_merges: false,
        add_bos: None,
    },
    Family {
        names: &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
        ],
        steps: &[Gpt2],
        ignore_merges: false,
        add_bos: None,
    },
    Family {
        names: &["falcon"],
        steps: &[Regex(r"[\p{P}\$\+<=>\^~\|`]+"), Gpt2, Regex("[0-9][0-9][0-9]")],
        ignore_merges: false,
        add_bos: None,
    },
    Family {
        names: &["gpt-4o", "llama4", "kanana2", "minimax-m2"],
        steps: &[Regex(GPT4O)],
        ignore_merges: false,
        add_bos: None,
    },
];

/// The names `tokenizer.ggml.pre` may have, for messages.
pub fn supported_pre_tokenizers() -> Vec<&'static str> {
    FAMILIES.iter().flat_map(|f| f.names.iter().copied()).collect()
}

enum Step {
    Gpt2,
    Llama3,
    Qwen2,
    KimiK2,
    /// `collapsed`: the regex was rewritten for category-collapsed text.
    Regex {
        re: fancy_regex::Regex,
        collapsed: bool,
    },
}

/// A compiled pre-tokenizer.
pub struct PreTokenizer {
    name: String,
    steps: Vec<Step>,
    pub(crate) ignore_merges: bool,
    pub(crate) add_bos: Option<bool>,
}

impl std::fmt::Debug for PreTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PreTokenizer({})", self.name)
    }
}

impl PreTokenizer {
    /// The pre-tokenizer `tokenizer.ggml.pre` names (`""` = llama.cpp's `default`), or `None`.
    pub fn by_name(name: &str) -> Option<Result<PreTokenizer>> {
        let name = if name.is_empty() { "default" } else { name };
        let fam = FAMILIES.iter().find(|f| f.names.contains(&name))?;
        let steps = fam.steps.iter().map(|s| {
            Ok(match *s {
                StepSpec::Gpt2 => Step::Gpt2,
                StepSpec::Llama3 => Step::Llama3,
                StepSpec::Qwen2 => Step::Qwen2,
                StepSpec::KimiK2 => Step::KimiK2,
                StepSpec::Regex(expr) => compile(expr)?,
            })
        });
        Some(steps.collect::<Result<Vec<_>>>().map(|steps| PreTokenizer {
            name: name.to_string(),
            steps,
            ignore_merges: fam.ignore_merges,
            add_bos: fam.add_bos,
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Splits `text` into words (not yet byte-encoded), as llama.cpp's `unicode_regex_split`.
    pub fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>> {
        let cpts: Vec<u32> = text.chars().map(u32::from).collect();
        let flags: Vec<Flags> = cpts.iter().map(|&c| Flags::of(c)).collect();
        let mut offsets = vec![cpts.len()];
        let mut collapsed: Option<Vec<char>> = None;
        let mut plain: Option<Vec<char>> = None;
        for step in &self.steps {
            offsets = match step {
                Step::Gpt2 => splitters::gpt2(&cpts, &flags, &offsets),
                Step::Llama3 => splitters::llama3(&cpts, &flags, &offsets, false),
                Step::Qwen2 => splitters::llama3(&cpts, &flags, &offsets, true),
                Step::KimiK2 => splitters::kimi_k2(&cpts, &flags, &offsets),
                Step::Regex { re, collapsed: true } => {
                    regex_split(re, collapsed.get_or_insert_with(|| collapse(&cpts, &flags)), &offsets)?
                }
                Step::Regex { re, collapsed: false } => {
                    regex_split(re, plain.get_or_insert_with(|| plain_text(&cpts, &flags)), &offsets)?
                }
            };
        }
        // code point lengths -> byte ranges of `text`
        let mut words = Vec::with_capacity(offsets.len());
        let mut chars = text.char_indices().map(|(i, _)| i).chain(std::iter::once(text.len()));
        let mut start = chars.next().unwrap_or(0);
        for len in offsets {
            let end = if len == 0 { start } else { chars.nth(len - 1).unwrap_or(text.len()) };
            words.push(&text[start..end]);
            start = end;
        }
        Ok(words)
    }
}

/// The placeholder character of each collapsed category (llama.cpp's `k_ucat_cpt`).
fn placeholder(category: u8) -> char {
    match category {
        unicode::NUMBER => '\u{D1}',
        unicode::LETTER => '\u{D2}',
        unicode::PUNCTUATION => '\u{D3}',
        unicode::ACCENT_MARK => '\u{D4}',
        unicode::SYMBOL => '\u{D5}',
        _ => '\u{D0}',
    }
}

/// The ASCII members of each category (llama.cpp's `k_ucat_map`), as a Rust regex class body.
fn ascii_members(category: u8) -> &'static str {
    match category {
        unicode::NUMBER => "0-9",
        unicode::LETTER => "A-Za-z",
        unicode::PUNCTUATION => r"!-#%-\*,-/:-;\?-@\[-\]_\{\}",
        unicode::SYMBOL => r"\$\+<->\^`\|\~",
        _ => "",
    }
}

/// The categories llama.cpp collapses (`k_ucat_enum`); `\p{Lu}` and friends all mean "letter".
const CATEGORIES: [(&str, u8); 10] = [
    (r"\p{N}", unicode::NUMBER),
    (r"\p{L}", unicode::LETTER),
    (r"\p{P}", unicode::PUNCTUATION),
    (r"\p{M}", unicode::ACCENT_MARK),
    (r"\p{S}", unicode::SYMBOL),
    (r"\p{Lu}", unicode::LETTER),
    (r"\p{Ll}", unicode::LETTER),
    (r"\p{Lt}", unicode::LETTER),
    (r"\p{Lm}", unicode::LETTER),
    (r"\p{Lo}", unicode::LETTER),
];

/// Compiles one regex step, rewriting its categories for collapsed text when it has any.
fn compile(expr: &str) -> Result<Step> {
    let collapsed = CATEGORIES.iter().any(|(c, _)| expr.contains(c));
    let source = if collapsed { rewrite_categories(expr)? } else { expr.to_string() };
    let re = fancy_regex::Regex::new(&source).map_err(|e| Error::Regex(format!("{expr}: {e}")))?;
    Ok(Step::Regex { re, collapsed })
}

/// llama.cpp's regex rewrite: `\p{X}` becomes `[<placeholder><ascii members>]` (without the
/// brackets inside a class).
fn rewrite_categories(expr: &str) -> Result<String> {
    if !expr.is_ascii() {
        return Err(Error::Regex(format!("{expr}: categories and non-ASCII characters in one pattern")));
    }
    let b = expr.as_bytes();
    let mut out = String::new();
    let mut inside = false;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'[' && (i == 0 || b[i - 1] != b'\\') {
            out.push('[');
            inside = true;
            i += 1;
            continue;
        }
        if inside && c == b']' && b[i - 1] != b'\\' {
            out.push(']');
            inside = false;
            i += 1;
            continue;
        }
        if let Some((pat, cat)) = CATEGORIES.iter().find(|(p, _)| expr[i..].starts_with(p)) {
            let class = format!("\\x{{{:X}}}{}", placeholder(*cat) as u32, ascii_members(*cat));
            if inside {
                out.push_str(&class);
            } else {
                out.push_str(&format!("[{class}]"));
            }
            i += pat.len();
            continue;
        }
        out.push(c as char);
        i += 1;
    }
    Ok(out)
}

/// The text with every non-ASCII code point replaced by its category placeholder.
fn collapse(cpts: &[u32], flags: &[Flags]) -> Vec<char> {
    cpts.iter()
        .zip(flags)
        .map(|(&c, f)| match char::from_u32(c) {
            Some(ch) if c < 128 => ch,
            _ if f.is_whitespace() => '\u{0B}',
            _ => placeholder(f.category),
        })
        .collect()
}

/// The text with non-ASCII whitespace replaced by `\v` (what llama.cpp's wregex sees).
fn plain_text(cpts: &[u32], flags: &[Flags]) -> Vec<char> {
    cpts.iter()
        .zip(flags)
        .map(|(&c, f)| if c > 0x7F && f.is_whitespace() { '\u{0B}' } else { char::from_u32(c).unwrap_or('\u{FFFD}') })
        .collect()
}

/// llama.cpp's `unicode_regex_split_stl`: within each piece, matches and the stretches between
/// them become pieces of their own.
fn regex_split(re: &fancy_regex::Regex, text: &[char], offsets: &[usize]) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let seg: String = text[start..start + len].iter().collect();
        // byte offset in `seg` -> code point offset, advanced as matches come in order
        let (mut byte_pos, mut cpt_pos) = (0usize, 0usize);
        let mut to_cpt = |b: usize| {
            cpt_pos += seg[byte_pos..b].chars().count();
            byte_pos = b;
            cpt_pos
        };
        let mut last = 0;
        for m in re.find_iter(&seg) {
            let m = m.map_err(|e| Error::Regex(format!("{}: {e}", re.as_str())))?;
            let (s, e) = (to_cpt(m.start()), to_cpt(m.end()));
            if s > last {
                out.push(s - last);
            }
            out.push(e - s);
            last = e;
        }
        if last < len {
            out.push(len - last);
        }
        start += len;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pre: &str, text: &str) -> Vec<String> {
        let p = PreTokenizer::by_name(pre).unwrap().unwrap();
        p.split(text).unwrap().into_iter().map(String::from).collect()
    }

    #[test]
    fn every_family_compiles() {
        for name in supported_pre_tokenizers() {
            PreTokenizer::by_name(name).unwrap().unwrap();
        }
        assert!(PreTokenizer::by_name("no-such-pre").is_none());
    }

    #[test]
    fn splits_like_llama_cpp() {
        assert_eq!(split("gpt-2", "Hello world's  end"), ["Hello", " world", "'s", " ", " end"]);
        assert_eq!(split("llama-bpe", "abc 12345\n\n x"), ["abc", " ", "123", "45", "\n\n", " x"]);
        assert_eq!(split("qwen2", "a 123"), ["a", " ", "1", "2", "3"]);
        assert_eq!(split("smollm", "x42"), ["x", "4", "2"]);
        assert_eq!(split("kimi-k2", "你好world"), ["你好", "world"]);
        assert_eq!(split("deepseek-v3", "1234 中文"), ["123", "4", " ", "中文"]);
        assert_eq!(split("gpt-4o", "HelloWorld"), ["Hello", "World"]);
    }

    #[test]
    fn rewrite_matches_llama_cpp() {
        assert_eq!(rewrite_categories(r"\p{N}+").unwrap(), r"[\x{D1}0-9]+");
        assert_eq!(rewrite_categories(r"[^\s\p{L}]").unwrap(), r"[^\s\x{D2}A-Za-z]");
    }
}
