#!/usr/bin/env python3
"""Generate the tiny GGUF model fixtures under tests/fixtures/models/.

Run from the repository root with a Python that has `gguf`, `numpy` and
`llama-cpp-python` installed:

    python scripts/gen_model_fixtures.py            # write + verify everything
    python scripts/gen_model_fixtures.py --no-verify

Everything is deterministic: fixed numpy seeds, fixed vocabularies, and
llama.cpp's own quantizer for the Q4_K_M file. Re-running with the same
gguf / llama-cpp-python versions reproduces byte-identical files.

Fixtures (see tests/fixtures/README.md):

  deepseek2-mla-tiny.gguf            deepseek2 (Kimi-K2 / DeepSeek-V3 style), mainline MLA
                                     layout (attn_k_b + attn_v_b), F16 matrices / F32 norms
  deepseek2-legacy-tiny.gguf         same model, legacy layout (attn_kv_b, per-head key/value
                                     lengths, head_count_kv = head_count), no q LoRA (attn_q)
  deepseek2-mla-tiny-Q4_K_M.gguf     fixture 1 quantized by llama.cpp (LLAMA_FTYPE_MOSTLY_Q4_K_M)
  split-tiny-0000N-of-00003.gguf     the Q4_K_M model split into 3 shards, gguf-split layout
  llama-tiny.gguf                    tiny dense llama (GQA 4 heads / 2 kv heads), F16

Checks run by the script (unless --no-verify): every fixture is read back with
gguf.GGUFReader; every fixture loads in llama.cpp and gives finite logits; the
split shards carry exactly gguf-split's keys and give logits identical to the
unsplit Q4_K_M; and the attn_k_b/attn_v_b split reproduces attn_kv_b (llama.cpp
logits of the MLA fixture vs a temporary legacy-layout twin of it).

Next to each model, `<stem>.llama-cpp.json` records what llama.cpp (through
llama-cpp-python) produced for it: the token ids of a fixed prompt and the
logits of every position.  These are reference values for later tests.

Weight layout: every array is written exactly as convert_hf_to_gguf.py would
write it, i.e. the numpy shape is the reverse of the GGUF `ne` shape
(numpy (rows, cols) == GGUF ne {cols, rows}).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.metadata
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import gguf

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "models"

F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16

# --------------------------------------------------------------------------------------
# Hyperparameters
# --------------------------------------------------------------------------------------

N_VOCAB = 512

# deepseek2: Kimi-K2-shaped, scaled down. Every matrix that reads the residual stream
# (n_embd = 256) has ne[0] % 256 == 0, so llama.cpp applies real K-quants to it; the
# low-rank inner dims (128, 64) take llama.cpp's fallback types (q5_0 / q8_0), just as
# attn_k_b (ne[0] = 128) does in the real Kimi-K2 GGUFs.
DS = dict(
    n_vocab=N_VOCAB,
    n_embd=256,
    n_layer=3,  # 1 dense + 2 MoE
    n_layer_dense_lead=1,
    n_ff=256,  # dense FFN (layer 0)
    n_head=4,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    n_expert=8,
    n_expert_used=2,
    n_expert_shared=1,
    n_ff_exp=64,
    n_expert_groups=2,  # DeepSeek-V3 n_group (8 there), Kimi-K2 has 1
    n_group_used=1,  # topk_group
    expert_weights_scale=2.827,  # Kimi-K2 routed_scaling_factor
    expert_weights_norm=True,
    expert_gating_func=int(gguf.ExpertGatingFuncType.SIGMOID),  # 2
    rms_eps=1e-6,
)

# per-fixture context / rope settings (taken from the real configs)
KIMI_ROPE = dict(  # Kimi-K2-Instruct config.json
    context_length=131072,
    rope_freq_base=50000.0,
    rope_scaling_factor=32.0,
    rope_orig_ctx=4096,
    yarn_log_mul=0.1 * 1.0,  # 0.1 * mscale_all_dim, as convert_hf_to_gguf.py writes it
)
DSV3_ROPE = dict(  # DeepSeek-V3 config.json
    context_length=163840,
    rope_freq_base=10000.0,
    rope_scaling_factor=40.0,
    rope_orig_ctx=4096,
    yarn_log_mul=0.1 * 1.0,
)

LLAMA = dict(
    n_vocab=N_VOCAB,
    n_embd=256,
    n_layer=2,
    n_ff=256,
    n_head=4,
    n_head_kv=2,
    context_length=2048,
    rope_freq_base=500000.0,
    rms_eps=1e-5,
)

SEED_DEEPSEEK2 = 20240901
SEED_LLAMA = 20240902

# --------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE (GPT-2 byte->unicode mapping), merges learned from CORPUS
# --------------------------------------------------------------------------------------

CORPUS = """
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun, and the fox
runs into the forest. In the beginning there was the word, and the word was tokenized.
Language models read text as a sequence of tokens. Each token is a small piece of text:
a whole word, part of a word, a space followed by a word, or a single byte. Mixture of
experts models route every token to a few experts out of many; the router scores all the
experts, picks the top ones, and mixes their outputs with the routing weights. Multi-head
latent attention compresses the keys and values into a small latent vector, so the cache
that holds them stays small even for very long contexts. The model then reads the latent
vector back with the absorbed projection matrices.
Hello world! Hello, world. How are you today? I am fine, thank you. What is the time?
It is ten past three in the afternoon. The weather is nice and the sky is blue.
def main():
    for i in range(10):
        print("hello", i)
    return 0
