//! Thread pools: one for single-token steps (`-t`) and one for batches (`-tb`), as llama.cpp.

use crate::{Error, Result};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The two pools. Cloning shares them.
#[derive(Clone)]
pub struct Threads {
    decode: Arc<rayon::ThreadPool>,
    batch: Arc<rayon::ThreadPool>,
    /// How long the threads of a step poll without work before they sleep ([`IDLE_LIMIT`]).
    idle_limit: Duration,
    /// What the loops of the last single-token step read first, per thread ([`Forecast`]).
    forecast: Arc<Forecast>,
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
        let forecast = Arc::new(Forecast::new(decode.max(1)));
        Ok(Threads { decode: decode_pool, batch: batch_pool, idle_limit: IDLE_LIMIT, forecast })
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
    /// the pool's other threads stay awake for the step's parallel work: each polls for it (the
    /// step's [`for_each_piece`] loops, and rayon's `yield_now`) until `f` returns, instead of
    /// falling asleep in the short serial
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
        let forecast = (n_tokens <= 1 && self.forecast.lanes == pool.current_num_threads()).then_some(&*self.forecast);
        let team = Team::new(pool, self.idle_limit, forecast);
        pool.broadcast(|ctx| {
            if ctx.index() == 0 {
                // Set even if `f` panics (rayon passes the panic on once every thread is back).
                let _done = SetOnDrop(&done);
                if let Some(f) = step.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    let _lead = Lead::set(&team);
                    let r = f();
                    *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                }
            } else {
                team.polling.fetch_add(1, Ordering::SeqCst);
                poll_until(&done, &team, ctx.index());
                team.polling.fetch_sub(1, Ordering::SeqCst);
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

/// Runs the step's pending work (the loops of `team`, and rayon's jobs) as it appears until
/// `done`: polls with a short pause while work keeps coming, then gives the core away between
/// polls (`sched_yield`), and once none has come for the team's idle limit ([`IDLE_LIMIT`])
/// returns to rayon's idle loop (which sleeps until rayon has work for it; the step's loops then
/// go through rayon, which wakes it):
/// with other jobs on the cores, a thread that kept polling took the forward thread's share of
/// them (2-thread decode beside two busy processes: 11-12 t/s polling against 12-23 t/s asleep).
fn poll_until(done: &AtomicBool, team: &Team, lane: usize) {
    let mut idle = 0u32;
    let mut since: Option<Instant> = None;
    let mut seen = 0u64;
    let mut ahead = Ahead::default();
    while !done.load(Ordering::Acquire) {
        if team.join(&mut seen, lane) || matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
            idle = 0;
            since = None;
            continue;
        }
        if ahead.step(team, team.loops.load(Ordering::Acquire), lane) {
            continue;
        }
        idle = idle.saturating_add(1);
        if idle < 64 {
            for _ in 0..8 {
                std::hint::spin_loop();
            }
        } else if since.get_or_insert_with(Instant::now).elapsed() < team.idle_limit {
            std::thread::yield_now();
        } else {
            return;
        }
    }
}

/// The threads of one [`Threads::run_step`]: its first thread hands the step's parallel loops
/// ([`for_each_piece`]) to the polling threads through a few shared counters, without rayon's
/// task splitting and stealing. On the 2-vCPU Intel machine of docs/perf/HISTORY.md a loop of 32
/// pieces took 2-10 us more than its work through rayon and mostly 0.3-3 us through counters.
struct Team<'f> {
    pool: *const rayon::ThreadPool,
    /// Bit 0: a loop is open to join; bits 1..17: threads that joined it; above: its number.
    ctl: Padded<AtomicU64>,
    /// Per thread of the pool, the next piece of its own run of the loop: thread `k` takes
    /// pieces `k n / T ..` in order, then what is left of the others' runs. Each thread thus
    /// streams its own contiguous part of the weights, as rayon's halving gave them.
    next: Box<[Padded<AtomicUsize>]>,
    /// Threads that joined the loop and have finished their share of it.
    left: Padded<AtomicUsize>,
    /// The open loop: a `*const Loop` on the first thread's stack.
    job: AtomicPtr<()>,
    /// Threads of the pool in [`poll_until`] for this step.
    polling: AtomicUsize,
    /// The first panic of a piece run by a joined thread.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// [`Threads::idle_limit`].
    idle_limit: Duration,
    /// Loops opened so far in this step.
    loops: AtomicUsize,
    /// Single-token steps only: where each thread's run of each loop started last time.
    forecast: Option<&'f Forecast>,
}

// SAFETY: `pool` is only compared, never dereferenced; `job` is read only by threads that joined
// the loop it points to, which the first thread waits for before the loop goes out of scope.
unsafe impl Sync for Team<'_> {}

#[repr(align(128))]
struct Padded<T>(T);

const OPEN: u64 = 1;
const JOINED: u64 = 2;
const GEN: u64 = 1 << 17;

/// One parallel loop: `f(i)` for every `i < n`.
struct Loop<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    /// The address and length of the weights piece `i` reads, where the loop streams weights.
    bytes: Option<&'a (dyn Fn(usize) -> (usize, usize) + Sync)>,
}

