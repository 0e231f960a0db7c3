//! A model file changed while mapped: `check_unchanged` names it (truncated, or written in
//! place) and accepts a file replaced by rename; a page read after truncation ends the process
//! with one line and exit status 1 through the SIGBUS guard, not a core dump.

use std::path::{Path, PathBuf};
use std::process::Command;
use tandem_gguf::{GgufModel, LoadOptions};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama-tiny.gguf")
}

fn copy_in(dir: &Path) -> PathBuf {
    let p = dir.join("model.gguf");
    std::fs::copy(fixture(), &p).unwrap();
    p
}

#[test]
fn a_truncated_or_rewritten_file_is_noticed_and_a_renamed_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = copy_in(dir.path());
    let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
    assert_eq!(m.check_unchanged(), Ok(()));
    // replaced atomically: the mapping keeps the old file
    let next = dir.path().join("next.gguf");
    std::fs::copy(fixture(), &next).unwrap();
    std::fs::rename(&next, &path).unwrap();
    assert_eq!(m.check_unchanged(), Ok(()));
    drop(m);

    let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(1000).unwrap();
    let e = m.check_unchanged().unwrap_err();
    assert!(e.contains("model.gguf") && e.contains(&format!("truncated while mapped ({len} -> 1000 bytes)")), "{e}");
    assert!(!e.contains('\n'));

    let path = copy_in(dir.path());
    let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20)); // a later modification time
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(len / 2)).unwrap();
        f.write_all(&[0x55; 64]).unwrap();
    }
    let e = m.check_unchanged().unwrap_err();
    assert!(e.contains("written to while mapped"), "{e}");

    // read into memory (--no-mmap), a change on disk does not matter
    let path = copy_in(dir.path());
    let m = GgufModel::open(&path, LoadOptions { mmap: false, mlock: false }).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(10).unwrap();
    assert_eq!(m.check_unchanged(), Ok(()));
}

/// In the child: maps a copy, truncates it, reads the last tensor's bytes.
fn child(dir: &str, mode: tandem_gguf::guard::Mode) {
    tandem_gguf::guard::install(mode);
    let path = copy_in(Path::new(dir));
    let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(0).unwrap();
    let t = m.tensors().last().unwrap();
    let data = m.tensor_data(&t.info.name).unwrap();
    let sum: u64 = data.iter().map(|&b| u64::from(b)).sum();
    println!(
        "read {} bytes after truncation (sum {sum}), {} faults recovered",
        data.len(),
        tandem_gguf::guard::faults()
    );
}

#[test]
fn a_fault_on_a_truncated_mapping_is_one_line_and_exit_1_or_zeros() {
    use tandem_gguf::guard::Mode;
    if let Ok(dir) = std::env::var("TANDEM_SIGBUS_CHILD") {
        let mode = if std::env::var("TANDEM_SIGBUS_RECOVER").is_ok() { Mode::Recover } else { Mode::Exit };
        child(&dir, mode);
        return;
    }
    for recover in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "a_fault_on_a_truncated_mapping_is_one_line_and_exit_1_or_zeros", "--nocapture"]);
        cmd.env("TANDEM_SIGBUS_CHILD", dir.path());
        if recover {
            cmd.env("TANDEM_SIGBUS_RECOVER", "1");
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let all = format!("status {:?}\nstdout: {stdout}\nstderr: {stderr}", out.status);
        if recover {
            // the read finished, on zeros, and the fault was counted
            assert_eq!(out.status.code(), Some(0), "{all}");
            assert!(stdout.contains("(sum 0), 1 faults recovered"), "{all}");
        } else {
            assert_eq!(out.status.code(), Some(1), "{all}");
            let line =
                stderr.lines().find(|l| l.starts_with("tandem: error: model file")).unwrap_or_else(|| panic!("{all}"));
            assert!(line.contains("model.gguf changed or was truncated while mapped"), "{line}");
        }
    }
}
