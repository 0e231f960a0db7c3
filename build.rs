//! Build script: with the `cuda` feature, compiles every `kernels/*.cu` with nvcc to PTX for the
//! oldest architecture of `TANDEM_CUDA_ARCHS` (default `80;86;89;90;120`) and for compute_120 when
//! 120 is among them, then assembles a cubin per architecture from that PTX, and writes
//! `$OUT_DIR/tandem_kernels.rs`, the list of images `src/kernels.rs` embeds.
//!
//! The cubins are assembled by `PTXAS` when it is set (scripts/install-cuda-toolkit.sh: CUDA 12.8's
//! ptxas from PyPI, whose cubins R570 drivers load), with the PTX's `.version` lowered to
//! `TANDEM_PTX_VERSION` (default 8.7, CUDA 12.8's) so that the PTX images JIT on those drivers too;
//! else by nvcc's own ptxas. Without the feature, without nvcc, or when a step fails, the list is
//! empty and the build still succeeds (a `cargo:warning` says why): CUDA never breaks a CPU build.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Architectures compiled when `TANDEM_CUDA_ARCHS` is unset: A100, RTX 30xx / A40, RTX 40xx / L40S,
/// H100 / H200, RTX 50xx / RTX PRO 6000.
const DEFAULT_ARCHS: &str = "80;86;89;90;120";
/// The PTX ISA version written into the PTX when `PTXAS` assembles the cubins (CUDA 12.8's).
const DEFAULT_PTX_VERSION: &str = "8.7";
/// Environment variables that change what this script does.
const ENV_INPUTS: [&str; 6] = ["NVCC", "CUDA_HOME", "CUDA_PATH", "TANDEM_CUDA_ARCHS", "PTXAS", "TANDEM_PTX_VERSION"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // The directory itself, so that adding or removing a kernel file reruns the script.
    println!("cargo:rerun-if-changed=kernels");
    for var in ENV_INPUTS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernel_dir = manifest_dir.join("kernels");
    let sources = kernel_files(&kernel_dir);
    for path in sources.iter().chain(&headers(&kernel_dir)) {
        println!("cargo:rerun-if-changed={}", path.display());
    }

    let images = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        match build_kernels(&kernel_dir, &sources, &out_dir) {
            Ok(images) => images,
            Err(why) => {
                println!("cargo:warning=tandem: CUDA kernels not built ({why}); the binary will run on the CPU only");
                Vec::new()
            }
        }
    } else {
        Vec::new()
    };
    let listing = out_dir.join("tandem_kernels.rs");
    std::fs::write(&listing, render(&images)).unwrap_or_else(|e| panic!("writing {}: {e}", listing.display()));
}

/// One compiled image on disk.
struct Built {
    file: String,
    kind: Kind,
    path: PathBuf,
}

#[derive(Clone, Copy)]
enum Kind {
    Cubin(u32),
    Ptx(u32),
}

/// `kernels/*.cu`, sorted so the generated list is stable.
fn kernel_files(dir: &Path) -> Vec<PathBuf> {
    files_with_extension(dir, "cu")
}

/// `kernels/*.cuh`.
fn headers(dir: &Path) -> Vec<PathBuf> {
    files_with_extension(dir, "cuh")
}

fn files_with_extension(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == ext))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// The architectures to build, e.g. `[90, 120]`, from `TANDEM_CUDA_ARCHS` (separated by `;`, `,`
/// or spaces; `sm_90`, `compute_90` and `90` all mean 90).
fn archs() -> Result<Vec<u32>, String> {
    let raw = std::env::var("TANDEM_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
    let mut out = Vec::new();
    for item in raw.split([';', ',', ' ']).map(str::trim).filter(|s| !s.is_empty()) {
        let digits = item.trim_start_matches("sm_").trim_start_matches("compute_");
        match digits.parse::<u32>() {
            Ok(sm) if (50..1000).contains(&sm) => out.push(sm),
            _ => return Err(format!("TANDEM_CUDA_ARCHS has `{item}`, expected numbers like 90;120")),
        }
    }
    out.sort_unstable();
    out.dedup();
    if out.is_empty() {
        return Err("TANDEM_CUDA_ARCHS names no architecture".into());
    }
    Ok(out)
}

/// nvcc from `NVCC`, else `CUDA_HOME`/`CUDA_PATH` + `bin/nvcc`, else the `PATH`; checked by running
/// `nvcc --version`.
fn find_nvcc() -> Result<PathBuf, String> {
    let candidate = if let Some(nvcc) = std::env::var_os("NVCC").filter(|v| !v.is_empty()) {
        PathBuf::from(nvcc)
    } else if let Some(home) = ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(std::env::var_os).find(|v| !v.is_empty()) {
        PathBuf::from(home).join("bin").join("nvcc")
    } else {
        PathBuf::from("nvcc")
    };
    match Command::new(&candidate).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(candidate),
        Ok(out) => Err(format!(
            "`{} --version` failed: {}",
            candidate.display(),
            first_line(&String::from_utf8_lossy(&out.stderr))
        )),
        Err(e) => Err(format!(
            "no nvcc at `{}` ({e}); set NVCC or CUDA_HOME, e.g. with scripts/install-cuda-toolkit.sh",
            candidate.display()
        )),
    }
}

