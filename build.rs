//! Build script. The CUDA issue adds kernel compilation (kernels/*.cu -> cubin/PTX) behind the
//! `cuda` feature; without it, and always without nvcc, the build must succeed CPU-only.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rustc-check-cfg=cfg(tandem_cuda_kernels)");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo:warning=tandem: the `cuda` feature has no kernels yet; building CPU-only");
    }
}
