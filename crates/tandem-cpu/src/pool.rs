//! Thread pools: one for single-token steps (`-t`) and one for batches (`-tb`), as llama.cpp.

use crate::{Error, Result};
use std::sync::Arc;

/// The two pools. Cloning shares them.
#[derive(Clone)]
pub struct Threads {
    decode: Arc<rayon::ThreadPool>,
    batch: Arc<rayon::ThreadPool>,
}

impl std::fmt::Debug for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Threads(decode {}, batch {})", self.decode.current_num_threads(), self.batch.current_num_threads())
    }
}

fn pool(threads: usize) -> Result<Arc<rayon::ThreadPool>> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("tandem-cpu-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| Error::Pool { threads, msg: e.to_string() })
}

impl Threads {
    /// `decode` threads for single-token steps, `batch` threads for batches of tokens.
    pub fn new(decode: usize, batch: usize) -> Result<Threads> {
        let decode_pool = pool(decode.max(1))?;
        let batch_pool = if batch.max(1) == decode.max(1) { decode_pool.clone() } else { pool(batch.max(1))? };
        Ok(Threads { decode: decode_pool, batch: batch_pool })
    }

    /// The pool for a step of `n_tokens` tokens.
    pub fn for_tokens(&self, n_tokens: usize) -> &rayon::ThreadPool {
        if n_tokens <= 1 {
            &self.decode
        } else {
            &self.batch
        }
    }

    pub fn decode_threads(&self) -> usize {
        self.decode.current_num_threads()
    }

    pub fn batch_threads(&self) -> usize {
        self.batch.current_num_threads()
    }
}
