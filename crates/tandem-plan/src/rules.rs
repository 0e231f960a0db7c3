//! Placement rules with llama.cpp's semantics: `-ot/--override-tensor PATTERN=DEVICE[,...]`
//! (an unanchored regex searched in the tensor name; rules tried in command-line order, the first
//! match wins), `--cpu-moe` and `--n-cpu-moe N` (llama.cpp's common/arg.cpp turns both into
//! overrides of the routed-expert tensors).
//!
//! llama.cpp uses std::regex (ECMAScript); tandem uses the `regex` crate, which agrees on
//! everything `-ot` patterns are made of (classes, groups, alternation, `\.`, `\d`, repetition)
//! but has no look-around or back-references: such a pattern is reported as an invalid regex.

use crate::device::Device;
use crate::{Error, Result};
use regex::Regex;
use tandem_gguf::naming::layer_of;
use tandem_gguf::TensorCategory;

/// What a rule matches.
#[derive(Clone, Debug)]
pub enum Matcher {
    /// `-ot PATTERN=...`: the regex is searched anywhere in the name (`std::regex_search`).
    Regex { pattern: String, regex: Regex },
    /// `--cpu-moe` (every layer) and `--n-cpu-moe N` (layers `0..N`): the routed-expert tensors,
    /// which llama.cpp matches with `\.ffn_(up|down|gate|gate_up)_(ch|)exps` and tandem by
    /// [`TensorCategory::RoutedExperts`] (names ending in `_exps`; the same tensors).
    RoutedExperts { below_layer: Option<u32> },
}

/// One placement rule: a matcher, the device it sends tensors to, and where it came from.
#[derive(Clone, Debug)]
pub struct Rule {
    /// How the user wrote it, for messages: `--override-tensor 'exps=CPU'`, `--cpu-moe`.
    pub source: String,
    pub matcher: Matcher,
    /// The device as typed; resolved against the declared devices by the planner, which lists
    /// the available ones when it names none of them.
    pub device: String,
}

impl Rule {
    /// Parses one `-ot` argument: `PATTERN=DEVICE`, or several separated by commas.
    /// Like llama.cpp, the list is split at every `,` and each rule at its first `=`, so a
    /// pattern can hold neither (`{1,3}` is written `{1}|...` or as separate `-ot` rules).
    pub fn parse_override(arg: &str) -> Result<Vec<Rule>> {
        let bad = |msg: String| Error::BadRule { arg: arg.to_string(), msg };
        let mut rules = Vec::new();
        for (i, piece) in arg.split(',').enumerate() {
            let n = i + 1;
            let Some((pattern, device)) = piece.split_once('=') else {
                return Err(bad(format!("rule {n} '{piece}' is not PATTERN=DEVICE (e.g. exps=CPU)")));
            };
            if pattern.is_empty() {
                return Err(bad(format!("rule {n} '{piece}' has an empty pattern")));
            }
            if device.trim().is_empty() {
                return Err(bad(format!("rule {n} '{piece}' names no device after '='")));
            }
            let regex = compile(arg, pattern)?;
            rules.push(Rule {
                source: format!("--override-tensor '{piece}'"),
                matcher: Matcher::Regex { pattern: pattern.to_string(), regex },
                device: device.trim().to_string(),
            });
        }
        Ok(rules)
    }

    /// Parses every `-ot` argument, keeping command-line order.
    pub fn parse_overrides<S: AsRef<str>>(args: &[S]) -> Result<Vec<Rule>> {
        let mut out = Vec::new();
        for a in args {
            out.extend(Rule::parse_override(a.as_ref())?);
        }
        Ok(out)
    }

    /// `--cpu-moe`: every routed-expert tensor on the CPU.
    pub fn cpu_moe() -> Rule {
        Rule { source: "--cpu-moe".into(), matcher: Matcher::RoutedExperts { below_layer: None }, device: "CPU".into() }
    }

    /// `--n-cpu-moe N`: the routed-expert tensors of layers `0..N` on the CPU.
    pub fn n_cpu_moe(n: u32) -> Rule {
        Rule {
            source: format!("--n-cpu-moe {n}"),
            matcher: Matcher::RoutedExperts { below_layer: Some(n) },
            device: "CPU".into(),
        }
    }

    /// Whether this rule matches the tensor named `name`.
    pub fn matches(&self, name: &str) -> bool {
        match &self.matcher {
            Matcher::Regex { regex, .. } => regex.is_match(name),
            Matcher::RoutedExperts { below_layer } => {
                TensorCategory::of(name) == TensorCategory::RoutedExperts
                    && below_layer.is_none_or(|n| layer_of(name).is_some_and(|l| l < n))
            }
        }
    }

    /// The device this rule names, if it is one of `available`.
    pub(crate) fn resolve(&self, available: &[Device]) -> Result<Device> {
        match Device::parse(&self.device).filter(|d| available.contains(d)) {
            Some(d) => Ok(d),
            None => Err(Error::UnknownDevice {
                context: self.source.clone(),
                device: self.device.clone(),
                available: available_list(available),
            }),
        }
    }
}

/// `CPU, CUDA0` and, when no GPU is declared, how to declare one.
pub(crate) fn available_list(available: &[Device]) -> String {
    let names: Vec<String> = available.iter().map(Device::to_string).collect();
    let mut s = names.join(", ");
    if !available.iter().any(|d| d.is_gpu()) {
        s.push_str(" (declare GPUs with --gpu CUDA0=SIZE)");
    }
    s
}

