#!/usr/bin/env bash
# Builds tandem with the CUDA kernels (--features cuda) and checks the images build.rs made:
# the embedded-images test, ptxas over each PTX for every target architecture plus sm_100 (a GPU no
# cubin fits, which only the PTX serves), register spills, and cuobjdump's function list per cubin
# when the toolkit has cuobjdump. Needs nvcc: NVCC or CUDA_HOME, else the toolkit is installed
# into .cuda-venv/ (scripts/install-cuda-toolkit.sh). No GPU needed.
#
#     scripts/check-cuda-build.sh [--release]
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${NVCC:-}" ] && [ -z "${CUDA_HOME:-}" ]; then
    cuda_env=$(scripts/install-cuda-toolkit.sh)
    eval "$cuda_env"
fi
nvcc=${NVCC:-$CUDA_HOME/bin/nvcc}
bin=$(dirname "$nvcc")
"$nvcc" --version | tail -n 2 | head -n 1
export TANDEM_REQUIRE_KERNELS=1

start=$(date +%s)
out_dir=$(cargo build --locked --features cuda "$@" --message-format=json-render-diagnostics |
    scripts/cargo_artifacts.py | awk '$1 == "out-dir" && $2 == "tandem" { print $3 }')
echo "cargo build --features cuda: $(( $(date +%s) - start )) s"
images="$out_dir/kernels"
if [ -z "$out_dir" ] || ! ls "$images"/*.cubin >/dev/null 2>&1; then
    echo "check-cuda-build: no kernel images under '${images}' (see the build's warnings)" >&2
    exit 1
fi
ls -l "$images"

cargo test --locked --features cuda "$@" --test cuda_images -- --nocapture

archs=$(ls "$images" | sed -n 's/.*\.sm_\([0-9]*\)\.cubin$/\1/p' | sort -un | tr '\n' ' ')
fail=0
for ptx in "$images"/*.ptx; do
    for sm in $archs 100; do
        if ! "${PTXAS:-$bin/ptxas}" -arch="sm_$sm" -O3 --warn-on-spills "$ptx" -o /dev/null 2>"$images/.ptxas.log"; then
            echo "ptxas sm_$sm $(basename "$ptx"): FAILED"; cat "$images/.ptxas.log"; fail=1
        elif [ -s "$images/.ptxas.log" ]; then
            echo "ptxas sm_$sm $(basename "$ptx"):"; cat "$images/.ptxas.log"
        fi
    done
done
echo "ptxas: every PTX assembled for sm ${archs}and sm 100 (a GPU only the PTX serves)"

cuobjdump=$(command -v cuobjdump || true)
[ -x "$bin/cuobjdump" ] && cuobjdump="$bin/cuobjdump"
if [ -n "$cuobjdump" ]; then
    for cubin in "$images"/*.cubin; do
        echo "$(basename "$cubin"): $("$cuobjdump" -elf "$cubin" | grep -o 'tandem_[A-Za-z0-9_]*' | sort -u | tr '\n' ' ')"
    done
else
    echo "cuobjdump: not in this toolkit (pip nvidia-cuda-cuobjdump has no 13.0 build); the test above read the cubins' ELF headers and symbols"
fi
rm -f "$images/.ptxas.log"
exit $fail
