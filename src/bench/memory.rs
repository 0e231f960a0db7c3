//! What `tandem bench` measures of the machine: the weight bytes a decoded token reads and the
//! memory read bandwidth, for the decode roofline.

use super::{GIB, MIB};
use anyhow::bail;
use indicatif::ProgressBar;
use std::collections::BTreeMap;
use std::time::Instant;
use tandem_gguf::{GgufModel, TensorRef};

/// Timed passes over the bandwidth buffer per thread count; the best one counts.
pub(super) const BANDWIDTH_RUNS: usize = 3;
/// The bandwidth buffer is at least this many times the machine's total L3 cache.
const L3_FACTOR: u64 = 4;

/// Bytes of weights one single-token decode step reads: every tensor the forward pass uses, one row
/// of `token_embd` (unless it doubles as the output head), and `expert_used_count / expert_count`
/// of each routed-expert (`_exps`) tensor.
pub fn active_bytes_per_token(gguf: &GgufModel) -> anyhow::Result<u64> {
    let md = gguf.metadata();
    let arch = md.get_str("general.architecture")?;
    let n_expert = md.opt_u32(&format!("{arch}.expert_count"))?.unwrap_or(0) as u64;
    let n_used = md.opt_u32(&format!("{arch}.expert_used_count"))?.unwrap_or(0) as u64;
    let tied_output = gguf.tensor("output.weight").is_none();
    let mut total = 0u64;
    for t in gguf.tensors() {
        let TensorRef { info, .. } = t;
        // DeepSeek V3's multi-token-prediction layer is not run when decoding.
        if info.name.contains(".nextn.") {
            continue;
        }
        total += if info.name == "token_embd.weight" && !tied_output {
            let rows = (info.n_elements() / info.dims.first().copied().unwrap_or(1).max(1)).max(1);
            info.size / rows
        } else if info.name.contains("_exps") {
            if n_expert == 0 || n_used > n_expert {
                bail!("{}: routed-expert tensor, but {arch}.expert_count is {n_expert} and {arch}.expert_used_count {n_used}", info.name);
            }
            info.size / n_expert * n_used
        } else {
            info.size
        };
    }
    Ok(total)
}

/// Total L3 cache of the machine in bytes (each distinct L3 counted once), 0 when unknown.
pub(super) fn total_l3_bytes() -> u64 {
    let mut seen = std::collections::BTreeSet::new();
    let mut total = 0;
    let Ok(cpus) = std::fs::read_dir("/sys/devices/system/cpu") else { return 0 };
    for cpu in cpus.flatten() {
        let dir = cpu.path().join("cache/index3");
        let (Ok(size), Ok(shared)) =
            (std::fs::read_to_string(dir.join("size")), std::fs::read_to_string(dir.join("shared_cpu_list")))
        else {
            continue;
        };
        if seen.insert(shared.trim().to_string()) {
            let s = size.trim();
            total += match s.strip_suffix('K') {
                Some(k) => k.parse::<u64>().unwrap_or(0) * 1024,
                None => s.strip_suffix('M').and_then(|m| m.parse::<u64>().ok()).map_or(0, |m| m * MIB),
            };
        }
    }
    total
}

/// 1 GiB or 4 x the total L3, whichever is larger, but at most half the free memory.
pub(super) fn default_bandwidth_bytes() -> u64 {
    let want = GIB.max(L3_FACTOR * total_l3_bytes());
    crate::load::available_memory().map_or(want, |free| want.min(free / 2)).max(MIB)
}

