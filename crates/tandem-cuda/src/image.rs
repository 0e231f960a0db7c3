//! Compiled kernel images. The root package's build.rs compiles `kernels/*.cu` with nvcc and embeds
//! the results as a static list of [`Image`]s, which it hands to the runtime; a build without nvcc
//! hands an empty list, and the runtime then says the binary was built without kernels.

/// What an image holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for exactly one architecture, e.g. `sm: 90` for sm_90.
    Cubin { sm: u32 },
    /// PTX for `compute_<sm>`, which a driver at least as new as the nvcc that made it can JIT for
    /// newer architectures.
    Ptx { sm: u32 },
}

/// One compiled kernel file (`kernels/<file>.cu`).
#[derive(Clone, Copy, Debug)]
pub struct Image {
    /// The file stem, e.g. `rmsnorm`.
    pub file: &'static str,
    pub kind: ImageKind,
    pub bytes: &'static [u8],
}