fn main() { let x = 42; println!("{}", x + 1); }
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 2.71828
The inference runtime loads the weights from a GGUF file, maps the tensors into memory,
and runs the forward pass on the CPU or on the GPU. The tokens are streamed back to the
client as soon as they are sampled. Streaming tokens to many clients at the same time is
what the engine does with continuous batching and a shared prompt cache.
"""

# same split idea as the GPT-2 pre-tokenizer, restricted to what Python's `re` can express
PRETOKENIZE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping (in GPT-2 vocab order)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))  # insertion order == GPT-2 token order


def merge_words(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Byte-pair merges learned from words (tuples of byte-level symbols, counted)."""
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        # most frequent pair; ties broken by the lexicographically smallest pair (deterministic)
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        new_words: Counter[tuple[str, ...]] = Counter()
        for w, c in words.items():
            out = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == best[0] and w[i + 1] == best[1]:
                    out.append(joined)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return merges


def learn_merges(n_merges: int) -> list[tuple[str, str]]:
    enc = bytes_to_unicode()
    words = Counter(tuple(enc[b] for b in w.encode("utf-8")) for w in PRETOKENIZE.findall(CORPUS))
    merges = merge_words(words, n_merges)
    if len(merges) < n_merges:
        raise RuntimeError(f"corpus too small: only {len(merges)} merges, wanted {n_merges}")
    return merges


KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

DSV3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}{{ '<｜User｜>' + message['content'] }}"
    "{%- else -%}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)

TOKENIZERS = {
    # Kimi-K2 layout: byte tokens and merges first, special tokens at the end of the vocab
    "kimi-k2": dict(
        pre="kimi-k2",
        head_specials=[],
        tail_specials=[
            "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_middle|>", "[PAD]",
        ],
        bos="[BOS]", eos="<|im_end|>", pad="[PAD]", add_bos=False,
        chat_template=KIMI_CHAT_TEMPLATE,
    ),
    # DeepSeek-V3 layout: BOS/EOS/PAD are ids 0..2, then bytes + merges, chat specials at the end
    "deepseek-v3": dict(
        pre="deepseek-v3",
        head_specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"],
        tail_specials=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                       "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"],
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>", add_bos=True,
        chat_template=DSV3_CHAT_TEMPLATE,
    ),
    # Llama-3 layout: bytes + merges, then <|begin_of_text|> ... specials at the end
    "llama-bpe": dict(
        pre="llama-bpe",
        head_specials=[],
        tail_specials=["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                       "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|reserved_special_token_2|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, add_bos=True,
        chat_template=LLAMA3_CHAT_TEMPLATE,
    ),
}


