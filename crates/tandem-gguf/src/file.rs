//! One GGUF file: its validated header and its bytes, memory-mapped read-only (the default) or
//! read into owned memory (`--no-mmap`), optionally locked in RAM (`--mlock`).

use crate::metadata::Metadata;
use crate::parse::{parse_header, Header, ParseError, TensorInfo};
use crate::{Error, Result};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Deref;
use std::path::Path;

/// How a file's bytes are brought into memory.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Map the file read-only (zero-copy tensor views). `false` reads it into owned memory.
    pub mmap: bool,
    /// Lock the bytes in RAM so they are never paged out.
    pub mlock: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { mmap: true, mlock: false }
    }
}

enum Storage {
    /// The mapping, the open file behind it (for [`GgufFile::check_unchanged`]) and what the
    /// file was when mapped.
    Mmap(Mmap, File, Identity),
    /// `--no-mmap`: the file read into anonymous memory, on huge pages where the kernel gives
    /// them (2 MiB pages: a decoded token streams hundreds of MiB of weights, and with 4 KiB pages
    /// every page costs a TLB miss and restarts the hardware prefetchers).
    Read(Mmap),
    Owned(Vec<u8>),
}

/// Reads all of `file` (`len` bytes) into anonymous memory advised for transparent huge pages.
fn read_whole(mut file: File, len: u64) -> std::io::Result<Storage> {
    use std::io::Read;
    let len = usize::try_from(len).map_err(|_| std::io::Error::other("file too large for this machine's memory"))?;
    if len == 0 {
        return Ok(Storage::Owned(Vec::new()));
    }
    let mut m = memmap2::MmapOptions::new().len(len).map_anon()?;
    #[cfg(target_os = "linux")]
    // Best effort: without transparent huge pages the memory is ordinary pages.
    let _ = m.advise(memmap2::Advice::HugePage);
    file.read_exact(&mut m[..])?;
    let mut extra = [0u8; 1];
    if file.read(&mut extra)? != 0 {
        return Err(std::io::Error::other("the file grew while it was being read"));
    }
    Ok(Storage::Read(m.make_read_only()?))
}

/// What a mapped file was: a change of size or modification time means someone wrote to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    size: u64,
    mtime: (i64, i64),
}

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Identity {
        use std::os::unix::fs::MetadataExt;
        Identity { size: meta.len(), mtime: (meta.mtime(), meta.mtime_nsec()) }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Storage::Mmap(m, ..) = self {
            crate::guard::unregister(m.as_ptr() as usize);
        }
    }
}