fn first_line(s: &str) -> &str {
    s.lines().find(|l| !l.trim().is_empty()).unwrap_or("no output").trim()
}

/// The PTX targets: the oldest architecture, and compute_120 when 120 is asked for.
fn ptx_targets(archs: &[u32]) -> Vec<u32> {
    let mut v = vec![archs[0]];
    if archs.contains(&120) && archs[0] != 120 {
        v.push(120);
    }
    v
}

/// The PTX a cubin for `sm` is assembled from: the newest PTX target not above it.
fn ptx_for(sm: u32, targets: &[u32]) -> u32 {
    targets.iter().copied().filter(|&p| p <= sm).max().unwrap_or(targets[0])
}

/// Compiles every file to PTX, then assembles each cubin, spread over as many threads as cargo
/// allows.
fn build_kernels(kernel_dir: &Path, sources: &[PathBuf], out_dir: &Path) -> Result<Vec<Built>, String> {
    if sources.is_empty() {
        return Err(format!("no .cu files in {}", kernel_dir.display()));
    }
    let archs = archs()?;
    let nvcc = find_nvcc()?;
    let ptxas = match std::env::var_os("PTXAS").filter(|v| !v.is_empty()) {
        Some(p) => {
            let p = PathBuf::from(p);
            match Command::new(&p).arg("--version").output() {
                Ok(o) if o.status.success() => Some(p),
                _ => return Err(format!("PTXAS={} does not run", p.display())),
            }
        }
        None => None,
    };
    let ptx_version = std::env::var("TANDEM_PTX_VERSION").unwrap_or_else(|_| DEFAULT_PTX_VERSION.to_string());
    let image_dir = out_dir.join("kernels");
    std::fs::create_dir_all(&image_dir).map_err(|e| format!("creating {}: {e}", image_dir.display()))?;
    let targets = ptx_targets(&archs);

    let mut ptx_jobs = Vec::new();
    let mut cubin_jobs = Vec::new();
    for src in sources {
        let stem =
            src.file_stem().and_then(|s| s.to_str()).ok_or_else(|| format!("bad file name {}", src.display()))?;
        for &p in &targets {
            ptx_jobs.push(Built {
                file: stem.to_string(),
                kind: Kind::Ptx(p),
                path: image_dir.join(format!("{stem}.compute_{p}.ptx")),
            });
        }
        for &sm in &archs {
            cubin_jobs.push(Built {
                file: stem.to_string(),
                kind: Kind::Cubin(sm),
                path: image_dir.join(format!("{stem}.sm_{sm}.cubin")),
            });
        }
    }
    let run_all = |jobs: &[Built], f: &(dyn Fn(&Built) -> Result<(), String> + Sync)| -> Result<(), String> {
        let threads = std::env::var("NUM_JOBS")
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1)
            .clamp(1, jobs.len().max(1));
        let next = AtomicUsize::new(0);
        let errors = Mutex::new(Vec::<String>::new());
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    if let Err(e) = f(job) {
                        errors.lock().unwrap_or_else(|p| p.into_inner()).push(e);
                    }
                });
            }
        });
        let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Some(first) = errors.first() {
            // Every line of the complaint as its own warning; cargo shows a warning's first line only.
            for line in first.lines().skip(1).take(20) {
                println!("cargo:warning=  {line}");
            }
            return Err(format!("{} of {} runs failed, first: {}", errors.len(), jobs.len(), first_line(first)));
        }
        Ok(())
    };
    run_all(&ptx_jobs, &|job| {
        let Kind::Ptx(p) = job.kind else { return Ok(()) };
        let src = kernel_dir.join(format!("{}.cu", job.file));
        compile(&nvcc, kernel_dir, &src, &["-ptx".into(), format!("-arch=compute_{p}")], &job.path)?;
        if ptxas.is_some() {
            lower_ptx_version(&job.path, &ptx_version)?;
        }
        Ok(())
    })?;
    run_all(&cubin_jobs, &|job| {
        let Kind::Cubin(sm) = job.kind else { return Ok(()) };
        match &ptxas {
            Some(ptxas) => {
                let ptx = image_dir.join(format!("{}.compute_{}.ptx", job.file, ptx_for(sm, &targets)));
                assemble(ptxas, &ptx, sm, &job.path)
            }
            None => {
                let src = kernel_dir.join(format!("{}.cu", job.file));
                compile(&nvcc, kernel_dir, &src, &["-cubin".into(), format!("-arch=sm_{sm}")], &job.path)
            }
        }
    })?;
    Ok(ptx_jobs.into_iter().chain(cubin_jobs).collect())
}