impl<'f> Team<'f> {
    fn new(pool: &rayon::ThreadPool, idle_limit: Duration, forecast: Option<&'f Forecast>) -> Team<'f> {
        Team {
            pool,
            ctl: Padded(AtomicU64::new(0)),
            next: (0..pool.current_num_threads().max(1)).map(|_| Padded(AtomicUsize::new(0))).collect(),
            left: Padded(AtomicUsize::new(0)),
            job: AtomicPtr::new(std::ptr::null_mut()),
            polling: AtomicUsize::new(0),
            panic: Mutex::new(None),
            idle_limit,
            loops: AtomicUsize::new(0),
            forecast,
        }
    }

    /// Joins the open loop if this thread has not joined it yet (`seen`: the last loop it
    /// joined), and takes pieces until none is left. Whether it joined one.
    fn join(&self, seen: &mut u64, lane: usize) -> bool {
        let c = self.ctl.0.load(Ordering::Acquire);
        if c & OPEN == 0 || c / GEN == *seen {
            return false;
        }
        if self.ctl.0.compare_exchange(c, c + JOINED, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return false;
        }
        *seen = c / GEN;
        // SAFETY: joined while the loop was open, so the first thread keeps it alive until this
        // thread counts itself out in `left` below.
        let job = unsafe { &*(self.job.load(Ordering::Acquire) as *const Loop) };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.take(job, lane)));
        if let Err(e) = r {
            self.stop();
            self.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
        }
        self.left.0.fetch_add(1, Ordering::Release);
        true
    }

    /// Runs pieces of `job` until none is left, first those of run `lane`.
    fn take(&self, job: &Loop, lane: usize) {
        let t = self.next.len();
        for k in 0..t {
            let j = (lane + k) % t;
            let end = (j + 1) * job.n / t;
            loop {
                let i = self.next[j].0.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    break;
                }
                (job.f)(i);
            }
        }
    }

    /// Leaves no piece to take (after a panic).
    fn stop(&self) {
        for n in self.next.iter() {
            n.0.store(usize::MAX / 2, Ordering::Relaxed);
        }
    }

    /// Runs `job` on this thread and on every polling thread that joins it; returns when every
    /// piece has run. Called by the step's first thread only.
    fn run(&self, job: &Loop) {
        let t = self.next.len();
        for (j, n) in self.next.iter().enumerate() {
            n.0.store(j * job.n / t, Ordering::Relaxed);
        }
        let idx = self.loops.load(Ordering::Relaxed);
        if let Some(fc) = self.forecast {
            fc.record(idx, job);
        }
        self.loops.store(idx + 1, Ordering::Release);
        self.left.0.store(0, Ordering::Relaxed);
        self.job.store(job as *const Loop as *mut (), Ordering::Relaxed);
        let c = self.ctl.0.load(Ordering::Relaxed);
        self.ctl.0.store(((c / GEN + 1) * GEN) | OPEN, Ordering::Release);
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.take(job, 0)));
        if mine.is_err() {
            self.stop();
        }
        // Closed: no thread joins any more; wait for those that did.
        let joined = ((self.ctl.0.fetch_and(!OPEN, Ordering::AcqRel) & (GEN - 1)) / JOINED) as usize;
        let mut ahead = Ahead::default();
        while self.left.0.load(Ordering::Acquire) < joined {
            if !ahead.step(self, idx + 1, 0) {
                std::hint::spin_loop();
            }
        }
        self.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        if let Err(e) = mine {
            std::panic::resume_unwind(e);
        }
        if let Some(e) = self.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::panic::resume_unwind(e);
        }
    }
}

