//! The kernel images build.rs embeds (src/kernels.rs), checked without a GPU: every kernels/*.cu
//! has a cubin for each architecture of `TANDEM_CUDA_ARCHS` (default 80;86;89;90;120), with the
//! architecture read from the cubin's ELF header, and PTX for the oldest and for compute_120; with
//! `PTXAS` set (CUDA 12.8's, as scripts/install-cuda-toolkit.sh sets it) the PTX is of ISA 8.7 at
//! most, which drivers for CUDA 12.8 JIT; every entry point the runtime launches
//! (tandem_cuda::entry_points) is in the images of its file and in kernels/ABI.md. A build without
//! kernels skips, unless `TANDEM_REQUIRE_KERNELS=1` (CI) makes that a failure.
#![cfg(feature = "cuda")]

use std::collections::BTreeSet;
use std::path::Path;

use tandem_cuda::{Image, ImageKind};

/// Entry points per kernel file, as the runtime launches them.
fn abi_entry_points() -> Vec<(&'static str, Vec<String>)> {
    let mut by_file: Vec<(&'static str, Vec<String>)> = Vec::new();
    for (file, name) in tandem_cuda::entry_points() {
        match by_file.iter_mut().find(|(f, _)| *f == file) {
            Some((_, v)) => v.push(name),
            None => by_file.push((file, vec![name])),
        }
    }
    by_file
}

/// The architectures build.rs was asked for (the same parsing as build.rs).
fn wanted_archs() -> Vec<u32> {
    let raw = std::env::var("TANDEM_CUDA_ARCHS").unwrap_or_else(|_| "80;86;89;90;120".into());
    let mut archs: Vec<u32> = raw
        .split([';', ',', ' '])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_start_matches("sm_").trim_start_matches("compute_").parse().expect("TANDEM_CUDA_ARCHS"))
        .collect();
    archs.sort_unstable();
    archs.dedup();
    archs
}