def build_vocab(kind: str) -> dict:
    spec = TOKENIZERS[kind]
    enc = bytes_to_unicode()
    n_special = len(spec["head_specials"]) + len(spec["tail_specials"])
    n_merges = N_VOCAB - 256 - n_special
    merges = learn_merges(n_merges)
    tokens = list(spec["head_specials"]) + list(enc.values()) + [a + b for a, b in merges] + list(spec["tail_specials"])
    assert len(tokens) == N_VOCAB, len(tokens)
    assert len(set(tokens)) == N_VOCAB, "duplicate token text"
    specials = set(spec["head_specials"]) | set(spec["tail_specials"])
    types = [int(gguf.TokenType.CONTROL) if t in specials else int(gguf.TokenType.NORMAL) for t in tokens]
    return dict(
        pre=spec["pre"],
        tokens=tokens,
        types=types,
        merges=[f"{a} {b}" for a, b in merges],
        bos=tokens.index(spec["bos"]),
        eos=tokens.index(spec["eos"]),
        pad=tokens.index(spec["pad"]) if spec["pad"] else None,
        add_bos=spec["add_bos"],
        chat_template=spec["chat_template"],
    )


def add_tokenizer(w: gguf.GGUFWriter, v: dict) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    if v["pad"] is not None:
        w.add_pad_token_id(v["pad"])
    w.add_add_bos_token(v["add_bos"])
    w.add_chat_template(v["chat_template"])


# --------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------


class Init:
    """Random tensors in numpy (reversed-ne) shape. Scales follow a fan-in init
    (std = 1/sqrt(fan_in), 0.0625 for fan_in 256) so activations stay O(1) and the logits
    have a spread of a few units: later logit comparisons see real signal."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def linear(self, *np_shape: int, gain: float = 1.0) -> np.ndarray:
        fan_in = np_shape[-1]
        return (self.rng.standard_normal(np_shape, dtype=np.float32) * (gain / math.sqrt(fan_in))).astype(np.float32)

    def normal(self, *np_shape: int, std: float) -> np.ndarray:
        return (self.rng.standard_normal(np_shape, dtype=np.float32) * std).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(n, dtype=np.float32)).astype(np.float32)


def deepseek2_weights(r: Init, *, n_layer: int, n_embd: int, n_head: int, n_vocab: int, q_lora_rank: int,
                      kv_lora_rank: int, nope: int, rope: int, v: int, n_ff: int, n_dense_lead: int,
                      n_expert: int, n_ff_exp: int, n_expert_shared: int, router_gain: float, bias_std: float,
                      both_q: bool = False) -> dict[str, np.ndarray]:
    """A deepseek2 checkpoint in GGUF names, numpy shape = reversed ne, f32, drawn in a fixed order.
    The q projection is a LoRA (attn_q_a / attn_q_a_norm / attn_q_b) when q_lora_rank > 0, else a
    plain attn_q; both_q draws both, so that a file with and one without q LoRA share every other
    weight. attn_kv_b is whole (write_deepseek2_tensors splits it for the mainline MLA layout)."""
    qk = nope + rope
    W: dict[str, np.ndarray] = {"token_embd.weight": r.normal(n_vocab, n_embd, std=0.5)}
    for il in range(n_layer):
        b = f"blk.{il}."
        W[b + "attn_norm.weight"] = r.norm(n_embd)
        if q_lora_rank > 0:
            W[b + "attn_q_a.weight"] = r.linear(q_lora_rank, n_embd)
            W[b + "attn_q_a_norm.weight"] = r.norm(q_lora_rank)
            W[b + "attn_q_b.weight"] = r.linear(n_head * qk, q_lora_rank)
        if q_lora_rank == 0 or both_q:
            W[b + "attn_q.weight"] = r.linear(n_head * qk, n_embd)
        W[b + "attn_kv_a_mqa.weight"] = r.linear(kv_lora_rank + rope, n_embd)
        W[b + "attn_kv_a_norm.weight"] = r.norm(kv_lora_rank)
        W[b + "attn_kv_b.weight"] = r.linear(n_head * (nope + v), kv_lora_rank)
        W[b + "attn_output.weight"] = r.linear(n_embd, n_head * v)
        W[b + "ffn_norm.weight"] = r.norm(n_embd)
        if il < n_dense_lead:
            W[b + "ffn_gate.weight"] = r.linear(n_ff, n_embd)
            W[b + "ffn_up.weight"] = r.linear(n_ff, n_embd)
            W[b + "ffn_down.weight"] = r.linear(n_embd, n_ff)
        else:
            W[b + "ffn_gate_inp.weight"] = r.linear(n_expert, n_embd, gain=router_gain)
            W[b + "exp_probs_b.bias"] = r.normal(n_expert, std=bias_std)
            # experts stacked the way convert_hf_to_gguf.py stacks them: (n_expert, out, in)
            W[b + "ffn_gate_exps.weight"] = r.linear(n_expert, n_ff_exp, n_embd)
            W[b + "ffn_up_exps.weight"] = r.linear(n_expert, n_ff_exp, n_embd)
            W[b + "ffn_down_exps.weight"] = r.linear(n_expert, n_embd, n_ff_exp)
            n_sh = n_ff_exp * n_expert_shared  # llama.cpp: ffn_*_shexp width = n_ff_exp * n_expert_shared
            W[b + "ffn_gate_shexp.weight"] = r.linear(n_sh, n_embd)
            W[b + "ffn_up_shexp.weight"] = r.linear(n_sh, n_embd)
            W[b + "ffn_down_shexp.weight"] = r.linear(n_embd, n_sh)
    W["output_norm.weight"] = r.norm(n_embd)
    W["output.weight"] = r.linear(n_vocab, n_embd)
    return W


def split_kv_b(kv_b: np.ndarray, n_head: int, nope: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Exactly DeepseekV2Model.modify_tensors in convert_hf_to_gguf.py (conversion/deepseek.py):
    kv_b (n_head*(nope+v), kv_lora) -> k_b (n_head, kv_lora, nope) [transposed], v_b (n_head, v, kv_lora)."""
    kv = kv_b.reshape(n_head, nope + v, kv_b.shape[-1])
    k_b = np.ascontiguousarray(kv[:, :nope, :].transpose(0, 2, 1))
    v_b = np.ascontiguousarray(kv[:, nope:, :])
    return k_b, v_b


