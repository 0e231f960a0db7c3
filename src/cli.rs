//! Command-line arguments shared by tandem's commands, spelled as llama.cpp spells them so that a
//! llama-server command line works with the binary name changed (DESIGN.md "Contracts").
//!
//! clap's short flags are one character; llama.cpp's multi-letter single-dash flags (`-ngl`,
//! `-ctk`, ...) are rewritten to their long forms by [`normalize_args`] before parsing.

use clap::Args;
use std::ffi::OsString;
use std::path::PathBuf;

/// llama.cpp's multi-letter single-dash flags and the long flag each one means.
pub const MULTI_LETTER_FLAGS: &[(&str, &str)] = &[
    ("-ngl", "--n-gpu-layers"),
    ("-ot", "--override-tensor"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-tb", "--threads-batch"),
    ("-ub", "--ubatch-size"),
    ("-np", "--parallel"),
    ("-ncmoe", "--n-cpu-moe"),
    ("-cmoe", "--cpu-moe"),
    ("-mla", "--mla-use"),
    ("-amb", "--attn-max-batch"),
    ("-fa", "--flash-attn"),
    ("-fmoe", "--fused-moe"),
    ("-rtr", "--run-time-repack"),
    ("-ser", "--smart-expert-reduction"),
    ("-nkvo", "--no-kv-offload"),
    ("-dev", "--device"),
    ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"),
    ("-mg", "--main-gpu"),
];

/// Rewrites llama.cpp's multi-letter single-dash flags (also in `-ngl=99` form) to long flags.
/// Everything after a bare `--` is left alone.
pub fn normalize_args<I: IntoIterator<Item = OsString>>(args: I) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut rest = false;
    for a in args {
        if rest {
            out.push(a);
            continue;
        }
        let Some(s) = a.to_str() else {
            out.push(a);
            continue;
        };
        if s == "--" {
            rest = true;
            out.push(a);
            continue;
        }
        let (flag, value) = match s.split_once('=') {
            Some((f, v)) => (f, Some(v)),
            None => (s, None),
        };
        match MULTI_LETTER_FLAGS.iter().find(|(short, _)| *short == flag) {
            Some((_, long)) => out.push(match value {
                Some(v) => format!("{long}={v}").into(),
                None => (*long).into(),
            }),
            None => out.push(a),
        }
    }
    out
}

/// Which model to open and how its files are brought into memory.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// The model: a .gguf file, or any shard of a split model (NAME-00001-of-00013.gguf).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: PathBuf,
    /// Read the files into memory instead of memory-mapping them.
    #[arg(long)]
    pub no_mmap: bool,
    /// Lock the model's memory so it is never paged out.
    #[arg(long)]
    pub mlock: bool,
}

impl ModelArgs {
    pub fn load_options(&self) -> tandem_gguf::LoadOptions {
        tandem_gguf::LoadOptions { mmap: !self.no_mmap, mlock: self.mlock }
    }
}

/// Threads, context and batching, as llama.cpp names them.
#[derive(Args, Debug, Clone)]
pub struct RuntimeArgs {
    /// Threads for single-token (decode) steps [default: all cores].
    #[arg(short = 't', long = "threads", value_name = "N")]
    pub threads: Option<usize>,
    /// Threads for batches (prefill) [default: --threads].
    #[arg(long = "threads-batch", value_name = "N")]
    pub threads_batch: Option<usize>,
    /// Context size in tokens (0 = the model's training context).
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Logical batch size: the most tokens submitted to one decode call.
    #[arg(short = 'b', long = "batch-size", value_name = "N", default_value_t = 2048)]
    pub batch_size: usize,
    /// Physical micro-batch size: the most tokens computed in one forward pass.
    #[arg(long = "ubatch-size", value_name = "N", default_value_t = 512)]
    pub ubatch_size: usize,
    /// KV cache type for K: f32, f16, bf16, q8_0.
    #[arg(long = "cache-type-k", value_name = "TYPE", default_value = "f16")]
    pub cache_type_k: String,
    /// KV cache type for V: f32, f16, bf16, q8_0.
    #[arg(long = "cache-type-v", value_name = "TYPE", default_value = "f16")]
    pub cache_type_v: String,
    /// Parallel sequences (server slots).
    #[arg(long = "parallel", value_name = "N", default_value_t = 1)]
    pub parallel: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &[&str]) -> Vec<String> {
        normalize_args(args.iter().map(OsString::from)).into_iter().map(|a| a.into_string().unwrap()).collect()
    }

    #[test]
    fn multi_letter_flags_become_long_flags() {
        assert_eq!(
            norm(&["tandem", "-ngl", "999", "-ot", "exps=CPU", "-ctk=q8_0", "-t", "4", "-tb", "8", "-ub", "64"]),
            [
                "tandem",
                "--n-gpu-layers",
                "999",
                "--override-tensor",
                "exps=CPU",
                "--cache-type-k=q8_0",
                "-t",
                "4",
                "--threads-batch",
                "8",
                "--ubatch-size",
                "64"
            ]
        );
        // Values that look like flags and anything after `--` are left alone.
        assert_eq!(norm(&["x", "--", "-ngl"]), ["x", "--", "-ngl"]);
    }
}
