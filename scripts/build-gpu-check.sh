#!/usr/bin/env bash
# Builds, on a machine with Rust and no GPU, everything scripts/gpu-check.sh runs on a GPU machine
# that has no Rust: the release `tandem` binary with the CUDA kernels embedded, and the test
# executables of tests/kernels.rs, tests/gpu.rs and tests/gpu_fallback.rs, stripped, into one
# folder with a manifest.
#
#     scripts/build-gpu-check.sh [DIR]        # default DIR: target/gpu-check
#
# Then carry DIR (an ignored path) to the GPU machine with the working tree and run
#     scripts/gpu-check.sh DIR [BENCH_MODEL_DIR]
# nvcc comes from NVCC or CUDA_HOME, else scripts/install-cuda-toolkit.sh installs it (no GPU needed).
# Set CARGO_TARGET_DIR as usual; the kernels are required (TANDEM_REQUIRE_KERNELS=1), so a build
# without nvcc fails here instead of producing a binary that can only fall back to the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-target/gpu-check}

if [ -z "${NVCC:-}" ] && [ -z "${CUDA_HOME:-}" ]; then
    eval "$(scripts/install-cuda-toolkit.sh)"
fi
# The GPU machine has 16 cores: the emulated half of tests/kernels.rs spreads its blocks over them.
export TANDEM_REQUIRE_KERNELS=1

log() { echo "build-gpu-check: $*" >&2; }
start=$(date +%s)
# Executables from cargo's JSON messages: the `tandem` binary and the three test targets.
exes=$(cargo test --release --locked --features cuda --no-run --test gpu --test gpu_fallback --test kernels \
        --message-format=json-render-diagnostics | scripts/cargo_artifacts.py |
    awk '$1 == "bin" && $2 == "tandem" { print "tandem", $3 }
         $1 == "test" && ($2 == "gpu" || $2 == "gpu_fallback" || $2 == "kernels") { print "test-" $2, $3 }')
log "cargo build: $(( $(date +%s) - start )) s"
for want in tandem test-gpu test-gpu_fallback test-kernels; do
    if ! grep -q "^$want " <<<"$exes"; then
        log "cargo did not report the $want executable"
        exit 1
    fi
done

rm -rf "$dir"
mkdir -p "$dir"
: >"$dir/manifest.txt"
while read -r name path; do
    cp "$path" "$dir/$name"
    # Debug info is most of the size; the carry limit is 64 MiB for everything.
    strip --strip-all "$dir/$name" 2>/dev/null || true
    echo "$name $name" >>"$dir/manifest.txt"
done <<<"$exes"
{
    echo "# built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+changes')"
    echo "# $("${NVCC:-$CUDA_HOME/bin/nvcc}" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'nvcc ?'), ptxas $("${PTXAS:-ptxas}" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo '(nvcc'"'"'s)'), TANDEM_CUDA_ARCHS=${TANDEM_CUDA_ARCHS:-80;86;89;90;120 (default)}"
} >>"$dir/manifest.txt"
ls -l "$dir" >&2
size=$(du -sm "$dir" | cut -f1)
log "$dir: ${size} MiB"
if [ "$size" -gt 60 ]; then
    log "warning: more than 60 MiB; the device tool carries at most 64 MiB in all"
fi
echo "carry: $dir"
echo "run:   scripts/gpu-check.sh $dir [BENCH_MODEL_DIR]"