/// Rewrites the PTX's `.version` line to `version` when it is newer (nvcc 13 writes 9.0; the
/// kernels use nothing newer than CUDA 12's PTX, which ptxas then checks).
fn lower_ptx_version(path: &Path, version: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let parse = |v: &str| -> Option<(u32, u32)> {
        let (a, b) = v.trim().split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    };
    let want = parse(version).ok_or_else(|| format!("TANDEM_PTX_VERSION={version} is not MAJOR.MINOR"))?;
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        match line.strip_prefix(".version ").and_then(parse) {
            Some(have) if have > want => out.push_str(&format!(".version {}.{}", want.0, want.1)),
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Runs `tool` with `args` then `src -o out`; its stderr, on success (warnings), or in the
/// error that names `what` and `src`.
fn run_tool(tool: &Path, args: &[&str], src: &Path, out: &Path, what: &str) -> Result<String, String> {
    let o = Command::new(tool)
        .args(args)
        .arg(src)
        .arg("-o")
        .arg(out)
        .output()
        .map_err(|e| format!("running {}: {e}", tool.display()))?;
    let stderr = String::from_utf8_lossy(&o.stderr).trim().to_string();
    if !o.status.success() {
        return Err(format!("{what} {} failed:\n{stderr}", src.display()));
    }
    Ok(stderr)
}

/// One ptxas run: PTX to a cubin for `sm_<sm>`.
fn assemble(ptxas: &Path, ptx: &Path, sm: u32, out: &Path) -> Result<(), String> {
    run_tool(ptxas, &["-O3", &format!("-arch=sm_{sm}")], ptx, out, &format!("ptxas sm_{sm}")).map(drop)
}

/// One nvcc run with `mode` (`-ptx -arch=compute_XY` or `-cubin -arch=sm_XY`).
fn compile(nvcc: &Path, include: &Path, src: &Path, mode: &[String], out_path: &Path) -> Result<(), String> {
    let include = include.to_str().ok_or_else(|| format!("{} is not UTF-8", include.display()))?;
    let mut args = vec!["-O3", "-std=c++17", "-Wno-deprecated-gpu-targets"];
    args.extend(mode.iter().map(String::as_str));
    args.extend(["-I", include]);
    let stderr = run_tool(nvcc, &args, src, out_path, &format!("nvcc {}", mode.join(" ")))?;
    // Warnings from a successful run are shown too: a kernel should compile cleanly.
    for line in stderr.lines().filter(|l| !l.trim().is_empty()).take(10) {
        println!("cargo:warning=nvcc {}: {line}", src.display());
    }
    Ok(())
}

/// The generated `tandem_kernels.rs`.
fn render(images: &[Built]) -> String {
    let mut s = String::from("// Generated by build.rs: the kernel images compiled from kernels/*.cu.\n");
    s.push_str("pub static IMAGES: &[tandem_cuda::Image] = &[\n");
    for img in images {
        let kind = match img.kind {
            Kind::Cubin(sm) => format!("tandem_cuda::ImageKind::Cubin {{ sm: {sm} }}"),
            Kind::Ptx(sm) => format!("tandem_cuda::ImageKind::Ptx {{ sm: {sm} }}"),
        };
        let path = img.path.to_str().expect("OUT_DIR is valid UTF-8");
        let _ = writeln!(
            s,
            "    tandem_cuda::Image {{ file: {:?}, kind: {kind}, bytes: include_bytes!({path:?}) }},",
            img.file
        );
    }
    s.push_str("];\n");
    s
}
