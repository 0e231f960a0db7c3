#!/usr/bin/env python3
"""Generate tests/fixtures/sampling/llama_cpp_samplers.json: which tokens llama.cpp's own samplers
leave on fixed logits, the oracle of tandem's sampler filters (crates/tandem-engine/src/sampling.rs).

    /work/venv/bin/python scripts/gen_sampler_fixtures.py

Each sampler of llama-cpp-python (the llama.cpp it was built from) is applied with
llama_sampler_apply to a llama_token_data_array of the logits, unsorted, as a sampler chain hands
it over: locally typical (min_keep 0, as llama-server passes), top-n-sigma, XTC with probability 1
(min_keep 0) and mirostat 1 (m 100) and 2 at their first step (mu = 2 tau). The survivors are the
tokens left with a finite logit (top-n-sigma sets the others to -inf; mirostat draws afterwards,
which changes nothing of what it kept). Deterministic: one numpy seed.
"""
import ctypes
import json
from pathlib import Path

import numpy as np
import llama_cpp as L

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/sampling/llama_cpp_samplers.json"


def survivors(smpl, logits):
    n = len(logits)
    arr = (L.llama_token_data * n)()
    for i, l in enumerate(logits):
        arr[i].id, arr[i].logit, arr[i].p = i, float(l), 0.0
    cur = L.llama_token_data_array(data=arr, size=n, selected=-1, sorted=False)
    L.llama_sampler_apply(smpl, ctypes.byref(cur))
    ids = sorted(cur.data[i].id for i in range(cur.size) if np.isfinite(cur.data[i].logit))
    L.llama_sampler_free(smpl)
    return ids


def main():
    rng = np.random.default_rng(20261207)
    n = 200
    peaked = rng.normal(0, 1, n)
    peaked[17] += 9.0
    peaked[3] += 6.5
    rows = {
        "normal-1": rng.normal(0, 1, n),
        "normal-3": rng.normal(0, 3, n),
        "peaked": peaked,
    }
    cases = []
    for name, row in rows.items():
        row = row.astype(np.float32)
        for p in (0.2, 0.5, 0.9, 0.99):
            cases.append({"logits": name, "sampler": "typical", "value": p,
                          "kept": survivors(L.llama_sampler_init_typical(p, 0), row)})
        for s in (0.5, 1.0, 2.0):
            cases.append({"logits": name, "sampler": "top_n_sigma", "value": s,
                          "kept": survivors(L.llama_sampler_init_top_n_sigma(s), row)})
        for t in (0.02, 0.05, 0.1, 0.3):
            cases.append({"logits": name, "sampler": "xtc", "value": t,
                          "kept": survivors(L.llama_sampler_init_xtc(1.0, t, 0, 1), row)})
        for tau in (1.0, 3.0, 5.0, 8.0):
            cases.append({"logits": name, "sampler": "mirostat1", "value": tau,
                          "kept": survivors(L.llama_sampler_init_mirostat(n, 1, tau, 0.1, 100), row)})
            cases.append({"logits": name, "sampler": "mirostat2", "value": tau,
                          "kept": survivors(L.llama_sampler_init_mirostat_v2(1, tau, 0.1), row)})
    out = {
        "llama_cpp_python": L.__version__,
        "logits": {k: [float(x) for x in v.astype(np.float32)] for k, v in rows.items()},
        "cases": cases,
    }
    OUT.write_text(json.dumps(out, indent=0) + "\n")
    print(f"{OUT}: {len(cases)} cases; kept sizes {[len(c['kept']) for c in cases]}")


if __name__ == "__main__":
    main()
