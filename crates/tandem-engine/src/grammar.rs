//! Structured output: a request's output held to a JSON schema, any JSON object, a GBNF grammar
//! (llama-server's `grammar`), a Lark grammar or a regex, by constrained decoding with
//! llguidance (the engine llama.cpp links for the same). Before each token is sampled the
//! tokens the grammar cannot take next get -inf logits; once the grammar is complete only
//! end-of-generation is left.

use crate::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
pub use llguidance::Matcher;
use llguidance::ParserFactory;
use std::sync::Arc;
use tandem_tokenizer::{vocab::attr, Tokenizer};

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid for this JSON schema.
    JsonSchema(serde_json::Value),
    /// A GBNF grammar, llama.cpp's format (`root` is the start rule).
    Gbnf(String),
    /// llguidance's Lark-like grammar.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A call of one of these tools (OpenAI's `tool_choice: "required"`; one or more with
    /// `parallel`), or of the tool named (a named `tool_choice`), in the chat template's format.
    ToolCall { tools: Vec<serde_json::Value>, name: Option<String>, parallel: bool },
}

/// The compiled grammars' shared part: the vocabulary as llguidance sees it.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The vocabulary's token bytes for llguidance: control and unknown tokens marked special
    /// (llguidance's 0xFF prefix), so that text never matches them.
    pub fn new(tok: &Tokenizer) -> Result<Grammars> {
        let n = tok.n_vocab();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let special = tok.token_attr(id).is_some_and(|a| a & (attr::CONTROL | attr::UNKNOWN) != 0);
                let piece = tok.token_to_piece(id, special).unwrap_or(&[]);
                if special {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(piece);
                    w
                } else {
                    piece.to_vec()
                }
            })
            .collect();
        let eos = tok.special_ids().eos.or_else(|| tok.eog_ids().next()).unwrap_or(0);
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tok.special_ids().bos;
        let trie = TokTrie::from(&info, &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| Error::InvalidRequest(format!("grammar engine: {e}")))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh matcher for `c`; a grammar that does not compile is the request's fault.
    pub fn matcher(&self, c: &Constraint) -> Result<Matcher> {
        let grammar = match c {
            Constraint::ToolCall { .. } => {
                return Err(Error::InvalidRequest("tool_choice: the call grammar is made by the engine".into()))
            }
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(s.clone()),
            Constraint::Gbnf(g) => TopLevelGrammar::from_lark(gbnf_to_lark(g)?),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
        };
        self.compile(grammar, what(c))
    }

    /// A fresh matcher for a Lark grammar the engine made; `what` names it in errors.
    pub fn lark_matcher(&self, lark: String, what: &str) -> Result<Matcher> {
        self.compile(TopLevelGrammar::from_lark(lark), what)
    }

    fn compile(&self, grammar: TopLevelGrammar, what: &str) -> Result<Matcher> {
        let parser = self.factory.create_parser(grammar).map_err(|e| Error::InvalidRequest(format!("{what}: {e}")))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(Error::InvalidRequest(format!("{what}: {e}")));
        }
        Ok(m)
    }
}

fn what(c: &Constraint) -> &'static str {
    match c {
        Constraint::JsonObject => "json_object",
        Constraint::JsonSchema(_) => "json_schema",
        Constraint::Gbnf(_) => "grammar",
        Constraint::Lark(_) => "lark grammar",
        Constraint::Regex(_) => "regex",
        Constraint::ToolCall { .. } => "tool_choice",
    }
}

