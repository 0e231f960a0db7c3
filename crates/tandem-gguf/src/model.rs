//! A model as users name it: one GGUF file, or the shards of a split model
//! (`NAME-00001-of-00013.gguf`, as llama.cpp's gguf-split writes them) behind one tensor index.

use crate::file::{GgufFile, LoadOptions};
use crate::metadata::Metadata;
use crate::parse::TensorInfo;
use crate::{Error, Result};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

pub const KEY_SPLIT_NO: &str = "split.no";
pub const KEY_SPLIT_COUNT: &str = "split.count";
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";
/// llama.cpp caps shards at 99999 by its five-digit naming.
const MAX_SHARDS: u32 = 99_999;

/// A tensor of the model and the shard that holds it.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub info: &'a TensorInfo,
    /// Index into [`GgufModel::shards`].
    pub shard: usize,
}

/// One or more GGUF files presented as one model.
#[derive(Debug)]
pub struct GgufModel {
    shards: Vec<GgufFile>,
    /// (shard, index in that shard's tensor list), in shard then file order.
    order: Vec<(usize, usize)>,
    index: HashMap<String, usize>,
}

/// The parts of a split file name `PREFIX-00002-of-00013.gguf`: (prefix, 1-based number, count).
pub fn parse_split_name(path: &Path) -> Option<(String, u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    // "-NNNNN-of-NNNNN" is 15 bytes.
    if stem.len() < 15 || !stem.is_char_boundary(stem.len() - 15) {
        return None;
    }
    let (prefix, tail) = stem.split_at(stem.len() - 15);
    let b = tail.as_bytes();
    let digits = |s: &[u8]| s.iter().all(u8::is_ascii_digit);
    if b[0] != b'-' || &b[6..10] != b"-of-" || !digits(&b[1..6]) || !digits(&b[10..15]) {
        return None;
    }
    let no: u32 = tail[1..6].parse().ok()?;
    let count: u32 = tail[10..15].parse().ok()?;
    Some((prefix.to_string(), no, count))
}

/// The path of shard `no` (1-based) of `count`, in llama.cpp's naming (`llama_split_path`).
pub fn split_path(dir: &Path, prefix: &str, no: u32, count: u32) -> PathBuf {
    dir.join(format!("{prefix}-{no:05}-of-{count:05}.gguf"))
}

impl GgufModel {
    /// Opens a model: a single file, or any shard of a split model (all shards are opened).
    pub fn open(path: impl AsRef<Path>, opts: LoadOptions) -> Result<GgufModel> {
        let path = path.as_ref();
        let first = GgufFile::open_with(path, opts)?;
        let count = first.metadata().opt_u32(KEY_SPLIT_COUNT)?;
        let named = parse_split_name(path);
        let n = match (count, &named) {
            (None | Some(0 | 1), None) => return Self::from_shards(vec![first]),
            (None, Some(_)) => {
                return Err(Error::Split(format!(
                    "{}: named like a shard of a split model but has no {KEY_SPLIT_COUNT} key",
                    path.display()
                )))
            }
            (Some(n), _) if n > MAX_SHARDS => {
                return Err(Error::Split(format!("{}: {KEY_SPLIT_COUNT} = {n} is too large", path.display())))
            }
            (Some(n), _) => n,
        };
        let Some((prefix, _, name_count)) = named.filter(|(_, _, c)| *c == n) else {
            return Err(Error::Split(format!(
                "{}: {KEY_SPLIT_COUNT} = {n} but the file name does not follow NAME-00001-of-{n:05}.gguf",
                path.display()
            )));
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        check_no_extra_shards(&dir, &prefix, name_count)?;
        let mut first = Some(first);
        let mut shards = Vec::with_capacity(n as usize);
        for no in 1..=n {
            let p = split_path(&dir, &prefix, no, n);
            let shard = if p.file_name() == path.file_name() {
                first.take().expect("the opened shard is used once")
            } else {
                if !p.exists() {
                    return Err(Error::Split(format!(
                        "missing shard {} ({KEY_SPLIT_COUNT} = {n} in {})",
                        p.display(),
                        path.display()
                    )));
                }
                GgufFile::open_with(&p, opts)?
            };
            let md = shard.metadata();
            let (got_no, got_count) = (md.get_u32(KEY_SPLIT_NO)?, md.get_u32(KEY_SPLIT_COUNT)?);
            if got_no != no - 1 || got_count != n {
                return Err(Error::Split(format!(
                    "{}: {KEY_SPLIT_NO} = {got_no}, {KEY_SPLIT_COUNT} = {got_count}; expected {} and {n} from its name",
                    p.display(),
                    no - 1
                )));
            }
            shards.push(shard);
        }
        let model = Self::from_shards(shards)?;
        let expected = model.shards[0].metadata().opt_u64(KEY_SPLIT_TENSORS_COUNT)?;
        if let Some(expected) = expected.filter(|&e| e != model.order.len() as u64) {
            return Err(Error::Split(format!(
                "{}: {KEY_SPLIT_TENSORS_COUNT} = {expected} but the {n} shards hold {} tensors",
                model.shards[0].path(),
                model.order.len()
            )));
        }
        Ok(model)
    }

    fn from_shards(shards: Vec<GgufFile>) -> Result<GgufModel> {
        let total: usize = shards.iter().map(|s| s.tensors().len()).sum();
        let mut order = Vec::with_capacity(total);
        let mut index = HashMap::with_capacity(total);
        for (si, shard) in shards.iter().enumerate() {
            for (ti, t) in shard.tensors().iter().enumerate() {
                if let Some(&prev) = index.get(&t.name) {
                    let (ps, _): (usize, usize) = order[prev];
                    return Err(Error::Split(format!(
                        "tensor '{}' is in both {} and {}",
                        t.name,
                        shards[ps].path(),
                        shard.path()
                    )));
                }
                index.insert(t.name.clone(), order.len());
                order.push((si, ti));
            }
        }
        Ok(GgufModel { shards, order, index })
    }

    /// A model of one file already opened or built in memory (`GgufFile::from_bytes`).
    pub fn from_file(file: GgufFile) -> Result<GgufModel> {
        Self::from_shards(vec![file])
    }

    pub fn shards(&self) -> &[GgufFile] {
        &self.shards
    }

    /// [`GgufFile::check_unchanged`] of every shard.
    pub fn check_unchanged(&self) -> std::result::Result<(), String> {
        self.shards.iter().try_for_each(GgufFile::check_unchanged)
    }

    /// The model's metadata (the first shard holds it all).
    pub fn metadata(&self) -> &Metadata {
        self.shards[0].metadata()
    }

    /// The model's metadata to change before it is read (llama.cpp's `--override-kv`, see
    /// [`Metadata::set`]).
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        self.shards[0].metadata_mut()
    }

