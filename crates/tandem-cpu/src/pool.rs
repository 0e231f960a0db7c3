//! Thread pools: one for single-token steps (`-t`) and one for batches (`-tb`), as llama.cpp.

use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

    /// Runs `f`, one forward step of `n_tokens` tokens, on the first thread of their pool while
    /// the pool's other threads stay awake for the step's parallel work: each polls for it
    /// (rayon's `yield_now`) until `f` returns, instead of falling asleep in the short serial
    /// parts between two ops (norms, routing, a small product) and being woken for the next. A
    /// decode step runs a few hundred parallel ops; a rayon worker woken from sleep took 35-90 µs
    /// to join one. Called from inside the pool, `f` just runs.
    pub fn run_step<R: Send>(&self, n_tokens: usize, f: impl FnOnce() -> R + Send) -> R {
        let pool = self.for_tokens(n_tokens);
        if pool.current_num_threads() <= 1 || pool.current_thread_index().is_some() {
            return pool.install(f);
        }
        let done = AtomicBool::new(false);
        let step = Mutex::new(Some(f));
        let out = Mutex::new(None);
        pool.broadcast(|ctx| {
            if ctx.index() == 0 {
                // Set even if `f` panics (rayon passes the panic on once every thread is back).
                let _done = SetOnDrop(&done);
                if let Some(f) = step.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    let r = f();
                    *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                }
            } else {
                poll_until(&done);
            }
        });
        match out.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(r) => r,
            None => unreachable!("broadcast runs its job on thread 0 of the pool"),
        }
    }

    pub fn decode_threads(&self) -> usize {
        self.decode.current_num_threads()
    }

    pub fn batch_threads(&self) -> usize {
        self.batch.current_num_threads()
    }
}

struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs the pool's pending work as it appears until `done`: polls with a short pause while work
/// keeps coming, then gives the core away between polls (`sched_yield`), and once none has come
/// for [`IDLE_LIMIT`] returns to rayon's idle loop (which sleeps until rayon has work for it):
/// with other jobs on the cores, a thread that kept polling took the forward thread's share of
/// them (2-thread decode beside two busy processes: 11-12 t/s polling against 12-23 t/s asleep).
fn poll_until(done: &AtomicBool) {
    let mut idle = 0u32;
    let mut since: Option<Instant> = None;
    while !done.load(Ordering::Acquire) {
        if let Some(rayon::Yield::Executed) = rayon::yield_now() {
            idle = 0;
            since = None;
            continue;
        }
        idle = idle.saturating_add(1);
        if idle < 64 {
            for _ in 0..8 {
                std::hint::spin_loop();
            }
        } else if since.get_or_insert_with(Instant::now).elapsed() < IDLE_LIMIT {
            std::thread::yield_now();
        } else {
            return;
        }
    }
}

/// How long a thread of [`Threads::run_step`] waits for work before it goes back to sleeping: far
/// longer than the serial parts of a step on a quiet machine (under 50 us), far shorter than the
/// time slice another process takes from the forward thread.
const IDLE_LIMIT: Duration = Duration::from_micros(300);

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_step_runs_in_the_pool_with_every_thread_taking_work() {
        let threads = Threads::new(3, 3).unwrap();
        let (started, ran) = (AtomicUsize::new(0), Mutex::new(Vec::new()));
        let out = threads.run_step(1, || {
            assert!(threads.for_tokens(1).current_thread_index().is_some(), "the step runs on a pool thread");
            // Three pieces that each wait for the other two to start: done only if all three
            // threads of the pool take one at the same time. The second time after a serial
            // part longer than the waiting threads poll: rayon wakes them.
            for round in 1..=2 {
                if round == 2 {
                    let t0 = Instant::now();
                    while t0.elapsed() < 3 * IDLE_LIMIT {
                        std::hint::spin_loop();
                    }
                }
                (0..3).into_par_iter().with_max_len(1).for_each(|_| {
                    started.fetch_add(1, Ordering::SeqCst);
                    let t0 = Instant::now();
                    while started.load(Ordering::SeqCst) < 3 * round && t0.elapsed() < Duration::from_secs(20) {
                        std::hint::spin_loop();
                    }
                    ran.lock().unwrap().push(rayon::current_thread_index());
                });
            }
            // A nested step just runs.
            threads.run_step(1, || (0..1000u64).into_par_iter().sum::<u64>())
        });
        assert_eq!(out, 499_500);
        assert_eq!(started.load(Ordering::SeqCst), 6);
        let ran = ran.into_inner().unwrap();
        for round in ran.chunks(3) {
            let mut r = round.to_vec();
            r.sort();
            assert_eq!(r, vec![Some(0), Some(1), Some(2)], "each piece on its own thread");
        }
        // One thread: no waiting threads at all.
        let one = Threads::new(1, 1).unwrap();
        assert_eq!(one.run_step(1, rayon::current_thread_index), Some(0));
    }

    #[test]
    fn a_panicking_step_releases_the_waiting_threads() {
        let threads = Threads::new(2, 2).unwrap();
        let r =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| threads.run_step(1, || panic!("step failed"))));
        assert!(r.is_err());
        // The pool is whole: the next step runs and uses both threads.
        assert_eq!(threads.run_step(1, || (1..=100u32).into_par_iter().sum::<u32>()), 5050);
    }
}
