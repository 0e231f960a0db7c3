#!/usr/bin/env python3
"""Generate the benchmark models: a 12-layer deepseek2 GGUF with Kimi-K2's real attention shapes.

    /work/venv/bin/python scripts/gen_bench_model.py [--out-dir /work/bench-models]
        [--types Q4_K_M,Q8_0] [--keep-f16] [--verify-only] [--from bench-Q8_0.gguf]

Writes <out-dir>/bench-Q4_K_M.gguf (about 2.2 GB) and <out-dir>/bench-Q8_0.gguf (about 3.9 GB),
quantized by llama.cpp's own quantizer (llama_model_quantize, nthread 2) from an F16 source
(about 7.3 GB) that is deleted afterwards unless --keep-f16. The models are far too big for the
repository: keep them outside it. Needs a Python with gguf, numpy and llama-cpp-python.
With --from FILE the types are requantized from that GGUF instead (llama.cpp's allow_requantize:
no F16 source, the weights of FILE rounded again), e.g. --from bench-Q8_0.gguf --types Q4_0,Q2_K
where the disk has no room for the F16 source.

    /work/venv/bin/python scripts/gen_bench_model.py --from bench-Q4_K_M.gguf --grid-types IQ1_S,IQ2_XXS

writes bench-<TYPE>.gguf for the IQ1/IQ2/IQ3 types (1-3 bit experts, as in unsloth's Kimi and
DeepSeek GGUFs): FILE's tensors with the routed experts (ffn_{gate,up,down}_exps) replaced by
random blocks of TYPE, their fp16 scales set so the weights' RMS is 0.02 as in the F16 source.
llama.cpp quantizes these types only with an importance matrix, and its quantizer (ggml's
quantize_iq*) takes about half an hour per GB of weights here (0.2-2 M weights per second and
thread): far too slow for 3.3 G expert weights. Random blocks cost the kernels the same work as
quantized ones (every bit pattern is a valid block, and the grid tables sit in L1/L2 either way),
so these files measure speed only; their logits mean nothing.

Shapes (per layer where it applies), everything else as scripts/gen_model_fixtures.py writes it
(mainline MLA layout attn_k_b + attn_v_b, Kimi-K2 tokenizer layout and chat template):

  vocab 32000, hidden 2048, 12 layers (layer 0 dense FFN 4096, 11 MoE), 16 heads,
  q_lora_rank 768, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128,
  64 routed experts (FFN 768), 6 used, 1 shared expert, sigmoid gating + exp_probs_b,
  normalized top-k weights * 2.827, 1 expert group, YaRN x32 over 4096 (Kimi-K2 config.json).

Weights are N(0, 0.02) (router bias N(0, 0.02) too), norms exactly 1, so activations stay
finite and routing spreads over all experts. Memory: tensors are generated one at a time and
streamed to the file (GGUFWriter.write_tensor_data), so the writer holds one expert tensor
(~0.6 GB) at a time; the quantizer and the check map the files (max RSS of a whole run, mapped
pages included: 3.9 GB). Deterministic: one numpy seed, tensors generated in file order.
Time on 2 busy cores: F16 2.6 min, Q4_K_M 9 min, Q8_0 1 min, check 0.5 min.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_model_fixtures import (KIMI_ROPE, TOKENIZERS, add_deepseek2_keys, add_tokenizer, begin_model,  # noqa: E402
                                bytes_to_unicode, copy_metadata)

F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16
QK_K = 256

DEFAULT_OUT_DIR = Path("/work/bench-models")
SEED = 20251130
WEIGHT_STD = 0.02

H = dict(
    n_vocab=32000,
    n_embd=2048,
    n_layer=12,
    n_layer_dense_lead=1,
    n_ff=4096,  # dense FFN (layer 0)
    n_head=16,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_expert=64,
    n_expert_used=6,
    n_expert_shared=1,
    n_ff_exp=768,
    n_expert_groups=1,  # Kimi-K2: n_group 1, topk_group 1
    n_group_used=1,
    expert_weights_scale=2.827,  # Kimi-K2 routed_scaling_factor
    expert_weights_norm=True,
    rms_eps=1e-6,
)
# Kimi-K2-Instruct config.json rope_scaling: beta_fast 1, beta_slow 1, mscale 1, mscale_all_dim 1
YARN_BETA_FAST = 1.0
YARN_BETA_SLOW = 1.0

FTYPES = {
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
}


# --------------------------------------------------------------------------------------
# Tokenizer: 32000 entries in Kimi-K2 layout (bytes, merges, specials at the end)
# --------------------------------------------------------------------------------------


def synthetic_vocab(n_vocab: int) -> dict:
    """Byte-level BPE vocab of exactly n_vocab tokens. The merges are synthetic but valid:
    every merged token is (prefix token) + (one letter), prefixes listed before it, so each
    merge's halves are tokens of lower rank. Words: lowercase letters with an optional GPT-2
    space marker 'Ġ' in front, shortest first, then lexicographic."""
    spec = TOKENIZERS["kimi-k2"]
    enc = bytes_to_unicode()
    specials = list(spec["tail_specials"])
    n_merges = n_vocab - 256 - len(specials)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    space = enc[ord(" ")]  # 'Ġ'
    merges: list[tuple[str, str]] = []
    level = [space] + letters  # length-1 strings (already byte tokens)
    while len(merges) < n_merges:
        nxt = []
        for s in level:
            for c in letters:
                nxt.append(s + c)
                merges.append((s, c))
                if len(merges) == n_merges:
                    break
            if len(merges) == n_merges:
                break
        level = nxt
    tokens = list(enc.values()) + [a + b for a, b in merges] + specials
    assert len(tokens) == n_vocab and len(set(tokens)) == n_vocab
    types = [int(gguf.TokenType.CONTROL) if t in specials else int(gguf.TokenType.NORMAL) for t in tokens]
    return dict(
        pre=spec["pre"], tokens=tokens, types=types, merges=[f"{a} {b}" for a, b in merges],
        bos=tokens.index(spec["bos"]), eos=tokens.index(spec["eos"]), pad=tokens.index(spec["pad"]),
        add_bos=spec["add_bos"], chat_template=spec["chat_template"],
    )


# --------------------------------------------------------------------------------------
# Tensors: (name, numpy shape = reversed GGUF ne, dtype, generator)
# --------------------------------------------------------------------------------------

TensorSpec = tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]]


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= WEIGHT_STD
    return a


def ones(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return np.ones(shape, dtype=np.float32)


def tensor_specs() -> Iterator[TensorSpec]:
    h = H
    d, nh = h["n_embd"], h["n_head"]
    qk_head = h["qk_nope_head_dim"] + h["qk_rope_head_dim"]
    yield "token_embd.weight", (h["n_vocab"], d), F16, normal
    for il in range(h["n_layer"]):
        b = f"blk.{il}."
        yield b + "attn_norm.weight", (d,), F32, ones
        yield b + "attn_q_a.weight", (h["q_lora_rank"], d), F16, normal
        yield b + "attn_q_a_norm.weight", (h["q_lora_rank"],), F32, ones
        yield b + "attn_q_b.weight", (nh * qk_head, h["q_lora_rank"]), F16, normal
        yield b + "attn_kv_a_mqa.weight", (h["kv_lora_rank"] + h["qk_rope_head_dim"], d), F16, normal
        yield b + "attn_kv_a_norm.weight", (h["kv_lora_rank"],), F32, ones
        # convert_hf_to_gguf.py (conversion/deepseek.py): k_b (n_head, kv_lora, nope) transposed,
        # v_b (n_head, v, kv_lora)
        yield b + "attn_k_b.weight", (nh, h["kv_lora_rank"], h["qk_nope_head_dim"]), F16, normal
        yield b + "attn_v_b.weight", (nh, h["v_head_dim"], h["kv_lora_rank"]), F16, normal
        yield b + "attn_output.weight", (d, nh * h["v_head_dim"]), F16, normal
        yield b + "ffn_norm.weight", (d,), F32, ones
        if il < h["n_layer_dense_lead"]:
            yield b + "ffn_gate.weight", (h["n_ff"], d), F16, normal
            yield b + "ffn_up.weight", (h["n_ff"], d), F16, normal
            yield b + "ffn_down.weight", (d, h["n_ff"]), F16, normal
        else:
            ne, ff = h["n_expert"], h["n_ff_exp"]
            yield b + "ffn_gate_inp.weight", (ne, d), F32, normal  # convert keeps the router F32
            yield b + "exp_probs_b.bias", (ne,), F32, normal
            yield b + "ffn_gate_exps.weight", (ne, ff, d), F16, normal
            yield b + "ffn_up_exps.weight", (ne, ff, d), F16, normal
            yield b + "ffn_down_exps.weight", (ne, d, ff), F16, normal
            ff_sh = ff * h["n_expert_shared"]
            yield b + "ffn_gate_shexp.weight", (ff_sh, d), F16, normal
            yield b + "ffn_up_shexp.weight", (ff_sh, d), F16, normal
            yield b + "ffn_down_shexp.weight", (d, ff_sh), F16, normal
    yield "output_norm.weight", (d,), F32, ones
    yield "output.weight", (h["n_vocab"], d), F16, normal


def write_f16(path: Path) -> None:
    h = H
    rope = KIMI_ROPE
    w = begin_model(path, "deepseek2", "Tandem Bench DeepSeek2 (Kimi-K2 attention shapes, 12 layers, 64 experts)",
                    n_layer=h["n_layer"], context_length=rope["context_length"], n_embd=h["n_embd"], n_ff=h["n_ff"],
                    n_head=h["n_head"], n_head_kv=1,  # mainline MLA: MQA over the latent
                    freq_base=rope["rope_freq_base"], rms_eps=h["rms_eps"])
    add_deepseek2_keys(w, n_expert_used=h["n_expert_used"], groups=(h["n_expert_groups"], h["n_group_used"]),
                       gating=gguf.ExpertGatingFuncType.SIGMOID, file_type=gguf.LlamaFileType.MOSTLY_F16,
                       n_dense_lead=h["n_layer_dense_lead"], n_vocab=h["n_vocab"], q_lora_rank=h["q_lora_rank"],
                       kv_lora_rank=h["kv_lora_rank"], mla=True, nope=h["qk_nope_head_dim"],
                       rope=h["qk_rope_head_dim"], v=h["v_head_dim"], n_ff_exp=h["n_ff_exp"], n_expert=h["n_expert"],
                       n_expert_shared=h["n_expert_shared"], weights_scale=h["expert_weights_scale"],
                       weights_norm=h["expert_weights_norm"],
                       yarn=(rope["rope_scaling_factor"], rope["rope_orig_ctx"], rope["yarn_log_mul"]),
                       yarn_betas=(YARN_BETA_FAST, YARN_BETA_SLOW))
    add_tokenizer(w, synthetic_vocab(h["n_vocab"]))

    specs = list(tensor_specs())
    for name, shape, dtype, _ in specs:
        np_dtype = np.float16 if dtype == F16 else np.float32
        w.add_tensor_info(name, shape, np.dtype(np_dtype), math.prod(shape) * np.dtype(np_dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(SEED)
    total = sum(math.prod(s) for _, s, _, _ in specs)
    done = 0
    t0 = time.time()
    last = 0.0
    for i, (name, shape, dtype, gen) in enumerate(specs):
        a = gen(rng, shape)
        if dtype == F16:
            a = a.astype(np.float16)
        w.write_tensor_data(a)
        del a
        done += math.prod(shape)
        now = time.time()
        if now - last > 5 or i == len(specs) - 1:
            last = now
            print(f"  f16: {i + 1}/{len(specs)} tensors, {done / 1e9:.2f}/{total / 1e9:.2f} G params, "
                  f"{now - t0:.0f} s", flush=True)
    w.close()


# --------------------------------------------------------------------------------------
# llama.cpp: quantize and verify
# --------------------------------------------------------------------------------------


def quantize(src: Path, dst: Path, qtype: str, requantize: bool = False) -> None:
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[qtype])
    params.nthread = 2
    params.pure = False
    params.allow_requantize = requantize
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({qtype}) failed with {rc}")


VERIFY_TOKENS = [1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]


def verify(path: Path) -> None:
    """Load with llama.cpp (CPU, 2 threads), evaluate a few tokens, every logit must be finite."""
    import llama_cpp

    t0 = time.time()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, n_threads_batch=2,
                          logits_all=True, verbose=False, seed=0)
    llm.reset()
    llm.eval(VERIFY_TOKENS)
    logits = np.array(llm.scores[: len(VERIFY_TOKENS)], dtype=np.float32)
    finite = bool(np.isfinite(logits).all())
    print(f"  llama.cpp: {path.name}: n_vocab={llm.n_vocab()} tokens={VERIFY_TOKENS} finite={finite} "
          f"logits std={logits.std():.3f} absmax={np.abs(logits).max():.3f} "
          f"argmax={[int(x) for x in logits.argmax(axis=1)]} ({time.time() - t0:.1f} s)", flush=True)
    del llm
    if not finite:
        raise RuntimeError(f"non-finite logits for {path.name}")


# The IQ1/IQ2/IQ3 types --grid-types writes, with their ggml type ids.
GRID_TYPES = {"IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ3_S": 21, "IQ2_S": 22, "IQ1_M": 29}


def random_grid_blocks(rng: np.random.Generator, qtype: gguf.GGMLQuantizationType, n_blocks: int,
                       d: float) -> np.ndarray:
    """n_blocks random blocks of qtype whose fp16 scale is d (IQ1_M: spread over its scale words)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    bits = np.uint16(np.float16(d).view(np.uint16))
    if qtype == gguf.GGMLQuantizationType.IQ1_M:
        words = raw[:, 48:56].copy().view("<u2")
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    else:
        raw[:, 0:2] = np.array([bits], dtype="<u2").view(np.uint8)
    return raw


