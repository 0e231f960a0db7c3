//! The CUDA kernel images build.rs compiled from `kernels/*.cu` (see kernels/ABI.md): a cubin per
//! architecture of `TANDEM_CUDA_ARCHS` and PTX for the oldest, for every kernel file. Empty when
//! built without the `cuda` feature or without nvcc; the runtime then runs everything on the CPU.

include!(concat!(env!("OUT_DIR"), "/tandem_kernels.rs"));

/// Every embedded kernel image (empty in a build without kernels).
pub fn images() -> &'static [tandem_cuda::Image] {
    IMAGES
}
