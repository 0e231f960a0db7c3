#!/usr/bin/env bash
# Installs a working nvcc (CUDA 13.0) and CUDA 12.8's ptxas from PyPI into a Python virtual
# environment, without root and without a GPU, and prints the environment that points build.rs at
# them:
#
#     eval "$(scripts/install-cuda-toolkit.sh)"        # default DIR: .cuda-venv/ in the repository
#     scripts/install-cuda-toolkit.sh /opt/cuda-venv
#
# The wheels put bin/ (nvcc, ptxas, ...), include/ (with cccl/) and nvvm/ under
# site-packages/nvidia/cu13, and nvcc.profile finds all of it relative to bin/. Re-running is cheap:
# an existing install of the same versions is only checked.
#
# nvcc compiles the kernels to PTX; CUDA 12.8's ptxas (PyPI has no CUDA 12 nvcc, but has its
# ptxas) assembles the cubins from that PTX, its `.version` lowered to 8.7 (build.rs), so that the
# images load on drivers for CUDA 12.8 (R570) and newer, not only on CUDA 13's (R580). 12.8 is the
# first CUDA 12 to target sm_120 (RTX 50xx, RTX PRO 6000).
set -euo pipefail

CUDA_VERSION=13.0.88
PACKAGES=(
    "nvidia-cuda-nvcc==${CUDA_VERSION}"    # nvcc, ptxas, nvlink, fatbinary, cudafe++
    "nvidia-nvvm==${CUDA_VERSION}"         # cicc and libdevice
    "nvidia-cuda-crt==${CUDA_VERSION}"     # include/crt (host/device headers nvcc includes)
    "nvidia-cuda-runtime==${CUDA_VERSION}" # cuda_runtime.h, cuda_fp16.h
    "nvidia-cuda-cccl==13.0.85"            # include/cccl (nv/target, cuda/std) the fp16 headers use
    "nvidia-cuda-nvcc-cu12==12.8.93"       # CUDA 12.8's ptxas (nvidia/cuda_nvcc/bin/ptxas)
)

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-"$repo/.cuda-venv"}
log() { echo "install-cuda-toolkit: $*" >&2; }

python=${PYTHON:-python3}
if [ ! -x "$dir/bin/python" ]; then
    log "creating a virtual environment in $dir"
    "$python" -m venv "$dir" >&2 || { log "'$python -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
fi
site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cuda_home="$site/nvidia/cu13"
nvcc="$cuda_home/bin/nvcc"
ptxas12="$site/nvidia/cuda_nvcc/bin/ptxas"
stamp="$dir/.tandem-cuda-toolkit"

if [ "$(cat "$stamp" 2>/dev/null || true)" != "${PACKAGES[*]}" ] || ! "$nvcc" --version >/dev/null 2>&1; then
    log "pip install ${PACKAGES[*]}"
    "$dir/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "${PACKAGES[@]}" >&2
    # Wheels may lose the executable bit on some installers; every tool nvcc runs needs it.
    chmod +x "$cuda_home"/bin/* "$cuda_home"/nvvm/bin/* "$ptxas12" 2>/dev/null || true
    printf '%s' "${PACKAGES[*]}" >"$stamp"
fi

# nvcc.profile (TOP = bin/..) gives cicc (nvvm/bin), libdevice (nvvm/libdevice), include/ and
# include/cccl; nvcc still needs a host C++ compiler (g++) on the PATH to preprocess.
if ! command -v "${CXX:-g++}" >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
    log "warning: no host C++ compiler (g++) on the PATH; nvcc needs one"
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
cat >"$probe/probe.cu" <<'CU'
#include <cuda_fp16.h>
extern "C" __global__ void probe(const float* x, __half* y) { y[threadIdx.x] = __float2half(x[threadIdx.x]); }
CU
if ! "$nvcc" -std=c++17 -cubin -arch=sm_90 "$probe/probe.cu" -o "$probe/probe.cubin" >&2; then
    log "nvcc at $nvcc cannot compile a test kernel"
    exit 1
fi
log "$("$nvcc" --version | tail -n 2 | head -n 1) at $nvcc"
if ! "$ptxas12" --version >/dev/null 2>&1; then
    log "CUDA 12.8's ptxas at $ptxas12 does not run"
    exit 1
fi
log "ptxas $("$ptxas12" --version | tail -n 2 | head -n 1 | grep -o 'release [0-9.]*') at $ptxas12"

echo "export NVCC='$nvcc'"
echo "export CUDA_HOME='$cuda_home'"
echo "export PTXAS='$ptxas12'"