def tensor_dtype(name: str, arr: np.ndarray, all_f32: bool) -> np.ndarray:
    """convert_hf_to_gguf.py's choice for an F16 file: 1-d tensors and the MoE router stay F32."""
    if all_f32 or arr.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        return arr.astype(np.float32)
    return arr.astype(np.float16)


def begin_model(path: Path, arch: str, name: str, *, n_layer: int, context_length: int, n_embd: int, n_ff: int,
                n_head: int, n_head_kv: int, freq_base: float, rms_eps: float) -> gguf.GGUFWriter:
    """A writer holding the keys every model file starts with, in convert_hf_to_gguf.py's order."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(freq_base)
    w.add_layer_norm_rms_eps(rms_eps)
    return w


def add_deepseek2_keys(w: gguf.GGUFWriter, *, n_expert_used: int, groups: tuple[int, int] | None, gating: int,
                       file_type: gguf.LlamaFileType, n_dense_lead: int, n_vocab: int, q_lora_rank: int,
                       kv_lora_rank: int, mla: bool, nope: int, rope: int, v: int, n_ff_exp: int, n_expert: int,
                       n_expert_shared: int, weights_scale: float, weights_norm: bool,
                       yarn: tuple[float, int, float] | None, yarn_betas: tuple[float, float] | None = None) -> None:
    """The deepseek2 keys after begin_model's, in convert_hf_to_gguf.py's order. q_lora_rank 0 = no q
    LoRA: DeepSeek-V2-Lite has none and convert_hf_to_gguf.py then writes no q_lora_rank key, but
    llama.cpp only tolerates the missing key for the real 27-/26-layer "lite" models (it keys that off
    n_layer), so a small file must say 0 explicitly. mla: the mainline layout (MQA over the latent,
    *_mla lengths) vs legacy (MHA after decompression). yarn: (factor, original context, log_mul),
    None = no rope scaling keys; yarn_betas: (beta_fast, beta_slow) keys, written when given."""
    w.add_expert_used_count(n_expert_used)
    if groups:
        w.add_expert_group_count(groups[0])
        w.add_expert_group_used_count(groups[1])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    w.add_file_type(file_type)
    w.add_leading_dense_block_count(n_dense_lead)
    w.add_vocab_size(n_vocab)
    w.add_q_lora_rank(q_lora_rank)
    w.add_kv_lora_rank(kv_lora_rank)
    if mla:
        w.add_key_length(kv_lora_rank + rope)
        w.add_value_length(kv_lora_rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_count(n_expert)
    w.add_expert_shared_count(n_expert_shared)
    w.add_expert_weights_scale(weights_scale)
    w.add_expert_weights_norm(weights_norm)
    w.add_rope_dimension_count(rope)
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
        if yarn_betas:
            w.add_rope_scaling_yarn_beta_fast(yarn_betas[0])
            w.add_rope_scaling_yarn_beta_slow(yarn_betas[1])
        w.add_rope_scaling_yarn_log_mul(yarn[2])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_deepseek2_tensors(w: gguf.GGUFWriter, W: dict[str, np.ndarray], *, q_lora: bool, mla: bool, n_head: int,
                          nope: int, v: int, exp_probs_b: bool = True, all_f32: bool = False) -> None:
    """deepseek2_weights' tensors as the converter writes them: the q projection q_lora picks, kv_b
    split into k_b / v_b for the mainline MLA layout, exp_probs_b only where the model has one."""
    for name, arr in W.items():
        lora_q = "attn_q_a" in name or "attn_q_b" in name
        if (name.endswith("attn_q.weight") and q_lora) or (lora_q and not q_lora):
            continue
        if name.endswith("exp_probs_b.bias") and not exp_probs_b:
            continue
        if name.endswith("attn_kv_b.weight") and mla:
            k_b, v_b = split_kv_b(arr, n_head, nope, v)
            w.add_tensor(name.replace("attn_kv_b", "attn_k_b"), tensor_dtype(name, k_b, all_f32))
            w.add_tensor(name.replace("attn_kv_b", "attn_v_b"), tensor_dtype(name, v_b, all_f32))
            continue
        w.add_tensor(name, tensor_dtype(name, arr, all_f32))


def write_deepseek2(path: Path, mla: bool, q_lora: bool | None = None, kimi: bool | None = None,
                    name: str | None = None) -> None:
    """mla: mainline layout (attn_k_b/attn_v_b, head_count_kv 1, *_mla keys) vs legacy (attn_kv_b).
    q_lora (default = mla): attn_q_a/attn_q_a_norm/attn_q_b vs a plain attn_q.
    kimi (default = mla): Kimi-K2 rope/context/tokenizer vs DeepSeek-V3 ones.
    Every variant has the same weights (the q LoRA and the plain q are both drawn)."""
    h = DS
    q_lora = mla if q_lora is None else q_lora
    kimi = mla if kimi is None else kimi
    rope = KIMI_ROPE if kimi else DSV3_ROPE
    vocab = build_vocab("kimi-k2" if kimi else "deepseek-v3")
    dims = dict(n_head=h["n_head"], nope=h["qk_nope_head_dim"], v=h["v_head_dim"])
    W = deepseek2_weights(Init(SEED_DEEPSEEK2), n_layer=h["n_layer"], n_embd=h["n_embd"], n_vocab=h["n_vocab"],
                          q_lora_rank=h["q_lora_rank"], kv_lora_rank=h["kv_lora_rank"],
                          rope=h["qk_rope_head_dim"], n_ff=h["n_ff"], n_dense_lead=h["n_layer_dense_lead"],
                          n_expert=h["n_expert"], n_ff_exp=h["n_ff_exp"], n_expert_shared=h["n_expert_shared"],
                          router_gain=1.6, bias_std=0.2, both_q=True, **dims)

    title = name or "Tandem Tiny DeepSeek2 " + ("MLA (Kimi-K2 layout)" if mla else "legacy (attn_kv_b, no q LoRA)")
    w = begin_model(path, "deepseek2", title, n_layer=h["n_layer"], context_length=rope["context_length"],
                    n_embd=h["n_embd"], n_ff=h["n_ff"], n_head=h["n_head"],
                    n_head_kv=1 if mla else h["n_head"], freq_base=rope["rope_freq_base"], rms_eps=h["rms_eps"])
    add_deepseek2_keys(w, n_expert_used=h["n_expert_used"], groups=(h["n_expert_groups"], h["n_group_used"]),
                       gating=h["expert_gating_func"], file_type=gguf.LlamaFileType.MOSTLY_F16,
                       n_dense_lead=h["n_layer_dense_lead"], n_vocab=h["n_vocab"],
                       q_lora_rank=h["q_lora_rank"] if q_lora else 0, kv_lora_rank=h["kv_lora_rank"], mla=mla,
                       nope=h["qk_nope_head_dim"], rope=h["qk_rope_head_dim"], v=h["v_head_dim"],
                       n_ff_exp=h["n_ff_exp"], n_expert=h["n_expert"], n_expert_shared=h["n_expert_shared"],
                       weights_scale=h["expert_weights_scale"], weights_norm=h["expert_weights_norm"],
                       yarn=(rope["rope_scaling_factor"], rope["rope_orig_ctx"], rope["yarn_log_mul"]))
    add_tokenizer(w, vocab)
    add_deepseek2_tensors(w, W, q_lora=q_lora, mla=mla, **dims)
    write_and_close(w)


def add_gqa_attention(T: dict[str, np.ndarray], b: str, r: Init, n_embd: int, n_head: int, n_head_kv: int,
                      head_dim: int) -> None:
    """Layer b's attention norm and q / k / v / output projections (grouped-query attention)."""
    T[b + "attn_norm.weight"] = r.norm(n_embd)
    T[b + "attn_q.weight"] = r.linear(n_head * head_dim, n_embd)
    T[b + "attn_k.weight"] = r.linear(n_head_kv * head_dim, n_embd)
    T[b + "attn_v.weight"] = r.linear(n_head_kv * head_dim, n_embd)
    T[b + "attn_output.weight"] = r.linear(n_embd, n_head * head_dim)