impl Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Mmap(m, ..) | Storage::Read(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A validated GGUF file.
pub struct GgufFile {
    path: String,
    bytes: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// `--mlock` pinned the bytes.
    locked: bool,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates `path`, memory-mapped.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        Self::open_with(path, LoadOptions::default())
    }

    pub fn open_with(path: impl AsRef<Path>, opts: LoadOptions) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Err(Error::io(path, std::io::Error::other("is a directory, not a GGUF file")));
        }
        let name = path.display().to_string();
        let bytes = if opts.mmap {
            // SAFETY: the mapping is read-only and private to this process. A file truncated
            // while mapped would fault on access: `check_unchanged` finds that before the pages
            // are read, and `guard::install` turns a fault that still happens into one line.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            let id = Identity::of(&meta);
            crate::guard::register(map.as_ptr() as usize, map.len(), &name);
            Storage::Mmap(map, file, id)
        } else {
            read_whole(file, meta.len()).map_err(|e| Error::io(path, e))?
        };
        let mut f = Self::from_storage(bytes, name)?;
        if opts.mlock {
            f.lock()?;
            f.locked = true;
        }
        Ok(f)
    }

    /// Validates a GGUF file held in memory; `name` is used in messages.
    pub fn from_bytes(bytes: Vec<u8>, name: &str) -> Result<GgufFile> {
        Self::from_storage(Storage::Owned(bytes), name.to_string())
    }

    fn from_storage(bytes: Storage, path: String) -> Result<GgufFile> {
        let Header { version, metadata, tensors, alignment, data_offset } = parse_header(&bytes)
            .map_err(|ParseError { offset, msg }| Error::Malformed { path: path.clone(), offset, msg })?;
        let tensor_index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile {
            metadata: Metadata::new(path.clone(), metadata),
            path,
            bytes,
            version,
            alignment,
            data_offset,
            tensors,
            tensor_index,
            locked: false,
        })
    }

    fn lock(&self) -> Result<()> {
        let r = match &self.bytes {
            Storage::Mmap(m, ..) | Storage::Read(m) => m.lock(),
            Storage::Owned(v) if v.is_empty() => Ok(()),
            // SAFETY: the range is a live allocation owned by `self`; mlock only pins its pages.
            Storage::Owned(v) => match unsafe { libc::mlock(v.as_ptr().cast(), v.len()) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            },
        };
        r.map_err(|cause| Error::Mlock { path: self.path.clone(), cause })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    pub fn file_size(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// For a mapped file: an error naming it when it was truncated or written to since it was
    /// mapped (an `fstat` of the open file, cheap enough before every batch). Reading its pages
    /// then would fault (truncated) or give other weights (rewritten in place). A file replaced
    /// by rename is fine: the mapping keeps the old one.
    pub fn check_unchanged(&self) -> std::result::Result<(), String> {
        let Storage::Mmap(_, file, was) = &self.bytes else { return Ok(()) };
        let now = match file.metadata() {
            Ok(m) => Identity::of(&m),
            Err(e) => return Err(format!("model file {}: {e}", self.path)),
        };
        if now == *was {
            return Ok(());
        }
        let what = if now.size < was.size {
            format!("was truncated while mapped ({} -> {} bytes)", was.size, now.size)
        } else {
            "was written to while mapped".to_string()
        };
        Err(format!(
            "model file {} {what}; restart the server, and replace model files atomically (write a new file, then rename it over the old)",
            self.path
        ))
    }

    pub fn is_mmapped(&self) -> bool {
        matches!(self.bytes, Storage::Mmap(..))
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub(crate) fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of tensor `name`: a view into the mapping (or the owned buffer), no copy.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: name.to_string() })?;
        Ok(self.data_of(t))
    }

    /// Whether [`GgufFile::release`] gives memory back: the file was read into memory
    /// (`--no-mmap`) and not locked.
    pub fn can_release(&self) -> bool {
        matches!(self.bytes, Storage::Read(_)) && !self.locked
    }

    /// Whether the tensors' bytes are pages of the file mapped on demand (not read in, not
    /// locked): reading them may wait for storage, so asking ahead pays.
    pub fn pages_on_demand(&self) -> bool {
        matches!(self.bytes, Storage::Mmap(..)) && !self.locked
    }

    /// Gives the memory of tensor `t`'s bytes back to the system (the whole pages inside them)
    /// when [`GgufFile::can_release`], once a copy of them made elsewhere is all that will be
    /// used (`--no-mmap` with repacking); returns how many bytes that was. The pages read as
    /// zeros afterwards.
    ///
    /// # Safety
    /// Nothing may read tensor `t`'s bytes after this call, through slices taken before it
    /// either.
    pub unsafe fn release(&self, t: &TensorInfo) -> u64 {
        let Storage::Read(m) = &self.bytes else { return 0 };
        if self.locked {
            return 0;
        }
        // SAFETY: sysconf has no preconditions.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => return 0,
        };
        let start = (self.data_offset + t.offset) as usize;
        let Some(end) = start.checked_add(t.size as usize).filter(|&e| e <= m.len()) else { return 0 };
        let base = m.as_ptr() as usize;
        let (first, last) = ((base + start).next_multiple_of(page), (base + end) / page * page);
        if last <= first {
            return 0;
        }
        // SAFETY: [first, last) lies inside the anonymous mapping `m` owns, and the caller
        // guarantees nothing reads it again; MADV_DONTNEED only drops those pages.
        match unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_DONTNEED) } {
            0 => (last - first) as u64,
            _ => 0,
        }
    }

    /// The bytes of a tensor of this file (bounds were checked when the header was parsed).
    /// A `TensorInfo` of another file gets an empty slice rather than a panic.
    pub(crate) fn data_of(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        self.bytes.get(start..start + t.size as usize).unwrap_or(&[])
    }
}
