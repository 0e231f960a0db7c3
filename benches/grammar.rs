//! What structured output costs per token against what decoding it costs, on SmolLM2-135M
//! (TANDEM_SMOLLM2_GGUF, as scripts/test.sh sets it): one decode step at depth 16, and the
//! grammar's work per token (the mask over the 49,152-token vocabulary, applied to the logits,
//! then the token consumed) along a JSON object that a json_schema with three typed fields (one
//! an enum) accepts. Compare `decode_step` with `json_schema_mask_per_token` (criterion's time
//! per element).
//!
//! `TANDEM_SMOLLM2_GGUF=... cargo bench --bench grammar` (`-- --quick` for a short run).

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::sync::Arc;
use tandem_engine::grammar::{apply_mask, Grammars};
use tandem_engine::Constraint;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{Batch, Context, ContextParams, Exec, Model};
use tandem_tokenizer::Tokenizer;

fn bench_grammar(c: &mut Criterion) {
    let path = std::env::var("TANDEM_SMOLLM2_GGUF")
        .expect("TANDEM_SMOLLM2_GGUF: the SmolLM2 GGUF (scripts/test.sh installs it)");
    let gguf = Arc::new(GgufModel::open(&path, LoadOptions::default()).expect("SmolLM2"));
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    let model = Arc::new(Model::load(gguf).expect("model"));
    let n_threads = common::threads();
    let threads = tandem_cpu::Threads::new(n_threads, n_threads).expect("threads");
    let params = ContextParams { n_ctx: 256, ..ContextParams::default() };
    let mut ctx = Context::new(model, Exec::cpu(threads), params).expect("context");
    let prompt = tok.encode("Describe a person as JSON with their name, age and mood.", true, false).expect("prompt");
    let depth = prompt.len();
    ctx.decode(&Batch::sequence(&prompt, 0, 0, false)).expect("prefill");
    c.bench_function(&format!("decode_step/smollm2/t{n_threads}"), |b| {
        b.iter(|| {
            ctx.decode(&Batch::sequence(&[42], depth as u32, 0, true)).expect("decode");
            ctx.truncate(0, depth);
        })
    });

    let grammars = Grammars::new(&tok).expect("grammars");
    let schema = Constraint::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "mood": {"type": "string", "enum": ["happy", "sad", "angry"]}
        },
        "required": ["name", "age", "mood"]
    }));
    let output = tok.encode(r#"{"name": "Ada Lovelace", "age": 36, "mood": "happy"}"#, false, false).expect("output");
    let mut logits = vec![0.5f32; tok.n_vocab()];
    let mut group = c.benchmark_group("json_schema_mask_per_token");
    group.throughput(Throughput::Elements(output.len() as u64));
    group.bench_function("smollm2", |b| {
        b.iter(|| {
            let mut m = grammars.matcher(&schema).expect("matcher");
            for &t in &output {
                apply_mask(&mut m, &mut logits, &tok).expect("mask");
                m.consume_token(t).expect("consume");
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench_grammar);
criterion_main!(benches);