def write_llama_model(path: Path, name: str, vocab: dict, r: Init, *, n_layer: int, context_length: int,
                      n_embd: int, n_ff: int, n_head: int, n_head_kv: int, freq_base: float, rms_eps: float,
                      n_vocab: int, all_f32: bool = False) -> None:
    """A llama file with random weights; q/k are in GGUF (llama.cpp) rope layout already, i.e. what
    convert's permute() produces."""
    head_dim = n_embd // n_head
    w = begin_model(path, "llama", name, n_layer=n_layer, context_length=context_length, n_embd=n_embd,
                    n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, freq_base=freq_base, rms_eps=rms_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if all_f32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(n_vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(w, vocab)
    T = {"token_embd.weight": r.normal(n_vocab, n_embd, std=0.5)}
    for il in range(n_layer):
        b = f"blk.{il}."
        add_gqa_attention(T, b, r, n_embd, n_head, n_head_kv, head_dim)
        T[b + "ffn_norm.weight"] = r.norm(n_embd)
        T[b + "ffn_gate.weight"] = r.linear(n_ff, n_embd)
        T[b + "ffn_up.weight"] = r.linear(n_ff, n_embd)
        T[b + "ffn_down.weight"] = r.linear(n_embd, n_ff)
    T["output_norm.weight"] = r.norm(n_embd)
    T["output.weight"] = r.linear(n_vocab, n_embd)
    for name, arr in T.items():
        w.add_tensor(name, tensor_dtype(name, arr, all_f32))
    write_and_close(w)


def write_llama(path: Path) -> None:
    h = LLAMA
    write_llama_model(path, "Tandem Tiny Llama", build_vocab("llama-bpe"), Init(SEED_LLAMA), n_layer=h["n_layer"],
                      context_length=h["context_length"], n_embd=h["n_embd"], n_ff=h["n_ff"], n_head=h["n_head"],
                      n_head_kv=h["n_head_kv"], freq_base=h["rope_freq_base"], rms_eps=h["rms_eps"],
                      n_vocab=h["n_vocab"])


def write_and_close(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------------------
# llama.cpp: quantize, split, verify
# --------------------------------------------------------------------------------------


def quantize_q4_k_m(src: Path, dst: Path) -> None:
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    params.pure = False
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed with {rc}")


def copy_metadata(r: gguf.GGUFReader, w: gguf.GGUFWriter) -> None:
    """Every key of `r` but the architecture (the writer's own) into `w`, with its types."""
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), vtype)


def split_gguf(src: Path, dst_base: Path, n_split: int) -> list[Path]:
    """Split `src` into `n_split` shards with the keys and layout llama.cpp's gguf-split writes:
    shard 0 carries all metadata + split.no (u16) / split.count (u16) / split.tensors.count (i32),
    the other shards only those three keys; tensors in the original order, spread over the shards;
    names `<base>-0000N-of-0000M.gguf`."""
    r = gguf.GGUFReader(src)
    n_tensors = len(r.tensors)
    per = math.ceil(n_tensors / n_split)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst_base), arch, split_max_tensors=per)
    copy_metadata(r, w)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    write_and_close(w)
    shards = [dst_base.with_name(f"{dst_base.stem}-{i + 1:05d}-of-{n_split:05d}.gguf") for i in range(n_split)]
    # the exact key layout gguf-split produces
    for i, s in enumerate(shards):
        f = gguf.GGUFReader(s).fields
        keys = [k for k in f if not k.startswith("GGUF.")]
        if i > 0:
            assert keys == ["split.no", "split.count", "split.tensors.count"], keys
        assert keys[-3:] == ["split.no", "split.count", "split.tensors.count"], keys
        assert f["split.no"].types == [gguf.GGUFValueType.UINT16] and f["split.no"].contents() == i
        assert f["split.count"].types == [gguf.GGUFValueType.UINT16] and f["split.count"].contents() == n_split
        assert f["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        assert f["split.tensors.count"].contents() == n_tensors
    return shards


PROMPT = b"Hello world! The quick brown fox."


def verify_llama_cpp(path: Path) -> dict:
    """Load with llama.cpp, evaluate the prompt, check every logit is finite."""
    import llama_cpp

    def load(verbose: bool):
        return llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=verbose, seed=0)

    try:
        llm = load(False)
    except Exception as e:  # re-run verbosely so the llama.cpp error is visible
        print(f"  llama.cpp rejected {path.name}: {e}; reloading verbosely:", flush=True)
        load(True)
        raise
    toks = llm.tokenize(PROMPT, add_bos=True, special=False)  # add_bos=True: BOS iff the vocab says add_bos_token
    llm.reset()
    llm.eval(toks)
    logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
    finite = bool(np.isfinite(logits).all())
    meta = dict(llm.metadata)
    res = dict(
        model=path.name,
        producer=f"llama.cpp via llama-cpp-python {llama_cpp.__version__} (CPU, n_ctx=64, F16 KV cache)",
        prompt=PROMPT.decode(),
        add_special=True,
        tokens=[int(x) for x in toks],
        pieces=[llm.detokenize([int(x)], special=True).decode("utf-8", errors="backslashreplace") for x in toks],
        n_vocab=int(llm.n_vocab()),
        logits_finite=finite,
        argmax=[int(i) for i in logits.argmax(axis=1)],
        # logits[i] = next-token logits after tokens[:i+1]; 6 significant digits
        logits=[[float(f"{v:.6g}") for v in row] for row in logits],
    )
    print(f"  llama.cpp: loaded {path.name}: n_vocab={res['n_vocab']} tokens={res['tokens']} "
          f"finite={finite} logits[0][:4]={[round(v, 4) for v in logits[0][:4]]} "
          f"std={logits.std():.3f} argmax={res['argmax']} (metadata keys: {len(meta)})", flush=True)
    del llm
    if not finite:
        raise RuntimeError(f"non-finite logits for {path.name}")
    return res


