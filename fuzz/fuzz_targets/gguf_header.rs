//! Any byte string given to the GGUF parser yields a file or an error: never a panic, an abort
//! or an allocation beyond the input. Run: `cargo +nightly fuzz run gguf_header` from the repo root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = GgufFile::from_bytes(data.to_vec(), "fuzz.gguf") {
        // Every tensor view the parser accepted must lie inside the buffer.
        for t in f.tensors() {
            let d = f.tensor_data(&t.name).expect("listed tensor");
            assert_eq!(d.len() as u64, t.size);
        }
        let _ = f.metadata().get_u32("general.alignment");
    }
});