    /// Number of tensors across all shards.
    pub fn tensor_count(&self) -> usize {
        self.order.len()
    }

    /// All tensors, shard by shard, in file order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = TensorRef<'_>> + '_ {
        self.order.iter().map(|&(s, t)| TensorRef { info: &self.shards[s].tensors()[t], shard: s })
    }

    /// The position of tensor `name` in [`GgufModel::tensors`].
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The tensor at position `i` of [`GgufModel::tensors`].
    pub fn tensor_at(&self, i: usize) -> Option<TensorRef<'_>> {
        let &(s, t) = self.order.get(i)?;
        Some(TensorRef { info: &self.shards[s].tensors()[t], shard: s })
    }

    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let &(s, t) = &self.order[*self.index.get(name)?];
        Some(TensorRef { info: &self.shards[s].tensors()[t], shard: s })
    }

    /// Whether every shard was read into memory (`--no-mmap`, not locked), so that
    /// [`GgufModel::release`] gives memory back.
    pub fn can_release(&self) -> bool {
        self.shards.iter().all(|s| s.can_release())
    }

    /// Whether every shard's tensors are file pages mapped on demand
    /// ([`GgufFile::pages_on_demand`]).
    pub fn pages_on_demand(&self) -> bool {
        self.shards.iter().all(|s| s.pages_on_demand())
    }

    /// [`GgufFile::release`] for a tensor of this model: bytes given back.
    ///
    /// # Safety
    /// Nothing may read the tensor's bytes after this call.
    pub unsafe fn release(&self, t: TensorRef<'_>) -> u64 {
        // SAFETY: passed on from the caller.
        unsafe { self.shards[t.shard].release(t.info) }
    }

    /// The bytes of a tensor of this model (from [`GgufModel::tensors`] or [`GgufModel::tensor`]).
    pub fn data(&self, t: TensorRef<'_>) -> &[u8] {
        self.shards[t.shard].data_of(t.info)
    }

    /// The bytes of tensor `name`, a zero-copy view into its shard.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let r = self
            .tensor(name)
            .ok_or_else(|| Error::MissingTensor { path: self.shards[0].path().to_string(), name: name.to_string() })?;
        Ok(self.shards[r.shard].data_of(r.info))
    }
}

/// A file in `dir` named like a shard of `prefix` that is not one of its `count` shards.
fn check_no_extra_shards(dir: &Path, prefix: &str, count: u32) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    let mut extra = BTreeSet::new();
    for e in entries.flatten() {
        let p = e.path();
        if let Some((pre, no, c)) = parse_split_name(&p) {
            if pre == prefix && (c != count || no == 0 || no > count) {
                extra.insert(p);
            }
        }
    }
    match extra.into_iter().next() {
        None => Ok(()),
        Some(p) => Err(Error::Split(format!(
            "extra shard {}: not one of the {count} shards of {prefix}-NNNNN-of-{count:05}.gguf",
            p.display()
        ))),
    }
}