/// Loops of a single-token step a forecast covers.
const FORECAST_LOOPS: usize = 1024;
/// Bytes of a thread's run a forecast asks for at most.
const FORECAST_BYTES: usize = 256 << 10;

/// For each loop of a single-token step (by its number in the step) and each thread: the weight
/// bytes its run started with last time, and whether they were the same as the time before. The
/// steps of a decode run the same products in the same order (all but the routed experts), so a
/// thread that waits (the serial parts of a step, the tail of a loop) asks for the start of its
/// next run meanwhile (`prefetcht1`, into its L2), when that start was the same the last two
/// times (so not for the routed experts), or when the step announced it ([`announce`]: a MoE
/// layer's down products once its router has chosen). A single token's step is bound by how
/// fast the weights stream, and the memory idles while one thread works alone. On the 2-vCPU
/// Intel machine of docs/perf/HISTORY.md the threads fetched ~9.6 MiB of a decoded token's 367
/// MiB this way and decode was 1.1-1.8% faster (alternating token by token); 512 KiB or 1 MiB
/// per run instead of 256 KiB, or the unstable loops too, were no better.
struct Forecast {
    lanes: usize,
    /// `[loop][lane]`: address, length, stable (1) or not (0).
    table: Box<[[AtomicUsize; 3]]>,
}

impl Forecast {
    fn new(lanes: usize) -> Forecast {
        Forecast { lanes, table: (0..FORECAST_LOOPS * lanes).map(|_| Default::default()).collect() }
    }

    /// Notes where each thread's run of loop `idx` starts.
    fn record(&self, idx: usize, job: &Loop) {
        self.note(idx, job.n, job.bytes, false);
    }

    /// Notes where each thread's run of loop `idx` of `n` pieces, piece `i` reading `bytes(i)`,
    /// starts; stable at once when `sure` (announced by the step itself).
    fn note(&self, idx: usize, n: usize, bytes: Option<&(dyn Fn(usize) -> (usize, usize) + Sync)>, sure: bool) {
        if idx >= FORECAST_LOOPS {
            return;
        }
        let t = self.lanes;
        for lane in 0..t {
            let (mut at, mut len) = (0, 0);
            if let Some(bytes) = bytes {
                let first = lane * n / t;
                let end = (lane + 1) * n / t;
                (at, len) = if first < end { bytes(first) } else { (0, 0) };
                let mut i = first + 1;
                while i < end && len < FORECAST_BYTES {
                    let (a, l) = bytes(i);
                    if a != at + len {
                        break;
                    }
                    len += l;
                    i += 1;
                }
                len = len.min(FORECAST_BYTES);
            }
            let e = &self.table[idx * t + lane];
            let same = e[0].load(Ordering::Relaxed) == at && e[1].load(Ordering::Relaxed) == len;
            e[0].store(at, Ordering::Relaxed);
            e[1].store(len, Ordering::Relaxed);
            e[2].store((same || sure) as usize, Ordering::Release);
        }
    }

