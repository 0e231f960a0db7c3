#!/usr/bin/env python3
"""Generate tests/fixtures/sampling/llama_cpp_dry.json: what llama.cpp's DRY sampler subtracts from
fixed logits after a token history, the oracle of tandem's DRY (crates/tandem-engine/src/sampling.rs).

    /work/venv/bin/python scripts/gen_dry_fixtures.py

For two of llama.cpp's vocabularies (tests/fixtures/tokenizer/llama-cpp-vocab: a BPE one,
deepseek-llm, and an SPM one, llama-spm, loaded vocab-only) and several parameter sets and
sequence breakers, llama_sampler_init_dry (of the llama.cpp llama-cpp-python was built from;
declared here with that llama.h's signature) accepts a history of tokens (texts with repeats,
tokenized by llama.cpp) and is applied with llama_sampler_apply to zero logits over the whole
vocabulary; every token whose logit changed is recorded with its new logit (the penalty,
negated). The breakers are processed against the vocabulary by llama.cpp itself, so the cases
check tandem's processing of them too.
"""
import ctypes
import json
from pathlib import Path

import llama_cpp as L

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests/fixtures/sampling/llama_cpp_dry.json"
VOCABS = ["ggml-vocab-deepseek-llm.gguf", "ggml-vocab-llama-spm.gguf"]
DEFAULT_BREAKERS = ["\n", ":", "\"", "*"]

lib = L.llama_cpp._lib
init_dry = lib.llama_sampler_init_dry
init_dry.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int32, ctypes.c_int32,
                     ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t]
init_dry.restype = L.llama_sampler_init_typical.restype  # llama_sampler *

TEXTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "Q: what is it?\nA: it is a cat.\nQ: what is it?\nA: it is a",
    'He said "one two three" and "one two three" and then "one two',
    "* item one\n* item two\n* item one\n* item two\n* item",
    "abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc abc",
]

PARAMS = [  # multiplier, base, allowed_length, penalty_last_n, breakers
    (0.8, 1.75, 2, 64, DEFAULT_BREAKERS),
    (0.8, 1.75, 2, 8, DEFAULT_BREAKERS),
    (1.5, 2.0, 1, 64, DEFAULT_BREAKERS),
    (0.8, 1.75, 3, 64, ["the mat", "one two", "is a"]),
    (0.8, 1.75, 0, 64, ["\n"]),
    (0.5, 1.1, 2, 1024, []),
    (2.0, 40.0, 1, 64, DEFAULT_BREAKERS),  # large exponents: the clamp
]


def tokenize(vocab, text):
    buf = (ctypes.c_int * 512)()
    n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 512, False, False)
    assert n > 0
    return list(buf[:n])


def penalties(vocab, n_vocab, history, mult, base, allowed, last_n, breakers):
    arr = (ctypes.c_char_p * max(1, len(breakers)))(*[b.encode() for b in breakers])
    smpl = init_dry(vocab, mult, base, allowed, last_n, arr, len(breakers))
    for t in history:
        L.llama_sampler_accept(smpl, t)
    data = (L.llama_token_data * n_vocab)()
    for i in range(n_vocab):
        data[i].id, data[i].logit, data[i].p = i, 0.0, 0.0
    cur = L.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
    L.llama_sampler_apply(smpl, ctypes.byref(cur))
    out = {}
    for i in range(cur.size):
        if cur.data[i].logit != 0.0:
            out[str(cur.data[i].id)] = cur.data[i].logit
    L.llama_sampler_free(smpl)
    return out


def main():
    L.llama_backend_init()
    cases = []
    for name in VOCABS:
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        model = L.llama_model_load_from_file(str(REPO / "tests/fixtures/tokenizer/llama-cpp-vocab" / name).encode(), mp)
        assert model
        vocab = L.llama_model_get_vocab(model)
        n_vocab = L.llama_vocab_n_tokens(vocab)
        for text in TEXTS:
            history = tokenize(vocab, text)
            for mult, base, allowed, last_n, breakers in PARAMS:
                got = penalties(vocab, n_vocab, history, mult, base, allowed, last_n, breakers)
                cases.append(dict(vocab=name, history=history, multiplier=mult, base=base, allowed_length=allowed,
                                  penalty_last_n=last_n, breakers=breakers, logits=got))
        L.llama_model_free(model)
    OUT.write_text(json.dumps(dict(llama_cpp_python=L.__version__, cases=cases), indent=0) + "\n")
    print(f"{OUT}: {len(cases)} cases; penalized tokens {[len(c['logits']) for c in cases]}")


if __name__ == "__main__":
    main()
