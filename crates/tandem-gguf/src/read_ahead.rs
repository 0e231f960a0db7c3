//! Asking the kernel ahead for mapped bytes that are about to be read, and how much memory the
//! process may use. When a memory-mapped model is larger than the memory it may occupy, every
//! token's routed experts come from storage; read one page fault at a time, each fault waits for
//! one small read. [`will_need`] hands the kernel a whole range at once (`madvise(MADV_WILLNEED)`
//! starts the reads without waiting for them), so storage reads run many at a time and overlap
//! the work on the weights already in memory.

/// Asks the kernel to start reading the pages under `bytes` (the whole pages they touch) if they
/// are not in memory; returns whether it accepted the advice. Never blocks on the reads. Harmless
/// on memory that is resident or anonymous.
pub fn will_need(bytes: &[u8]) -> bool {
    if bytes.is_empty() {
        return true;
    }
    let page = page_size();
    let start = bytes.as_ptr() as usize;
    let first = start / page * page;
    let last = (start + bytes.len()).next_multiple_of(page);
    // SAFETY: every page in [first, last) holds at least one byte of `bytes`, so it is mapped;
    // MADV_WILLNEED only schedules reads of those pages and changes no memory.
    unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_WILLNEED) == 0 }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => 4096,
    }
}

/// Memory this process may still take, in bytes: `MemAvailable` of /proc/meminfo, lowered to
/// what the process's memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`) leaves beyond
/// its anonymous memory when the cgroup is limited — as in a container. `None` where neither can
/// be read (not Linux).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| mem_available(&s));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|own| cgroup_dirs(&own).into_iter().find_map(|(dir, v2)| cgroup_room(&dir, v2)));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of a /proc/meminfo text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
}

/// The directories that may hold this process's memory cgroup files, with whether they are v2:
/// the cgroup's own path below the mount point first, then the mount point itself (inside a
/// container the process's cgroup is often mounted as the root).
fn cgroup_dirs(own: &str) -> Vec<(std::path::PathBuf, bool)> {
    let mut dirs = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), Some(c)) => (a, b, c.trim_start_matches('/')),
            _ => continue,
        };
        let (mount, v2) = match controllers {
            "" => ("/sys/fs/cgroup", true),
            c if c.split(',').any(|c| c == "memory") => ("/sys/fs/cgroup/memory", false),
            _ => continue,
        };
        let mount = std::path::Path::new(mount);
        if !path.is_empty() && !path.contains("..") {
            dirs.push((mount.join(path), v2));
        }
        dirs.push((mount.to_path_buf(), v2));
    }
    // A v1 memory controller is the one that limits where both are listed.
    dirs.sort_by_key(|&(_, v2)| v2);
    dirs
}

/// What a limited memory cgroup in `dir` leaves: its limit less its anonymous memory (page cache
/// can be reclaimed). `None` when the files are missing or the cgroup has no limit.
fn cgroup_room(dir: &std::path::Path, v2: bool) -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let (limit, anon_key) =
        if v2 { (read("memory.max")?, "anon") } else { (read("memory.limit_in_bytes")?, "total_rss") };
    let limit = limit.trim().parse::<u64>().ok().filter(|&l| l < 1 << 60)?;
    let anon = read("memory.stat").and_then(|s| stat_value(&s, anon_key)).unwrap_or(0);
    Some(limit.saturating_sub(anon))
}

fn stat_value(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn will_need_takes_any_slice() {
        let v = vec![7u8; 3 * 4096 + 5];
        assert!(will_need(&v[1..]));
        assert!(will_need(&v[4095..4097]));
        assert!(will_need(&[]));
        let map = memmap2::MmapMut::map_anon(1 << 16).unwrap();
        assert!(will_need(&map[100..60000]));
    }

    #[test]
    fn reads_meminfo_and_cgroup_files() {
        assert_eq!(mem_available("MemTotal: 10 kB\nMemAvailable:   2048 kB\n"), Some(2 << 20));
        assert_eq!(mem_available("MemTotal: 10 kB\n"), None);
        let dirs = cgroup_dirs("12:cpu:/\n4:memory:/docker/abc\n0::/user.slice\n");
        let names: Vec<String> = dirs.iter().map(|(d, v2)| format!("{} {v2}", d.display())).collect();
        assert_eq!(
            names,
            [
                "/sys/fs/cgroup/memory/docker/abc false",
                "/sys/fs/cgroup/memory false",
                "/sys/fs/cgroup/user.slice true",
                "/sys/fs/cgroup true"
            ]
        );
        assert!(cgroup_dirs("4:memory:/../../etc\n").iter().all(|(d, _)| !d.to_string_lossy().contains("..")));
        assert_eq!(stat_value("anon_thp 5\nanon 4096\nfile 1\n", "anon"), Some(4096));
        assert_eq!(stat_value("cache 1\ntotal_rss 77\n", "total_rss"), Some(77));
    }

    #[test]
    fn a_limited_cgroup_leaves_its_limit_less_anonymous_memory() {
        let dir = std::env::temp_dir().join(format!("tandem-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1073741824\n").unwrap();
        std::fs::write(dir.join("memory.stat"), "anon 73741824\nfile 500000000\n").unwrap();
        assert_eq!(cgroup_room(&dir, true), Some(1_000_000_000));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_room(&dir, true), None);
        std::fs::write(dir.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(cgroup_room(&dir, false), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