    /// Lane `lane`'s start of loop `idx`, if it was the same the last two times.
    fn get(&self, idx: usize, lane: usize) -> Option<(usize, usize)> {
        if idx >= FORECAST_LOOPS || lane >= self.lanes {
            return None;
        }
        let e = &self.table[idx * self.lanes + lane];
        let (at, len) = (e[0].load(Ordering::Relaxed), e[1].load(Ordering::Relaxed));
        (e[2].load(Ordering::Acquire) == 1 && len > 0).then_some((at, len))
    }
}

/// A waiting thread's progress through the forecast of the next loop.
#[derive(Default)]
struct Ahead {
    idx: usize,
    done: usize,
}

impl Ahead {
    /// Asks for the next kilobyte of this thread's forecast run of loop `idx`; false when there is
    /// none left to ask for.
    fn step(&mut self, team: &Team, idx: usize, lane: usize) -> bool {
        let Some(fc) = team.forecast else { return false };
        if idx != self.idx {
            *self = Ahead { idx, done: 0 };
        }
        let Some((at, len)) = fc.get(idx, lane) else { return false };
        if self.done >= len {
            return false;
        }
        let n = (len - self.done).min(1024);
        #[cfg(target_arch = "x86_64")]
        crate::prefetch::prefetch_stream_as::<{ crate::prefetch::PF_T1 }>((at + self.done) as *const u8, n);
        #[cfg(not(target_arch = "x86_64"))]
        {
            // No prefetch instruction here: nothing to ask for.
            let _ = (at, n);
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            self.done += n;
            true
        }
    }
}

thread_local! {
    /// The team this thread leads (it runs a step's `f` in [`Threads::run_step`]), if any.
    static LEAD: Cell<*const Team<'static>> = const { Cell::new(std::ptr::null()) };
}

