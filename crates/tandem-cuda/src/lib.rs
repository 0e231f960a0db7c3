//! CUDA backend. The CUDA issue puts the cudarc runtime behind the `cuda` feature; until then (and in
//! every build without that feature) this crate is the stand-in that says why there is no GPU, so
//! callers never write `#[cfg(feature = "cuda")]`.

mod image;
pub use image::{Image, ImageKind};

/// Why the CUDA backend cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("tandem was built without CUDA support; running everything on the CPU")]
    BuiltWithoutCuda,
}

/// Opens the CUDA runtime. In this build it always reports [`Error::BuiltWithoutCuda`].
pub fn init() -> Result<(), Error> {
    Err(Error::BuiltWithoutCuda)
}