def write_grid_model(src: Path, dst: Path, name: str) -> None:
    """src's tensors with the routed experts replaced by random blocks of the grid type `name`."""
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(GRID_TYPES[name])
    # The fp16 scale that gives weights of RMS 0.02, from 64 random blocks with scale 1.
    probe = gguf.quants.dequantize(random_grid_blocks(rng, qtype, 64, 1.0).ravel(), qtype)
    d = 0.02 / float(np.sqrt(np.mean(np.square(probe, dtype=np.float64))))
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    copy_metadata(r, w)
    for t in r.tensors:
        if "_exps." in t.name:
            ne = [int(x) for x in t.shape]  # ne0, ne1, ne2
            n_blocks = ne[0] // QK_K * ne[1] * ne[2]
            blocks = random_grid_blocks(rng, qtype, n_blocks, d)
            w.add_tensor(t.name, blocks.reshape(ne[2], ne[1], -1), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    ap.add_argument("--types", default="Q4_K_M,Q8_0", help="comma-separated: " + ",".join(FTYPES))
    ap.add_argument("--keep-f16", action="store_true", help="keep bench-F16.gguf")
    ap.add_argument("--verify-only", action="store_true", help="only run the llama.cpp check")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--from", dest="source", type=Path, help="requantize from this GGUF instead of an F16 source")
    ap.add_argument("--grid-types", default="", help="with --from: routed experts as random blocks of these: "
                    + ",".join(GRID_TYPES))
    args = ap.parse_args()

    if args.grid_types:
        if not args.source or not args.source.is_file():
            ap.error("--grid-types needs --from FILE")
        t_all = time.time()
        for t in args.grid_types.split(","):
            if t not in GRID_TYPES:
                ap.error(f"unknown grid type {t!r}")
            out = args.out_dir / f"bench-{t}.gguf"
            print(f"{args.source} -> {out} (routed experts: random {t} blocks)", flush=True)
            write_grid_model(args.source, out, t)
            print(f"  {out.stat().st_size:,d} bytes", flush=True)
            if not args.no_verify:
                verify(out)
        print(f"done in {time.time() - t_all:.0f} s")
        return 0

    types = [t for t in args.types.split(",") if t]
    for t in types:
        if t not in FTYPES:
            ap.error(f"unknown type {t!r}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    f16 = args.out_dir / "bench-F16.gguf"
    outs = {t: args.out_dir / f"bench-{t}.gguf" for t in types}

    t_all = time.time()
    if args.source and not args.verify_only:
        if not args.source.is_file():
            ap.error(f"--from {args.source}: not a file")
        for t, out in outs.items():
            t0 = time.time()
            print(f"requantizing {args.source} -> {out} ({t}, llama_model_quantize, nthread 2)", flush=True)
            quantize(args.source, out, t, requantize=True)
            print(f"  {out.stat().st_size:,d} bytes in {time.time() - t0:.0f} s", flush=True)
    elif not args.verify_only:
        t0 = time.time()
        print(f"writing {f16}", flush=True)
        write_f16(f16)
        print(f"  {f16.stat().st_size:,d} bytes in {time.time() - t0:.0f} s", flush=True)
        for t, out in outs.items():
            t0 = time.time()
            print(f"quantizing -> {out} ({t}, llama_model_quantize, nthread 2)", flush=True)
            quantize(f16, out, t)
            print(f"  {out.stat().st_size:,d} bytes in {time.time() - t0:.0f} s", flush=True)
        if not args.keep_f16:
            f16.unlink()
            print(f"deleted {f16}")
    if not args.no_verify:
        print("llama.cpp load + eval:", flush=True)
        for out in outs.values():
            verify(out)
    print(f"done in {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