/// Marks the current thread as the leader of `team` until dropped.
struct Lead(*const Team<'static>);

impl Lead {
    fn set(team: &Team) -> Lead {
        // The lifetime is erased: the pointer is only used while `team` lives (see `LEAD`).
        Lead(LEAD.with(|l| l.replace((team as *const Team).cast::<Team<'static>>())))
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        LEAD.with(|l| l.set(self.0));
    }
}

/// Runs `f(i)` for every `i < n` in parallel over `pool`: through the step's team when the
/// calling thread leads a [`Threads::run_step`] of `pool` and all the pool's other threads are
/// polling for work and it runs no other loop, else through rayon. Each `i` runs exactly once; a
/// panic of a piece is passed on to the caller once every piece has stopped.
pub(crate) fn for_each_piece(pool: &rayon::ThreadPool, n: usize, f: &(dyn Fn(usize) + Sync)) {
    for_each_piece_reading(pool, n, f, None)
}

/// [`for_each_piece`] for a loop whose piece `i` streams the weight bytes `bytes(i)` (address,
/// length): in a single-token step the threads fetch the start of their run of it ahead of time
/// when they wait in the step that follows ([`Forecast`]).
pub(crate) fn for_each_piece_reading(
    pool: &rayon::ThreadPool,
    n: usize,
    f: &(dyn Fn(usize) + Sync),
    bytes: Option<&(dyn Fn(usize) -> (usize, usize) + Sync)>,
) {
    let lead = LEAD.with(|l| l.get());
    if !lead.is_null() {
        // SAFETY: set by `Lead` while the team lives (in `run_step`'s frame) on this thread.
        let team = unsafe { &*lead };
        // Not from inside one of its own loops (the team runs one at a time).
        if std::ptr::eq(team.pool, pool)
            && team.ctl.0.load(Ordering::Relaxed) & OPEN == 0
            && team.polling.load(Ordering::Relaxed) + 1 >= pool.current_num_threads()
        {
            team.run(&Loop { f, n, bytes });
            return;
        }
    }
    use rayon::prelude::*;
    pool.install(|| (0..n).into_par_iter().with_max_len(1).for_each(f));
}

/// Tells the threads of the single-token step this thread leads on `pool` what loop number
/// `ahead` after the next one opens will stream: `n` pieces, piece `i` reading the weight bytes
/// `bytes(i)` (address, length), cut over the threads as [`Team::run`] cuts them. A waiting
/// thread then fetches the start of its run of it as soon as the loop before it is the open or
/// last one ([`Forecast`]). Elsewhere it does nothing.
pub(crate) fn announce(
    pool: &rayon::ThreadPool,
    ahead: usize,
    n: usize,
    bytes: &(dyn Fn(usize) -> (usize, usize) + Sync),
) {
    let lead = LEAD.with(|l| l.get());
    if lead.is_null() {
        return;
    }
    // SAFETY: set by `Lead` while the team lives (in `run_step`'s frame) on this thread.
    let team = unsafe { &*lead };
    if let (true, Some(fc)) = (std::ptr::eq(team.pool, pool), team.forecast) {
        fc.note(team.loops.load(Ordering::Relaxed) + ahead, n, Some(bytes), true);
    }
}

/// `n` zeros, written by the threads of `pool` when they are more than a few MB (the outputs of a
/// prefill's products and rebuilt keys, tens of MB a layer: zeroed by one thread, the others
/// waited).
pub(crate) fn zeros(pool: &rayon::ThreadPool, n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    // Below this, a hand-off costs more than the writes.
    const PAR_ZEROS: usize = 1 << 18;
    if n < PAR_ZEROS || pool.current_num_threads() < 2 {
        return vec![0f32; n];
    }
    let mut v = Vec::new();
    pool.install(|| (0..n).into_par_iter().with_min_len(PAR_ZEROS / 4).map(|_| 0f32).collect_into_vec(&mut v));
    v
}

/// [`for_each_piece`] over owned items: `f(item)` for each of `items`, in parallel over `pool`.
pub(crate) fn for_each_item<T: Send>(pool: &rayon::ThreadPool, items: Vec<T>, f: &(dyn Fn(T) + Sync)) {
    let cells: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    for_each_piece(pool, cells.len(), &|i| {
        if let Some(t) = cells[i].lock().unwrap_or_else(|e| e.into_inner()).take() {
            f(t)
        }
    });
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
    fn zeros_are_zeros_at_every_size() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for n in [0, 5, (1 << 18) - 1, 1 << 18, (1 << 20) + 3] {
            let z = zeros(&pool, n);
            assert_eq!(z.len(), n);
            assert!(z.iter().all(|&v| v.to_bits() == 0), "{n}");
        }
    }

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

    /// Inside a step of `threads`: the team this thread leads, once all the pool's other threads
    /// poll for its loops (they may not run at once on a busy machine).
    fn team_polling(threads: &Threads) -> &'static Team<'static> {
        let lead = LEAD.with(|l| l.get());
        assert!(!lead.is_null(), "the step's first thread leads a team");
        // SAFETY: the team outlives the step this runs in; the reference does not leave it.
        let team = unsafe { &*lead };
        let t0 = Instant::now();
        while team.polling.load(Ordering::SeqCst) + 1 < threads.decode_threads() {
            assert!(t0.elapsed() < Duration::from_secs(60), "the step's threads never all polled");
            std::thread::yield_now();
        }
        team
    }

    /// Threads whose steps keep polling for work for a minute: a test's step never loses them.
    fn patient(t: usize) -> Threads {
        Threads { idle_limit: Duration::from_secs(60), ..Threads::new(t, t).unwrap() }
    }

    #[test]
    fn a_step_s_loops_run_each_piece_once_on_every_thread() {
        for t in [2, 3] {
            let threads = patient(t);
            let pool = threads.for_tokens(1);
            threads.run_step(1, || {
                let team = team_polling(&threads);
                for n in [1usize, 2, 3, 50, 1000] {
                    let before = team.ctl.0.load(Ordering::SeqCst) / GEN;
                    let runs: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    let started = AtomicUsize::new(0);
                    let wait = n == 3 || n == 50;
                    for_each_piece(pool, n, &|i| {
                        runs[i].fetch_add(1, Ordering::SeqCst);
                        // The first piece of each thread's run waits for the others to start
                        // theirs: all start only if all the threads take part at once.
                        if wait && (0..t).any(|j| i == j * n / t) {
                            started.fetch_add(1, Ordering::SeqCst);
                            let t0 = Instant::now();
                            while started.load(Ordering::SeqCst) < t && t0.elapsed() < Duration::from_secs(60) {
                                std::thread::yield_now();
                            }
                        }
                    });
                    assert!(
                        runs.iter().all(|r| r.load(Ordering::SeqCst) == 1),
                        "{t} threads, {n} pieces: each ran once"
                    );
                    assert_eq!(team.ctl.0.load(Ordering::SeqCst) / GEN, before + 1, "the loop went through the team");
                    if wait {
                        assert_eq!(started.load(Ordering::SeqCst), t, "{t} threads, {n} pieces: all took part");
                    }
                }
            });
        }
    }

    #[test]
    fn a_forecast_gives_each_thread_s_run_start_once_it_repeats() {
        let fc = Forecast::new(2);
        let base = 1usize << 40;
        let contiguous = move |i: usize| (base + i * 100_000, 100_000);
        let with_gaps = move |i: usize| (base + i * 200_000, 100_000);
        let f = |_: usize| {};
        let job = |bytes: &'static (dyn Fn(usize) -> (usize, usize) + Sync)| Loop { f: &f, n: 8, bytes: Some(bytes) };
        let contiguous: &'static (dyn Fn(usize) -> (usize, usize) + Sync) = Box::leak(Box::new(contiguous));
        let with_gaps: &'static (dyn Fn(usize) -> (usize, usize) + Sync) = Box::leak(Box::new(with_gaps));
        fc.record(3, &job(contiguous));
        assert_eq!(fc.get(3, 0), None, "seen once: not yet a forecast");
        fc.record(3, &job(contiguous));
        // Lane 0 runs pieces 0..4, lane 1 pieces 4..8: 400,000 contiguous bytes each, capped.
        assert_eq!(fc.get(3, 0), Some((base, FORECAST_BYTES)));
        assert_eq!(fc.get(3, 1), Some((base + 400_000, FORECAST_BYTES)));
        assert_eq!(fc.get(2, 0), None, "another loop");
        fc.record(3, &job(with_gaps));
        assert_eq!(fc.get(3, 0), None, "changed: no forecast");
        fc.record(3, &job(with_gaps));
        assert_eq!(fc.get(3, 1), Some((base + 800_000, 100_000)), "up to the first gap");
        fc.record(3, &Loop { f: &f, n: 8, bytes: None });
        fc.record(3, &Loop { f: &f, n: 8, bytes: None });
        assert_eq!(fc.get(3, 0), None, "a loop that streams no weights");
        fc.record(FORECAST_LOOPS, &job(contiguous));
        assert_eq!(fc.get(FORECAST_LOOPS, 0), None);
        assert_eq!(fc.get(3, 2), None, "no such thread");

        // A waiting thread asks for its forecast run a kilobyte at a time, once.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let buf = vec![0u8; 10_000];
        let at = |i: usize| (buf.as_ptr() as usize + i * 2500, 2500);
        let stream = Loop { f: &f, n: 4, bytes: Some(&at) };
        fc.record(5, &stream);
        fc.record(5, &stream);
        let team = Team::new(&pool, IDLE_LIMIT, Some(&fc));
        let mut ahead = Ahead::default();
        if !cfg!(target_arch = "x86_64") {
            assert!(!ahead.step(&team, 5, 1), "no prefetch instruction: nothing is asked for");
            return;
        }
        let mut asks = 0;
        while ahead.step(&team, 5, 1) {
            asks += 1;
            assert!(asks <= 5, "5,000 bytes take five asks");
        }
        assert_eq!(asks, 5);
        assert!(!ahead.step(&team, 5, 1), "asked once");
        assert!(!ahead.step(&team, 4, 1), "nothing forecast for loop 4");
        assert!(ahead.step(&team, 5, 0), "back to loop 5, lane 0: from its start");
        assert!(!Ahead::default().step(&Team::new(&pool, IDLE_LIMIT, None), 5, 1), "no forecast in batch steps");
    }

    #[test]
    fn single_token_steps_note_their_loops_runs_and_batch_steps_do_not() {
        let threads = patient(2);
        let pool = threads.for_tokens(1);
        let buf = vec![0u8; 1 << 20];
        let bytes = |i: usize| (buf.as_ptr() as usize + i * 4096, 4096);
        let run = |n_tokens: usize| {
            threads.run_step(n_tokens, || {
                team_polling(&threads);
                for _ in 0..2 {
                    for_each_piece(pool, 10, &|_| {});
                    for_each_piece_reading(pool, 32, &|_| {}, Some(&bytes));
                }
            })
        };
        run(2);
        run(2);
        assert!((0..4).all(|idx| threads.forecast.get(idx, 0).is_none()), "a batch step leaves no forecast");
        run(1);
        run(1);
        let start = buf.as_ptr() as usize;
        for idx in [1, 3] {
            assert_eq!(threads.forecast.get(idx, 0), Some((start, 16 * 4096)), "loop {idx}, lane 0");
            assert_eq!(threads.forecast.get(idx, 1), Some((start + 16 * 4096, 16 * 4096)), "loop {idx}, lane 1");
        }
        assert_eq!(threads.forecast.get(0, 0), None, "loop 0 streams no weights");

        // A step announces what the loop after the next one reads: a forecast at once, for the
        // loop number it will have.
        let other = vec![0u8; 1 << 20];
        let later = |i: usize| (other.as_ptr() as usize + i * 8192, 8192);
        threads.run_step(1, || {
            team_polling(&threads);
            for_each_piece(pool, 10, &|_| {});
            announce(pool, 1, 8, &later);
        });
        let at = other.as_ptr() as usize;
        assert_eq!(threads.forecast.get(2, 0), Some((at, 4 * 8192)), "announced for loop 2, lane 0");
        assert_eq!(threads.forecast.get(2, 1), Some((at + 4 * 8192, 4 * 8192)), "announced for loop 2, lane 1");
        threads.run_step(2, || announce(pool, 0, 8, &bytes));
        assert_eq!(threads.forecast.get(0, 0), None, "not from a batch step");
    }

    #[test]
    fn a_panicking_piece_is_passed_on_after_the_loop_and_loops_nest() {
        let threads = patient(2);
        let pool = threads.for_tokens(1);
        threads.run_step(1, || {
            team_polling(&threads);
            // Piece 0 runs on this thread, the last piece on the other one first.
            for bad in [0usize, 99] {
                let ran = AtomicUsize::new(0);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    for_each_piece(pool, 100, &|i| {
                        ran.fetch_add(1, Ordering::SeqCst);
                        if i == bad {
                            panic!("piece {i} failed");
                        }
                    })
                }));
                let msg = r.expect_err("the panic is passed on");
                assert_eq!(
                    msg.downcast_ref::<String>().map(String::as_str),
                    Some(format!("piece {bad} failed").as_str())
                );
                assert!(ran.load(Ordering::SeqCst) <= 100);
                let sum = AtomicUsize::new(0);
                for_each_piece(pool, 100, &|i| {
                    sum.fetch_add(i, Ordering::SeqCst);
                });
                assert_eq!(sum.load(Ordering::SeqCst), 4950, "the next loop runs whole");
            }
            // A loop inside a loop's piece (through rayon).
            let count = AtomicUsize::new(0);
            for_each_piece(pool, 4, &|_| {
                for_each_piece(pool, 3, &|_| {
                    count.fetch_add(1, Ordering::SeqCst);
                })
            });
            assert_eq!(count.load(Ordering::SeqCst), 12);
        });
    }
}
