//! Any byte string restored as a slot file (`serve --slot-save-path`, `run --prompt-cache`) into a
//! context of the llama-tiny fixture restores whole or is refused in one line: never a panic, an
//! abort or an allocation beyond what the context may hold; a refused file leaves the sequence's
//! rows as they were (or, failing midway, none), a restored one holds exactly its tokens. Seed:
//! `fuzz/seeds/slot_file` (written by `tandem run --prompt-cache`). Run: `cargo +nightly fuzz run
//! slot_file fuzz/seeds/slot_file` from the repo root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, Mutex, OnceLock};
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{Batch, Context, ContextParams, Exec, Model};

/// The fixture's context (256 positions, f16 cache), made once; its file read, not mapped (see
/// `tandem_fuzz`).
fn context() -> &'static Mutex<Context> {
    static C: OnceLock<Mutex<Context>> = OnceLock::new();
    C.get_or_init(|| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/models/llama-tiny.gguf");
        let g = GgufModel::open(path, LoadOptions { mmap: false, ..LoadOptions::default() }).expect("the fixture");
        let model = Arc::new(Model::load(Arc::new(g)).expect("the fixture model"));
        let threads = tandem_cpu::Threads::new(1, 1).expect("a pool");
        let params = ContextParams { n_ctx: 256, ..ContextParams::default() };
        Mutex::new(Context::new(model, Exec::cpu(threads), params).expect("a context"))
    })
}

fuzz_target!(|data: &[u8]| {
    let mut ctx = context().lock().unwrap_or_else(|e| e.into_inner());
    ctx.truncate(1, 0);
    ctx.decode(&Batch::sequence(&[1, 2, 3], 0, 1, false)).expect("three tokens");
    match ctx.restore_from(1, data, data.len() as u64, "fuzz.slot") {
        Ok((tokens, read)) => assert!(ctx.seq_len(1) == tokens.len() && read == data.len() as u64),
        Err(e) => {
            let n = ctx.seq_len(1);
            assert!(n == 3 || n == 0, "{n} rows left: {e}");
            assert!(!e.to_string().contains('\n'), "{e}");
        }
    }
});
