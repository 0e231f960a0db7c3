//! One decode step (a single token at depth 16) through `Context::decode`: the tiny deepseek2
//! fixture always, and the model in TANDEM_BENCH_MODEL when that is set (a real GGUF); with the
//! weights repacked as `tandem` does by default (where the machine runs the packed kernels) and
//! as stored (`no-repack`, as `--no-repack`).
//!
//! `cargo bench --bench decode` (`-- --quick` for a short run); threads: TANDEM_BENCH_THREADS.

mod common;

use criterion::{criterion_group, criterion_main, Criterion};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{Batch, Context, ContextParams, Exec, Model};

const DEPTH: usize = 16;
const N_CTX: usize = 256;

fn context(path: &Path, threads: usize, repack: bool) -> Context {
    let gguf = GgufModel::open(path, LoadOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let model =
        Arc::new(Model::load_with(Arc::new(gguf), repack).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    model.pack_weights(&|_| false, &mut |_, _| {});
    let params = ContextParams { n_ctx: N_CTX, n_ubatch: 512, ..ContextParams::default() };
    let threads = tandem_cpu::Threads::new(threads, threads).expect("thread pool");
    Context::new(model, Exec::cpu(threads), params).expect("context")
}

fn bench_decode(c: &mut Criterion) {
    let n_threads = common::threads();
    let mut models = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/deepseek2-mla-tiny.gguf")];
    models.extend(std::env::var_os("TANDEM_BENCH_MODEL").map(PathBuf::from));
    let layouts: &[(bool, &str)] =
        if tandem_cpu::packed::packing_pays() { &[(true, ""), (false, "/no-repack")] } else { &[(false, "")] };
    for (path, &(repack, layout)) in models.iter().flat_map(|p| layouts.iter().map(move |l| (p, l))) {
        let mut ctx = context(path, n_threads, repack);
        let n_vocab = ctx.model().n_vocab() as u32;
        let prompt: Vec<u32> = (0..DEPTH as u32).map(|i| (i * 7919 + 1) % n_vocab).collect();
        ctx.decode(&Batch::sequence(&prompt, 0, 0, false)).expect("prefill");
        let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
        c.bench_function(&format!("decode_step/{name}/t{n_threads}{layout}"), |b| {
            let mut t = 0u32;
            b.iter(|| {
                t = (t + 1) % n_vocab;
                ctx.decode(&Batch::sequence(&[t], DEPTH as u32, 0, true)).expect("decode");
                ctx.truncate(0, DEPTH);
            })
        });
    }
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
