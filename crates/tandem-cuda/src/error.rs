//! Why the CUDA backend cannot be used or an operation failed: one variant per cause, each a
//! one-line message that callers print as `tandem: CUDA unavailable (<message>); ...`.

/// Why the CUDA backend cannot be used, or why a device operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("tandem was built without CUDA support")]
    BuiltWithoutCuda,
    #[error("TANDEM_CUDA_GEMM={0}: use f32 (the default) or f16")]
    GemmSetting(String),
    #[error("no CUDA driver found: libcuda.so could not be loaded")]
    NoDriver,
    #[error("the CUDA driver failed to {what}: {reason}")]
    Driver { what: String, reason: String },
    #[error("no CUDA device found")]
    NoDevice,
    #[error("CUDA{ordinal} does not exist ({count} CUDA device(s) found)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("tandem was built without kernels (nvcc was not found when it was built)")]
    NoKernels,
    #[error("kernel image not loadable on {device} sm_{sm}: {reason}")]
    KernelLoad { device: String, sm: u32, reason: String },
    #[error("kernel {name} is missing from the kernel images (kernels/{file}.cu)")]
    MissingKernel { name: String, file: &'static str },
    #[error("out of GPU memory on {device}: {what} needs {bytes} bytes")]
    OutOfMemory { device: String, what: String, bytes: usize },
    #[error("{kernel} failed on {device}: {reason}")]
    Launch { kernel: String, device: String, reason: String },
    #[error("cuBLAS: {0}")]
    Cublas(String),
    #[error("no CUDA kernel for tensor type {0}")]
    UnsupportedType(tandem_quant::GgmlType),
    #[error("CUDA shape check: {0}")]
    Shape(String),
    #[error("no kernel emulator: {0}")]
    Emulator(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