/// Compiles `pattern`; a syntax error names the pattern and the byte position the parser stopped at.
fn compile(arg: &str, pattern: &str) -> Result<Regex> {
    let bad = |position: usize, msg: String| Error::BadRegex {
        arg: arg.to_string(),
        pattern: pattern.to_string(),
        position,
        msg,
    };
    // regex-syntax is the parser inside `regex`; asking it directly gives the error's span.
    if let Err(e) = regex_syntax::Parser::new().parse(pattern) {
        return Err(match &e {
            regex_syntax::Error::Parse(p) => bad(p.span().start.offset, p.kind().to_string()),
            regex_syntax::Error::Translate(t) => bad(t.span().start.offset, t.kind().to_string()),
            _ => bad(0, e.to_string().lines().last().unwrap_or("syntax error").to_string()),
        });
    }
    // What remains is a compiled-size limit, which has no position.
    Regex::new(pattern).map_err(|e| Error::BadRule { arg: arg.to_string(), msg: format!("regex '{pattern}': {e}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(arg: &str) -> String {
        Rule::parse_override(arg).unwrap_err().to_string()
    }

    #[test]
    fn comma_lists_keep_order_and_search_unanchored() {
        let rules = Rule::parse_overrides(&["exps=CPU,attn=CUDA0", r"blk\.1\.=CUDA1"]).unwrap();
        let devs: Vec<&str> = rules.iter().map(|r| r.device.as_str()).collect();
        assert_eq!(devs, ["CPU", "CUDA0", "CUDA1"]);
        assert!(rules[0].matches("blk.3.ffn_up_exps.weight"));
        assert!(!rules[0].matches("blk.3.ffn_up_shexp.weight"));
        assert!(rules[1].matches("blk.0.attn_q_a.weight"));
        assert!(rules[2].matches("blk.1.attn_norm.weight"));
        assert!(!rules[2].matches("blk.11.attn_norm.weight"));
        assert_eq!(rules[2].source, r"--override-tensor 'blk\.1\.=CUDA1'");
        // The seed spelling: anchors and escapes work as in std::regex.
        let seed = Rule::parse_override(r"\.ffn_.*_exps\.=CPU").unwrap();
        assert!(seed[0].matches("blk.7.ffn_gate_exps.weight"));
        assert!(!seed[0].matches("blk.7.ffn_gate_inp.weight"));
    }

    #[test]
    fn malformed_rules_name_the_rule() {
        assert_eq!(err("exps"), "--override-tensor 'exps': rule 1 'exps' is not PATTERN=DEVICE (e.g. exps=CPU)");
        assert_eq!(err("exps=CPU,"), "--override-tensor 'exps=CPU,': rule 2 '' is not PATTERN=DEVICE (e.g. exps=CPU)");
        assert_eq!(err("=CPU"), "--override-tensor '=CPU': rule 1 '=CPU' has an empty pattern");
        assert_eq!(err("exps="), "--override-tensor 'exps=': rule 1 'exps=' names no device after '='");
    }

    #[test]
    fn invalid_regex_shows_pattern_and_position() {
        assert_eq!(
            err("ffn_(up=CPU"),
            "--override-tensor 'ffn_(up=CPU': invalid regex 'ffn_(up' at position 4: unclosed group"
        );
        // The position is a byte offset in the pattern (look-around is not supported by `regex`).
        let e = err(r"exps=CPU,blk\.(?!1)=CUDA0");
        assert!(
            e.starts_with(r"--override-tensor 'exps=CPU,blk\.(?!1)=CUDA0': invalid regex 'blk\.(?!1)' at position 5: "),
            "{e}"
        );
        // Like llama.cpp, a rule ends at its first '=': `(?=` cannot be written in a pattern.
        assert!(err(r"blk\.(?=1)=CUDA0").contains(r"invalid regex 'blk\.(?' at position 5: unclosed group"));
        assert!(err("*exps=CPU").contains("invalid regex '*exps' at position 0"));
    }

    #[test]
    fn moe_rules_match_routed_experts_by_layer() {
        let all = Rule::cpu_moe();
        assert!(all.matches("blk.60.ffn_down_exps.weight"));
        assert!(all.matches("blk.3.ffn_gate_up_exps.weight"));
        assert!(!all.matches("blk.3.ffn_down_shexp.weight"));
        assert!(!all.matches("blk.3.ffn_gate_inp.weight"));
        let first2 = Rule::n_cpu_moe(2);
        assert!(first2.matches("blk.1.ffn_up_exps.weight"));
        assert!(!first2.matches("blk.2.ffn_up_exps.weight"));
        assert!(!Rule::n_cpu_moe(0).matches("blk.0.ffn_up_exps.weight"));
        assert_eq!(first2.source, "--n-cpu-moe 2");
    }

    #[test]
    fn unknown_devices_list_the_available_ones() {
        let r = &Rule::parse_override("exps=CUDA1").unwrap()[0];
        assert_eq!(
            r.resolve(&[Device::Cuda(0), Device::Cpu]).unwrap_err().to_string(),
            "--override-tensor 'exps=CUDA1': unknown device 'CUDA1'; available: CUDA0, CPU"
        );
        let r = &Rule::parse_override("exps=GPU").unwrap()[0];
        assert_eq!(
            r.resolve(&[Device::Cpu]).unwrap_err().to_string(),
            "--override-tensor 'exps=GPU': unknown device 'GPU'; available: CPU (declare GPUs with --gpu CUDA0=SIZE)"
        );
        let r = &Rule::parse_override("exps=cpu").unwrap()[0];
        assert_eq!(r.resolve(&[Device::Cpu]).unwrap(), Device::Cpu);
    }
}
