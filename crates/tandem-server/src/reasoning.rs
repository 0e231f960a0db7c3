//! Thinking text apart from the answer (`--reasoning-format`, llama-server's names): what a
//! DeepSeek-R1 or Kimi-K2.5-thinking model writes between `<think>` and `</think>` goes to
//! OpenAI's `reasoning_content`, the rest to `content`. The prompt may already open the block
//! (templates that end the generation prompt with `<think>`); a block never closed is all
//! reasoning, as in llama-server.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// `--reasoning-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Everything in `content`, tags included.
    None,
    /// `<think>…</think>` into `reasoning_content` (llama-server's `deepseek`; `auto` is the same).
    #[default]
    Deepseek,
}

impl ReasoningFormat {
    pub fn from_name(name: &str) -> Result<ReasoningFormat, String> {
        match name {
            "none" => Ok(ReasoningFormat::None),
            "deepseek" | "auto" | "deepseek-legacy" => Ok(ReasoningFormat::Deepseek),
            other => Err(format!("--reasoning-format {other:?}: one of none, deepseek, auto")),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not yet known whether the output opens with `<think>`.
    Start,
    Thinking,
    /// Just after `</think>`: the blank lines before the answer are dropped.
    AfterThink,
    Answer,
}

/// Splits streamed text into (reasoning, content) pieces.
#[derive(Debug)]
pub struct Splitter {
    state: State,
    /// Text held back: a possible start of a tag.
    held: String,
}

impl Splitter {
    /// `prompt_opens`: the rendered prompt ends inside an open `<think>` block.
    pub fn new(format: ReasoningFormat, prompt_opens: bool) -> Splitter {
        let state = match (format, prompt_opens) {
            (ReasoningFormat::None, _) => State::Answer,
            (_, true) => State::Thinking,
            (_, false) => State::Start,
        };
        Splitter { state, held: String::new() }
    }

    /// Whether a rendered prompt leaves a `<think>` block open.
    pub fn prompt_opens(prompt: &str) -> bool {
        let t = prompt.trim_end();
        match (t.rfind(OPEN), t.rfind(CLOSE)) {
            (Some(o), Some(c)) => o > c,
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// The next piece of text: (reasoning, content) to send now.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.held.push_str(text);
        let (mut reasoning, mut content) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if OPEN.starts_with(t) {
                        return (reasoning, content); // maybe the tag, still arriving
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => match self.held.find(CLOSE) {
                    Some(i) => {
                        reasoning.push_str(&self.held[..i]);
                        self.held = self.held[i + CLOSE.len()..].to_string();
                        self.state = State::AfterThink;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, CLOSE);
                        let cut = self.held.len() - keep;
                        reasoning.push_str(&self.held[..cut]);
                        self.held = self.held[cut..].to_string();
                        return (reasoning, content);
                    }
                },
                State::AfterThink => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        self.held.clear();
                        return (reasoning, content);
                    }
                    self.held = t.to_string();
                    self.state = State::Answer;
                }
                State::Answer => {
                    content.push_str(&self.held);
                    self.held.clear();
                    return (reasoning, content);
                }
            }
        }
    }

    /// The end of the output: what is still held back.
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => (held, String::new()),
            State::AfterThink => (String::new(), String::new()),
            State::Start | State::Answer => (String::new(), held),
        }
    }
}

/// Bytes at the end of `s` that start `tag` (a tag still arriving).
pub(crate) fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` one by one; the joined (reasoning, content).
    fn split(format: ReasoningFormat, opens: bool, pieces: &[&str]) -> (String, String) {
        let mut s = Splitter::new(format, opens);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let (a, b) = s.push(p);
            r += &a;
            c += &b;
        }
        let (a, b) = s.finish();
        (r + &a, c + &b)
    }

    #[test]
    fn thinking_goes_to_reasoning_whatever_the_pieces() {
        let d = ReasoningFormat::Deepseek;
        let want = ("Let me see. 2+2".to_string(), "It is 4.".to_string());
        let text = "<think>Let me see. 2+2</think>\n\nIt is 4.";
        // every way of cutting the text in two and in characters
        for i in 0..=text.len() {
            assert_eq!(split(d, false, &[&text[..i], &text[i..]]), want, "cut at {i}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split(d, false, &pieces), want);
        // the prompt opened the block
        assert_eq!(split(d, true, &["Let me see. 2+2</th", "ink>It is 4."]), want);
        // never closed: all reasoning
        assert_eq!(split(d, true, &["still thinking <"]), ("still thinking <".into(), String::new()));
        // no thinking at all, or a mention of the tag later on
        assert_eq!(split(d, false, &["<thi", "s is text"]), (String::new(), "<this is text".into()));
        assert_eq!(split(d, false, &["a <think>b</think>"]), (String::new(), "a <think>b</think>".into()));
        // none: the tags stay in the content
        assert_eq!(split(ReasoningFormat::None, false, &[text]), (String::new(), text.to_string()));
        assert!(Splitter::prompt_opens("<｜Assistant｜><think>\n"));
        assert!(!Splitter::prompt_opens("<think>a</think>answer"));
        assert_eq!(ReasoningFormat::from_name("auto"), Ok(ReasoningFormat::Deepseek));
        assert!(ReasoningFormat::from_name("x").is_err());
    }
}
