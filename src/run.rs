//! `tandem run`: text in, text out. The prompt goes through the model's chat template (unless
//! `--raw`), is tokenized as llama.cpp tokenizes it, and the continuation is streamed to stdout
//! as it is sampled; timings go to stderr. `--chat` is an interactive conversation on stdin that
//! keeps the KV cache between turns and only evaluates the tokens a turn adds.

use crate::cli::{EngineArgs, ModelArgs};
use crate::logits::open_context;
use crate::tokenize::input_text;
use anyhow::{bail, Context as _};
use clap::Args;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tandem_engine::{DryBreakers, Sampler, SamplingParams, StopMatcher};
use tandem_model::{Batch, Context};
use tandem_tokenizer::{message, ChatTemplate, StreamDecoder, Tokenizer};

/// The KV-cache sequence `tandem run` uses.
const SEQ: usize = 0;

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (with --chat: the first user turn).
    #[arg(short = 'p', long = "prompt", value_name = "TEXT", conflicts_with = "file", allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// Read the prompt from a file (UTF-8).
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Most tokens to generate per turn (-1 = until an end-of-generation token or a full context).
    #[arg(short = 'n', long = "n-predict", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub sampling: crate::cli::SamplingArgs,
    /// Stop when the output contains this text (not printed; repeatable).
    #[arg(short = 'r', long = "stop", visible_alias = "reverse-prompt", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Process escapes (\n, \r, \t, \', \", \\, \xHH) in the prompt and stop strings, as llama.cpp
    /// does by default (the default here too).
    #[arg(short = 'e', long = "escape", overrides_with = "no_escape")]
    pub escape: bool,
    /// Take the prompt and stop strings as they are.
    #[arg(long = "no-escape")]
    pub no_escape: bool,
    /// llama-cli's text completion without conversation (also -no-cnv): the prompt as it is,
    /// without the chat template, as --raw.
    #[arg(long = "no-conversation", conflicts_with_all = ["chat", "chat_template", "chat_template_file", "system"])]
    pub no_conversation: bool,
    /// llama-cli's single turn of conversation (also -st): what `tandem run` does without --chat.
    #[arg(long = "single-turn", conflicts_with = "chat")]
    pub single_turn: bool,
    /// Interactive chat on stdin, one turn per line (/exit ends it); the KV cache is kept between turns (also -cnv).
    #[arg(long, visible_alias = "conversation")]
    pub chat: bool,
    #[command(flatten)]
    pub template: crate::cli::TemplateArgs,
    /// A system message to start the conversation with (also -sys).
    #[arg(long = "system-prompt", visible_alias = "system", value_name = "TEXT", allow_hyphen_values = true)]
    pub system: Option<String>,
    /// Feed the prompt as it is, without the chat template.
    #[arg(long, conflicts_with_all = ["chat", "chat_template", "chat_template_file", "system"])]
    pub raw: bool,
    /// llama-cli's prompt cache: the KV cache of the prompt read from FILE when it exists (a
    /// prompt that starts with its tokens is not computed again) and written to it after the
    /// first prompt is evaluated (a slot file, as `serve --slot-save-path` writes).
    #[arg(long = "prompt-cache", value_name = "FILE")]
    pub prompt_cache: Option<PathBuf>,
    /// With --prompt-cache: write the generated tokens and later turns too, at the end.
    #[arg(long = "prompt-cache-all", requires = "prompt_cache")]
    pub prompt_cache_all: bool,
    /// With --prompt-cache: read the file, never write it.
    #[arg(long = "prompt-cache-ro", requires = "prompt_cache")]
    pub prompt_cache_ro: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Token counts and time spent, for the closing line.
#[derive(Default)]
struct Timings {
    prompt_tokens: usize,
    prompt_time: Duration,
    gen_tokens: usize,
    gen_time: Duration,
    reused_tokens: usize,
}

impl Timings {
    fn report(&self) -> String {
        let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
        let mut s = format!(
            "prompt: {} tokens in {:.2} s ({:.1} tokens/s); generation: {} tokens in {:.2} s ({:.1} tokens/s)",
            self.prompt_tokens,
            self.prompt_time.as_secs_f64(),
            rate(self.prompt_tokens, self.prompt_time),
            self.gen_tokens,
            self.gen_time.as_secs_f64(),
            rate(self.gen_tokens, self.gen_time),
        );
        if self.reused_tokens > 0 {
            s.push_str(&format!("; {} tokens reused from the KV cache", self.reused_tokens));
        }
        s
    }
}