/// Masks `logits` to what `m` allows next (end-of-generation too once it may end).
pub fn apply_mask(m: &mut Matcher, logits: &mut [f32], tok: &Tokenizer) -> std::result::Result<(), String> {
    let mask = m.compute_mask().map_err(|e| e.to_string())?;
    let accepting = m.is_accepting().unwrap_or(false);
    for (id, l) in logits.iter_mut().enumerate() {
        if !mask.is_allowed(id as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
    if accepting {
        // the grammar may end: the model's own end-of-generation tokens end it
        let eos: Vec<u32> = tok.eog_ids().collect();
        for id in eos {
            if let Some(x) = logits.get_mut(id as usize) {
                if *x == f32::NEG_INFINITY {
                    *x = 0.0;
                }
            }
        }
    }
    Ok(())
}

/// llama.cpp's GBNF in llguidance's Lark syntax: `name ::= body` rules become `name: body`, `[...]`
/// classes and `.` become regexes, `#` comments go; strings, `( )`, `| * + ?` and `{m,n}` stay.
/// `root` is the start rule.
pub fn gbnf_to_lark(src: &str) -> Result<String> {
    let bad = |m: String| Error::InvalidRequest(format!("grammar: {m}"));
    // tokens of the body, with rule boundaries found where `NAME ::=` starts
    let chars: Vec<char> = src.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    let mut rules = 0;
    let rule_name = |s: &str| format!("r_{}", s.to_ascii_lowercase().replace('-', "_"));
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '"' => {
                let start = i;
                i = closed(&chars, i, '"').ok_or_else(|| bad("a string is not closed".into()))?;
                out.extend(&chars[start..i]);
                out.push(' ');
                continue;
            }
            '[' => {
                let start = i;
                i = closed(&chars, i, ']').ok_or_else(|| bad("a character class is not closed".into()))?;
                let class: String = chars[start..i].iter().collect();
                out.push('/');
                out.push_str(&class.replace('/', "\\/"));
                out.push_str("/ ");
                continue;
            }
            '.' => out.push_str("/(?s:.)/ "),
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_') {
                    i += 1;
                }
                let name: String = chars[start..i].iter().collect();
                // a definition: NAME ::=
                let mut j = i;
                while j < chars.len() && (chars[j] == ' ' || chars[j] == '\t') {
                    j += 1;
                }
                if chars[j..].starts_with(&[':', ':', '=']) {
                    if name.chars().all(|c| c.is_ascii_digit()) {
                        return Err(bad(format!("rule name {name:?}")));
                    }
                    out.push('\n');
                    out.push_str(&rule_name(&name));
                    out.push_str(": ");
                    rules += 1;
                    i = j + 3;
                } else if name.chars().all(|c| c.is_ascii_digit()) {
                    // a number of a {m,n} repetition
                    out.push_str(&name);
                } else {
                    out.push_str(&rule_name(&name));
                    out.push(' ');
                }
                continue;
            }
            '\n' | '\r' | '\t' => out.push(' '),
            _ => out.push(c),
        }
        i += 1;
    }
    if rules == 0 {
        return Err(bad("no rule (NAME ::= ...)".into()));
    }
    if !out.contains("\nr_root: ") {
        return Err(bad("no root rule (root ::= ...)".into()));
    }
    Ok(format!("start: r_root\n{}\n", out.trim()))
}

/// Where the string or class that opens at `chars[open]` ends: the index after its `close`
/// (a `\` escapes the character after it), or `None` when it is not closed.
fn closed(chars: &[char], open: usize, close: char) -> Option<usize> {
    let mut i = open + 1;
    while i < chars.len() && chars[i] != close {
        if chars[i] == '\\' {
            i += 1;
        }
        i += 1;
    }
    (i < chars.len()).then_some(i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_becomes_lark() {
        let g = "# yes or no\nroot ::= answer \"!\"?\nanswer ::= (\"yes\" | \"no\")\n  | [0-9]{1,3} .\n";
        let lark = gbnf_to_lark(g).unwrap();
        let lines: Vec<String> = lark.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        assert_eq!(
            lines,
            ["start: r_root", "r_root: r_answer \"!\" ?", "r_answer: (\"yes\" | \"no\" ) | /[0-9]/ {1,3} /(?s:.)/"]
        );
        assert!(gbnf_to_lark("answer ::= \"x\"").unwrap_err().to_string().contains("root"));
        assert!(gbnf_to_lark("root ::= \"x").unwrap_err().to_string().contains("not closed"));
    }
}