def check_mla_split(mla_path: Path, mla_res: dict) -> None:
    """The k_b/v_b split is only right if llama.cpp's absorbed-MLA path on the MLA fixture computes
    the same function as its plain-MHA path on the unsplit kv_b. Write a temporary legacy-layout twin
    of the MLA fixture (same weights, same q LoRA, attn_kv_b instead of attn_k_b/attn_v_b), run
    both through llama.cpp and compare the logits (they differ only by F16 rounding)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        twin = Path(d) / "deepseek2-mla-twin-legacy.gguf"
        write_deepseek2(twin, mla=False, q_lora=True, kimi=True, name="MLA twin, legacy layout")
        res = verify_llama_cpp(twin)
    a = np.array(mla_res["logits"], dtype=np.float32)
    b = np.array(res["logits"], dtype=np.float32)
    assert mla_res["tokens"] == res["tokens"]
    err = float(np.abs(a - b).max())
    rel = err / float(np.abs(b).max())
    print(f"  MLA (attn_k_b/attn_v_b) vs legacy twin (attn_kv_b): max |diff| = {err:.2e} (rel {rel:.2e}), "
          f"argmax equal: {mla_res['argmax'] == res['argmax']}")
    if rel > 2e-2:
        raise RuntimeError("attn_k_b/attn_v_b do not reproduce attn_kv_b: the MLA split is wrong")


def dump_gguf(path: Path) -> None:
    r = gguf.GGUFReader(path)
    kv = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    print(f"  {path.name}: {len(kv)} kv, {len(r.tensors)} tensors")
    for k, f in kv.items():
        if k.startswith("tokenizer.ggml.") and f.types[0] == gguf.GGUFValueType.ARRAY:
            print(f"    {k}: array[{f.types[-1].name}, {len(f.data)}]")
        elif k == "tokenizer.chat_template":
            print(f"    {k}: <{len(f.contents())} chars>")
        else:
            print(f"    {k} ({f.types[0].name}) = {f.contents()}")
    for t in r.tensors:
        print(f"    {t.name:32s} {t.tensor_type.name:5s} ne={list(int(x) for x in t.shape)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-verify", action="store_true", help="skip the llama.cpp load/eval check")
    ap.add_argument("--quiet-dump", action="store_true", help="do not print every tensor")
    args = ap.parse_args()

    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    libggml = sorted(p.name for p in libdir.glob("libggml-base.so.*.*.*")) if libdir.is_dir() else []
    print(f"gguf {importlib.metadata.version('gguf')}, numpy {np.__version__}, "
          f"llama-cpp-python {llama_cpp.__version__} ({', '.join(libggml) or 'libggml version unknown'})")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for old in OUT_DIR.glob("split-tiny-*.gguf"):
        old.unlink()

    mla = OUT_DIR / "deepseek2-mla-tiny.gguf"
    legacy = OUT_DIR / "deepseek2-legacy-tiny.gguf"
    q4 = OUT_DIR / "deepseek2-mla-tiny-Q4_K_M.gguf"
    llama = OUT_DIR / "llama-tiny.gguf"

    write_deepseek2(mla, mla=True)
    write_deepseek2(legacy, mla=False)
    quantize_q4_k_m(mla, q4)
    shards = split_gguf(q4, OUT_DIR / "split-tiny.gguf", 3)
    write_llama(llama)

    written = [mla, legacy, q4, *shards, llama]
    print("\nwritten:")
    for p in written:
        digest = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        print(f"  {str(p.relative_to(REPO)):52s} {p.stat().st_size:>10,d} bytes  sha256 {digest}...")
    total = sum(p.stat().st_size for p in written)
    print(f"  total {total:,d} bytes ({total / 2**20:.2f} MiB)")

    print("\ngguf.GGUFReader:")
    for p in written:
        if args.quiet_dump:
            r = gguf.GGUFReader(p)
            print(f"  {p.name}: {len(r.tensors)} tensors")
        else:
            dump_gguf(p)

    if not args.no_verify:
        print("\nllama.cpp (llama-cpp-python) load + eval:")
        results = {}
        for p in [mla, legacy, q4, shards[0], llama]:
            res = results[p] = verify_llama_cpp(p)
            stem = "split-tiny" if p == shards[0] else p.stem
            ref = OUT_DIR / f"{stem}.llama-cpp.json"
            ref.write_text(json.dumps(res, separators=(",", ":")) + "\n")
            print(f"  wrote {ref.relative_to(REPO)} ({ref.stat().st_size:,d} bytes)")
        check_mla_split(mla, results[mla])
        same = results[q4]["logits"] == results[shards[0]]["logits"]
        print(f"  split-tiny logits identical to deepseek2-mla-tiny-Q4_K_M: {same}")
        if not same:
            raise RuntimeError("split model and its source disagree")
        print("\nall fixtures load in llama.cpp and give finite logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