/// A model context, its tokenizer and what its KV cache holds.
struct Session<'a> {
    args: &'a RunArgs,
    ctx: Context,
    tok: Tokenizer,
    sampler: Sampler,
    /// The tokens in the KV cache of `SEQ`, in order.
    cached: Vec<u32>,
    timings: Timings,
    /// `--stop` strings, escapes processed unless `--no-escape`.
    stops: Vec<String>,
}

/// Where generated text goes; a closed pipe ends generation quietly.
fn emit(out: &mut impl Write, text: &str) -> anyhow::Result<bool> {
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e).context("writing to stdout"),
    }
}

impl Session<'_> {
    fn n_ctx(&self) -> usize {
        self.ctx.params().n_ctx
    }

    /// Evaluates `ids`, reusing the longest prefix already in the cache; returns the logits of the
    /// last token.
    fn prefill(&mut self, ids: &[u32]) -> anyhow::Result<Vec<f32>> {
        if ids.is_empty() {
            bail!("the prompt tokenizes to no tokens");
        }
        if ids.len() >= self.n_ctx() {
            bail!("the prompt is {} tokens, the context holds {} (raise -c)", ids.len(), self.n_ctx());
        }
        let mut common = self.cached.iter().zip(ids).take_while(|(a, b)| a == b).count();
        common = common.min(ids.len() - 1); // at least one token is evaluated, for its logits
        self.ctx.truncate(SEQ, common);
        self.cached.truncate(common);
        self.timings.reused_tokens += common;
        let start = Instant::now();
        let chunk = self.args.engine.runtime.batch_size.max(1);
        let todo = &ids[common..];
        let mut logits = Vec::new();
        for (i, part) in todo.chunks(chunk).enumerate() {
            if todo.len() > chunk {
                terminal(&format!("\rprefill: {}/{} tokens", i * chunk + part.len(), todo.len()));
            }
            logits = self.ctx.decode(&Batch::sequence(part, self.cached.len() as u32, SEQ, false))?;
            self.cached.extend_from_slice(part);
        }
        if todo.len() > chunk {
            terminal("\n");
        }
        for &t in ids {
            self.sampler.accept(t);
        }
        self.timings.prompt_tokens += todo.len();
        self.timings.prompt_time += start.elapsed();
        Ok(logits)
    }

    /// Samples and streams tokens after `logits`; returns the text generated (stop strings cut).
    fn generate(&mut self, mut logits: Vec<f32>, out: &mut impl Write) -> anyhow::Result<String> {
        let start = Instant::now();
        let mut decoder = StreamDecoder::new();
        let mut stops = StopMatcher::new(&self.stops);
        let mut text = String::new();
        let mut n = 0i64;
        let mut open = true;
        while open && (self.args.n_predict < 0 || n < self.args.n_predict) {
            if self.args.ignore_eos {
                for id in self.tok.eog_ids().collect::<Vec<_>>() {
                    if let Some(l) = logits.get_mut(id as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            let t = self.sampler.sample(&logits)?;
            self.sampler.accept(t);
            if self.tok.is_eog(t) {
                break;
            }
            n += 1;
            let o = stops.push(&decoder.push(self.tok.token_to_piece(t, false)?));
            text.push_str(&o.text);
            open = emit(out, &o.text)?;
            if o.stopped {
                break;
            }
            if self.cached.len() + 1 >= self.n_ctx() {
                tracing::warn!("context full: {} tokens; raise -c for longer output", self.n_ctx());
                break;
            }
            logits = self.ctx.decode(&Batch::sequence(&[t], self.cached.len() as u32, SEQ, false))?;
            self.cached.push(t);
        }
        let rest = stops.push(&decoder.finish());
        let rest = if rest.stopped { rest.text } else { rest.text + &stops.finish() };
        text.push_str(&rest);
        if open {
            emit(out, &rest)?;
        }
        self.timings.gen_tokens += n as usize;
        self.timings.gen_time += start.elapsed();
        Ok(text)
    }
}

/// The template to render prompts with: `--chat-template`, else the model's (`None` = raw).
fn template(args: &RunArgs, tok: &Tokenizer) -> anyhow::Result<Option<ChatTemplate>> {
    if args.raw || args.no_conversation {
        return Ok(None);
    }
    let given = args.template.given()?;
    let source = match (given, tok.chat_template()) {
        (Some((text, _)), _) => text,
        (None, Some(s)) => s.to_string(),
        (None, None) if args.chat || args.system.is_some() => {
            tracing::info!("note: the model has no chat template (tokenizer.chat_template): chatml, as llama.cpp; --chat-template NAME|JINJA to choose");
            tandem_tokenizer::choose_template(None, None).0
        }
        (None, None) => {
            tracing::info!("note: the model has no chat template; the prompt is used as it is");
            return Ok(None);
        }
    };
    Ok(Some(ChatTemplate::new(&source, tok.bos_text(), tok.eos_text())?))
}

/// Renders the conversation; a BOS the template writes is dropped when the tokenizer adds one
/// anyway (as llama.cpp does), so the prompt never starts with two.
fn render(
    tmpl: &ChatTemplate,
    tok: &Tokenizer,
    messages: &[serde_json::Value],
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<String> {
    let s = tmpl.render_with(messages, None, true, kwargs)?;
    let bos = tok.bos_text();
    Ok(match s.strip_prefix(bos) {
        Some(rest) if tok.add_bos() && !bos.is_empty() => rest.to_string(),
        _ => s,
    })
}

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    args.engine.print_notes();
    let first = match (&args.prompt, &args.file) {
        (None, None) if args.chat => None,
        _ => Some(input_text(&args.prompt, &args.file, "prompt")?),
    };
    let first = match first {
        Some(p) if !args.no_escape => Some(process_escapes(&p).map_err(|e| anyhow::anyhow!("prompt: {e}"))?),
        p => p,
    };
    if first.as_ref().is_some_and(|p| p.trim().is_empty()) {
        bail!("empty prompt: give some text with -p TEXT or -f FILE");
    }
    // llama.cpp's default seed: a new one each run
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let fresh = t.as_nanos() as u64 ^ u64::from(std::process::id());
    let params = args.sampling.params(SamplingParams { seed: fresh, ..SamplingParams::default() })?;
    let kwargs = args.template.kwargs()?;
    let sampler = Sampler::new(params.clone())?;
    let ctx = open_context(&args.model, &args.engine.runtime, &args.engine.placement)?;
    let tok = Tokenizer::from_gguf(ctx.model().gguf())?;
    args.sampling.check_vocab(tok.n_vocab())?;
    let sampler = match params.dry_on() {
        true => sampler.with_dry_breakers(std::sync::Arc::new(DryBreakers::new(&tok, &params.dry_sequence_breakers)?)),
        false => sampler,
    };
    let tmpl = template(args, &tok)?;
    if args.sampling.seed.is_none_or(|s| s < 0) && params.temperature > 0.0 {
        tracing::info!("seed: {}", params.seed);
    }
    let stops = match args.no_escape {
        true => args.stop.clone(),
        false => args
            .stop
            .iter()
            .map(|t| process_escapes(t).map_err(|e| anyhow::anyhow!("--stop: {e}")))
            .collect::<anyhow::Result<_>>()?,
    };
    let mut s = Session { args, ctx, tok, sampler, cached: Vec::new(), timings: Timings::default(), stops };
    if let Some(path) = args.prompt_cache.as_deref().filter(|p| p.exists()) {
        let (tokens, bytes) =
            s.ctx.restore_sequence(SEQ, path).with_context(|| format!("--prompt-cache {}", path.display()))?;
        tracing::info!("prompt cache: {} tokens ({bytes} bytes) from {}", tokens.len(), path.display());
        s.cached = tokens;
    }
    // What the prompt cache file is to hold: the first prompt (llama-cli's default), or everything
    // at the end (--prompt-cache-all); none with --prompt-cache-ro.
    let save_to = args.prompt_cache.as_deref().filter(|_| !args.prompt_cache_ro);
    let save = |s: &Session, path: &std::path::Path| -> anyhow::Result<()> {
        let bytes =
            s.ctx.save_sequence(SEQ, &s.cached, path).with_context(|| format!("--prompt-cache {}", path.display()))?;
        tracing::info!("prompt cache: {} tokens ({bytes} bytes) to {}", s.cached.len(), path.display());
        Ok(())
    };
    let mut saved_prompt = false;
    let mut messages: Vec<serde_json::Value> = args.system.iter().map(|p| message("system", p)).collect();
    let mut stdout = std::io::stdout().lock();
    let mut turn = |s: &mut Session, messages: &mut Vec<serde_json::Value>, user: &str| -> anyhow::Result<()> {
        messages.push(message("user", user));
        let prompt = match &tmpl {
            Some(t) => render(t, &s.tok, messages, &kwargs)?,
            None => user.to_string(),
        };
        let ids = s.tok.encode(&prompt, true, true)?;
        let reused = s.timings.reused_tokens;
        let logits = s.prefill(&ids)?;
        // the first prompt, when it was not all in the file already
        if let Some(path) = save_to.filter(|_| !args.prompt_cache_all && !saved_prompt) {
            saved_prompt = true;
            if s.timings.reused_tokens - reused + 1 < ids.len() {
                save(s, path)?;
            }
        }
        let reply = s.generate(logits, &mut stdout)?;
        emit(&mut stdout, "\n")?;
        messages.push(message("assistant", &reply));
        Ok(())
    };
    if let Some(p) = &first {
        turn(&mut s, &mut messages, p)?;
    }
    if args.chat {
        let stdin = std::io::stdin();
        let mut lines = stdin.lock().lines();
        loop {
            terminal("\n> ");
            let Some(line) = lines.next() else { break };
            let line = line.context("reading stdin (the chat takes UTF-8 text, one turn per line)")?;
            match line.trim() {
                "" => continue,
                "/exit" | "/quit" => break,
                _ if args.no_escape => turn(&mut s, &mut messages, &line)?,
                // as llama-cli, each line's escapes too; a bad one loses that line, not the chat
                _ => match process_escapes(&line) {
                    Ok(line) => turn(&mut s, &mut messages, &line)?,
                    Err(e) => tracing::warn!("this line was not sent: {e}"),
                },
            }
        }
        terminal("\n");
    }
    if let Some(path) = save_to.filter(|_| args.prompt_cache_all) {
        save(&s, path)?;
    }
    tracing::info!("{}", s.timings.report());
    Ok(())
}

/// The interactive terminal's own text on stderr (the chat prompt `> `, the prefill counter):
/// not log lines, so not through the log.
fn terminal(text: &str) {
    let mut e = std::io::stderr().lock();
    // A closed stderr loses only this text.
    let _ = e.write_all(text.as_bytes()).and_then(|_| e.flush());
}

/// llama.cpp's `string_process_escapes`: `\n`, `\r`, `\t`, `\'`, `\"`, `\\` and `\xHH` (two hex
/// digits) become the characters they name; any other backslash stays as it is. An error where
/// `\xHH` bytes do not make UTF-8 text.
pub fn process_escapes(s: &str) -> anyhow::Result<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' || i + 1 == b.len() {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let hex = |at: usize| b.get(at).and_then(|&c| (c as char).to_digit(16));
        match (b[i + 1], hex(i + 2).zip(hex(i + 3))) {
            (b'n', _) => out.push(b'\n'),
            (b'r', _) => out.push(b'\r'),
            (b't', _) => out.push(b'\t'),
            (c @ (b'\'' | b'"' | b'\\'), _) => out.push(c),
            (b'x', Some((h, l))) => {
                out.push((h * 16 + l) as u8);
                i += 2;
            }
            (c, _) => out.extend_from_slice(&[b'\\', c]),
        }
        i += 2;
    }
    String::from_utf8(out)
        .map_err(|_| anyhow::anyhow!("its \\x escapes do not make UTF-8 text (--no-escape takes it as it is)"))
}

#[cfg(test)]
mod tests {
    use super::process_escapes;

    #[test]
    fn escapes_are_processed_as_llama_cpp_does() {
        let cases = [
            (r"a\nb\tc\rd", "a\nb\tc\rd"),
            (r#"\'\"\\"#, "'\"\\"),
            (r"\x41\x7a\x0", "Az\\x0"),
            (r"\q \é \", "\\q \\é \\"),
            (r"\xc3\xa9", "é"),
            (r"\\n", "\\n"),
        ];
        for (input, want) in cases {
            assert_eq!(process_escapes(input).unwrap(), want, "{input}");
        }
        assert!(process_escapes(r"\xff").unwrap_err().to_string().contains("UTF-8"));
    }
}
