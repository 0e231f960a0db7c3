//! Writes the header-only, sparse Kimi-K2.5 replica (13 shards) for planning by hand:
//!
//! ```sh
//! cargo run -p tandem-plan --example gen_kimi_replica -- /tmp/kimi Q4_K_M
//! tandem plan -m /tmp/kimi/Kimi-K2.5-Q4_K_M-00001-of-00013.gguf -ngl 999 -ot exps=CPU --gpu CUDA0=96GiB
//! ```
//!
//! The files claim about 600 GB each but hold only their headers (a few MB on a filesystem with
//! sparse files). Tests generate the same files into a temporary directory instead.

use std::path::PathBuf;
use tandem_plan::quant_mix::Ftype;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, ftype) = match args.as_slice() {
        [dir] => (PathBuf::from(dir), Ftype::Q4_K_M),
        [dir, f] if f.eq_ignore_ascii_case("q4_k_m") => (PathBuf::from(dir), Ftype::Q4_K_M),
        [dir, f] if f.eq_ignore_ascii_case("q4_k_s") => (PathBuf::from(dir), Ftype::Q4_K_S),
        _ => return Err("usage: gen_kimi_replica DIR [Q4_K_M|Q4_K_S]".into()),
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let first = tandem_plan::replica::write_kimi_k25(&dir, ftype).map_err(|e| e.to_string())?;
    println!("{}", first.display());
    Ok(())
}