/// The wrapping sum of `s`; with AVX-512, prefetching non-temporally (`nta`) or into every cache
/// level.
pub(super) fn sum_slice(s: &[u64], nta: bool) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present.
        return unsafe {
            match nta {
                true => sum_slice_avx512::<{ std::arch::x86_64::_MM_HINT_NTA }>(s),
                false => sum_slice_avx512::<{ std::arch::x86_64::_MM_HINT_T0 }>(s),
            }
        };
    }
    let _ = nta;
    // Eight independent sums so the loop is bound by memory, not by one add chain.
    let mut acc = [0u64; 8];
    let chunks = s.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(0u64, |a, &b| a.wrapping_add(b));
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(v);
        }
    }
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// [`sum_slice`] with the widest loads and prefetches (hint `HINT`) a few pages ahead, as the
/// decode kernels read weights: the bandwidth they are measured against must be what such a loop
/// gets, or the roofline percentage can exceed 100% (it did with 16-byte loads and no prefetch).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_slice_avx512<const HINT: i32>(s: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    let chunks = s.chunks_exact(32);
    let tail = chunks.remainder().iter().fold(0u64, |a, &b| a.wrapping_add(b));
    for (i, c) in chunks.enumerate() {
        let p = c.as_ptr();
        // 4 KiB ahead of this 256-byte step, where that is still inside `s`.
        let ahead = 32 * i + 512;
        if ahead < s.len() {
            // SAFETY: inside `s`; a prefetch never faults anyway.
            unsafe { _mm_prefetch::<HINT>(s.as_ptr().add(ahead) as *const i8) };
        }
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 32 u64 = 4 x 64 bytes.
            *a = _mm512_add_epi64(*a, unsafe { _mm512_loadu_si512(p.add(8 * k) as *const __m512i) });
        }
    }
    let v = _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
    (_mm512_reduce_add_epi64(v) as u64).wrapping_add(tail)
}

/// Reads all of `buf` with `threads` threads, each summing a contiguous part; the best of
/// [`BANDWIDTH_RUNS`] passes with each prefetch hint (the kernels' non-temporal one, and into every
/// cache level), in GB/s (10^9 bytes per second).
pub(super) fn read_bandwidth(buf: &[u64], threads: usize) -> f64 {
    let part = buf.len().div_ceil(threads).max(1);
    let bytes = std::mem::size_of_val(buf) as f64;
    let mut best = 0f64;
    for nta in (0..2 * BANDWIDTH_RUNS).map(|i| i % 2 == 0) {
        let barrier = std::sync::Barrier::new(threads);
        // Each thread clocks its own part: from the earliest start to the latest end is the pass, so
        // a main thread scheduled late cannot shorten it.
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
            let mut parts: Vec<&[u64]> = buf.chunks(part).collect();
            // Threads without a part (more threads than words) still meet at the barrier.
            parts.resize(threads, &[]);
            let handles: Vec<_> = parts
                .into_iter()
                .map(|c| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        let start = Instant::now();
                        std::hint::black_box(sum_slice(std::hint::black_box(c), nta));
                        (start, Instant::now())
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        let (Some(first), Some(last)) = (spans.iter().map(|s| s.0).min(), spans.iter().map(|s| s.1).max()) else {
            continue;
        };
        let secs = last.duration_since(first).as_secs_f64();
        best = best.max(bytes / secs.max(1e-9) / 1e9);
    }
    best
}

/// Measures the read bandwidth for each thread count over a buffer of `bytes` bytes, written first so
/// every page is real memory (a never-written page reads as the shared zero page).
pub(super) fn measure_bandwidth(threads: &[usize], bytes: u64, pb: &ProgressBar) -> BTreeMap<usize, f64> {
    let words = usize::try_from(bytes / 8).unwrap_or(usize::MAX).max(1);
    let mut buf = vec![0u64; words];
    let fill_threads = threads.iter().copied().max().unwrap_or(1);
    std::thread::scope(|s| {
        for (i, c) in buf.chunks_mut(words.div_ceil(fill_threads)).enumerate() {
            s.spawn(move || c.iter_mut().enumerate().for_each(|(j, w)| *w = (i + j) as u64 | 1));
        }
    });
    let mut out = BTreeMap::new();
    for &t in threads {
        pb.set_message(format!("read bandwidth, -t {t}"));
        out.entry(t).or_insert_with(|| read_bandwidth(&buf, t));
    }
    out
}
