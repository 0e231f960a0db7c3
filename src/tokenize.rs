//! `tandem tokenize`: the token ids llama.cpp would give a text, from the model's GGUF tokenizer
//! (only the headers are read; no weights are loaded).

use crate::cli::ModelArgs;
use anyhow::{bail, Context as _};
use clap::Args;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use tandem_tokenizer::Tokenizer;

#[derive(Args, Debug, Clone)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to tokenize.
    #[arg(
        long,
        short = 'p',
        visible_alias = "prompt",
        value_name = "TEXT",
        conflicts_with = "file",
        allow_hyphen_values = true
    )]
    pub text: Option<String>,
    /// Read the text from a file (UTF-8).
    #[arg(long, short = 'f', value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Print JSON: {"ids": [...], "pieces": [...]} (bytes of a partial UTF-8 character as \xNN).
    #[arg(long)]
    pub json: bool,
    /// Print only the ids, comma-separated (the form `tandem logits --tokens` takes).
    #[arg(long, conflicts_with = "json")]
    pub ids: bool,
    /// Do not add the BOS/EOS tokens the model asks for.
    #[arg(long)]
    pub no_bos: bool,
    /// Turn control-token texts in the input (`<|im_start|>`, ...) into those tokens.
    #[arg(long)]
    pub parse_special: bool,
}

/// Reads a UTF-8 text file; the error names the file and the first bad byte.
pub fn read_text_file(path: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!("{}: not valid UTF-8 (invalid byte at offset {})", path.display(), e.utf8_error().valid_up_to())
    })
}

/// The text from `--text` or `--file`.
pub fn input_text(text: &Option<String>, file: &Option<PathBuf>, what: &str) -> anyhow::Result<String> {
    match (text, file) {
        (Some(t), _) => Ok(t.clone()),
        (None, Some(f)) => read_text_file(f),
        (None, None) => bail!("no {what}: give it with -p TEXT or -f FILE"),
    }
}

/// A piece as text; bytes that are not (yet) a whole UTF-8 character are written `\xNN`.
fn show_piece(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02X}"));
        }
    }
    out
}

#[derive(Serialize)]
struct Output<'a> {
    ids: &'a [u32],
    pieces: Vec<String>,
}

pub fn run(args: &TokenizeArgs) -> anyhow::Result<()> {
    let text = input_text(&args.text, &args.file, "text")?;
    let gguf =
        crate::load::open_gguf(args.model.path(), args.model.load.load_options(), &args.model.load.overrides()?)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let ids = tok.encode(&text, !args.no_bos, args.parse_special)?;
    let pieces = ids.iter().map(|&id| tok.token_to_piece(id, true).map(show_piece)).collect::<Result<Vec<_>, _>>()?;
    let mut out = String::new();
    if args.json {
        out = serde_json::to_string(&Output { ids: &ids, pieces })?;
        out.push('\n');
    } else if args.ids {
        out = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        out.push('\n');
    } else {
        for (id, p) in ids.iter().zip(&pieces) {
            out.push_str(&format!("{id:>7} -> {p:?}\n"));
        }
    }
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|_| stdout.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}