/// The `sm_XY` a cubin was compiled for, from its ELF64 header (e_machine 190 = EM_CUDA).
/// CUDA 13 writes ELF ABI version 8 with the architecture in bits 8..16 of e_flags (sm_90:
/// 0x..5a.., sm_120: 0x..78..); older toolkits (ABI version 7 and below) in bits 0..8.
fn cubin_sm(bytes: &[u8]) -> Result<u32, String> {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    if bytes[4] != 2 || bytes[5] != 1 {
        return Err(format!("ELF class {} data {}, expected 64-bit little-endian", bytes[4], bytes[5]));
    }
    let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
    if machine != 190 {
        return Err(format!("e_machine {machine}, expected 190 (EM_CUDA)"));
    }
    let flags = u32::from_le_bytes([bytes[48], bytes[49], bytes[50], bytes[51]]);
    let abi_version = bytes[8];
    Ok(if abi_version >= 8 { (flags >> 8) & 0xff } else { flags & 0xff })
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn kernel_files() -> BTreeSet<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    std::fs::read_dir(&dir)
        .expect("kernels/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn embedded_kernel_images_cover_every_file_architecture_and_entry_point() {
    let images: &[Image] = tandem::kernels::images();
    if images.is_empty() {
        let why = "built with --features cuda but without kernel images (no nvcc, or nvcc failed: see the \
                   build's warnings; scripts/install-cuda-toolkit.sh installs one)";
        if std::env::var("TANDEM_REQUIRE_KERNELS").is_ok_and(|v| v == "1") {
            panic!("TANDEM_REQUIRE_KERNELS=1: {why}");
        }
        println!("skipping: {why}");
        return;
    }
    let archs = wanted_archs();
    let mut ptx_targets = vec![archs[0]];
    if archs.contains(&120) && archs[0] != 120 {
        ptx_targets.push(120);
    }
    let mut problems = Vec::new();

    let files = kernel_files();
    let embedded: BTreeSet<String> = images.iter().map(|i| i.file.to_string()).collect();
    if files != embedded {
        problems.push(format!("kernels/*.cu are {files:?} but the images are of {embedded:?}"));
    }

    for file in &files {
        let of_file: Vec<&Image> = images.iter().filter(|i| i.file == file).collect();
        for &sm in &archs {
            let cubins: Vec<&&Image> = of_file.iter().filter(|i| i.kind == ImageKind::Cubin { sm }).collect();
            match cubins.as_slice() {
                [one] => match cubin_sm(one.bytes) {
                    Ok(got) if got == sm => {}
                    Ok(got) => problems.push(format!("{file}: the sm_{sm} cubin's ELF header says sm_{got}")),
                    Err(e) => problems.push(format!("{file}: the sm_{sm} cubin: {e}")),
                },
                other => problems.push(format!("{file}: {} cubins for sm_{sm}, expected 1", other.len())),
            }
        }
        for &p in &ptx_targets {
            let ptx: Vec<&&Image> = of_file.iter().filter(|i| i.kind == ImageKind::Ptx { sm: p }).collect();
            match ptx.as_slice() {
                [one] => {
                    let text = String::from_utf8_lossy(one.bytes);
                    if !text.lines().any(|l| l.trim() == format!(".target sm_{p}")) {
                        problems.push(format!("{file}: the compute_{p} PTX has no `.target sm_{p}` line"));
                    }
                    let version = text.lines().find_map(|l| l.trim().strip_prefix(".version ")).unwrap_or("?");
                    if std::env::var_os("PTXAS").is_some_and(|v| !v.is_empty()) && version != "8.7" {
                        problems.push(format!("{file}: the compute_{p} PTX is of ISA {version}, expected 8.7"));
                    }
                }
                other => problems.push(format!("{file}: {} PTX images for compute_{p}, expected 1", other.len())),
            }
        }
        let n_ptx = of_file.iter().filter(|i| matches!(i.kind, ImageKind::Ptx { .. })).count();
        if n_ptx != ptx_targets.len() {
            problems.push(format!("{file}: {n_ptx} PTX images, expected {}", ptx_targets.len()));
        }
    }

    let abi = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/ABI.md")).expect("ABI.md");
    for (file, entries) in abi_entry_points() {
        if !abi.contains(&format!("{file}.cu")) {
            problems.push(format!("kernels/ABI.md does not list {file}.cu"));
        }
        for name in &entries {
            // ABI.md names the typed families as `tandem_attn_<c>`, `tandem_matvec_<t>`, ...
            let family = ["_f32", "_f16", "_bf16", "_q4_0", "_q5_0", "_q8_0", "_q4_K", "_q5_K", "_q6_K", "_iq4_xs"]
                .iter()
                .find_map(|t| name.strip_suffix(t).filter(|_| !abi.contains(&format!("`{name}`"))));
            let listed = abi.contains(&format!("`{name}`"))
                || family.is_some_and(|f| abi.contains(&format!("`{f}_<t>`")) || abi.contains(&format!("`{f}_<c>`")))
                || name.starts_with("tandem_dequant_") && abi.contains("`tandem_dequant_<t>_f16`");
            if !listed {
                problems.push(format!("kernels/ABI.md does not list {name}"));
            }
        }
        for image in images.iter().filter(|i| i.file == file) {
            for name in &entries {
                let found = match image.kind {
                    // The symbol table's string, NUL-terminated (so no name matches a longer one).
                    ImageKind::Cubin { .. } => contains(image.bytes, format!("{name}\0").as_bytes()),
                    ImageKind::Ptx { .. } => contains(image.bytes, format!(".entry {name}(").as_bytes()),
                };
                if !found {
                    problems.push(format!("{file}: {name} is missing from the {:?} image", image.kind));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{} problems with the kernel images:\n{}", problems.len(), problems.join("\n"));
    println!(
        "{} kernel images: {} files x (cubins for {archs:?} + PTX for compute_{ptx_targets:?})",
        images.len(),
        files.len()
    );
}

#[test]
fn cubin_architecture_is_read_from_both_elf_flag_layouts() {
    let mut header = vec![0u8; 64];
    header[..4].copy_from_slice(b"\x7fELF");
    header[4] = 2;
    header[5] = 1;
    header[18..20].copy_from_slice(&190u16.to_le_bytes());
    // nvcc 13.0: sm_90 -> e_flags 0x06005a04, sm_120 -> 0x06007802 (ELF ABI version 8).
    header[8] = 8;
    header[48..52].copy_from_slice(&0x0600_5a04u32.to_le_bytes());
    assert_eq!(cubin_sm(&header), Ok(90));
    header[48..52].copy_from_slice(&0x0600_7802u32.to_le_bytes());
    assert_eq!(cubin_sm(&header), Ok(120));
    // CUDA 12: the architecture in the low byte (ABI version 7).
    header[8] = 7;
    header[48..52].copy_from_slice(&0x005a_055au32.to_le_bytes());
    assert_eq!(cubin_sm(&header), Ok(90));
    assert!(cubin_sm(b"not an elf").is_err());
}
