#!/usr/bin/env python3
"""llama.cpp's logits of an inference fixture with its metadata overridden (`--override-kv`),
for tests/logits_override.rs:

    python scripts/gen_override_fixture.py   # a Python with numpy and llama-cpp-python 0.3.36

For deepseek2-mla-f32 (F32 weights and cache: tandem must match llama.cpp to 1e-3 of max|logit|)
with `deepseek2.expert_used_count` overridden from 3 to 1 it writes, under
tests/fixtures/inference/overrides/,

  deepseek2-mla-f32.expert_used_count-1.logits.f32   little-endian f32 [n_tokens, n_vocab]
  deepseek2-mla-f32.expert_used_count-1.json         the override, the tokens, how it was made

The tokens are the fixture's own (tests/fixtures/inference/deepseek2-mla-f32.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import llama_cpp

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "tests" / "fixtures" / "inference"
OUT = SRC / "overrides"
MODEL = "deepseek2-mla-f32"
KEY, VALUE = "deepseek2.expert_used_count", 1


def logits(path: Path, tokens: list[int], overrides: dict | None) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=512, n_ubatch=512, n_threads=2,
                          n_threads_batch=2, logits_all=True, flash_attn=False, verbose=False, seed=0,
                          kv_overrides=overrides, type_k=0, type_v=0)  # the fixture's f32 cache
    llm.eval(tokens)
    out = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.close()
    return out


def main() -> None:
    fixture = json.loads((SRC / f"{MODEL}.json").read_text())
    tokens = fixture["tokens"]
    model = SRC / f"{MODEL}.gguf"
    plain = logits(model, tokens, None)
    got = logits(model, tokens, {KEY: VALUE})
    reference = np.fromfile(SRC / fixture["logits_file"], dtype="<f4").reshape(plain.shape)
    scale = np.abs(reference).max(axis=1)
    # the plain run must be the fixture's (the same llama.cpp), the override must change it
    same = float((np.abs(plain - reference).max(axis=1) / scale).max())
    print(f"plain run against the fixture: worst {same:.2e}")
    assert same < 1e-4, same
    moved = float(np.median(np.abs(got - plain).max(axis=1) / scale))
    assert moved > 1e-2, moved
    OUT.mkdir(exist_ok=True)
    stem = f"{MODEL}.{KEY.split('.')[-1]}-{VALUE}"
    got.astype("<f4").tofile(OUT / f"{stem}.logits.f32")
    meta = dict(model=f"{MODEL}.gguf", override=f"{KEY}=int:{VALUE}", file_value=fixture["hparams"].get("n_expert_used"),
                tokens=tokens, n_vocab=int(got.shape[1]), logits_file=f"{stem}.logits.f32",
                median_moved_by_override=moved,
                llama_cpp=dict(llama_cpp_python=llama_cpp.__version__, n_ctx=256, n_threads=2, flash_attn=False, cache="f32",
                               api="llama_cpp.Llama(..., kv_overrides={KEY: VALUE}, logits_all=True).eval(tokens)"))
    (OUT / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{stem}: median max|d| / max|logit| against the plain run {moved:.3f}")


if __name__ == "__main__":
    main()
