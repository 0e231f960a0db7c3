#!/usr/bin/env python3
"""Generate the golden fixtures of crates/tandem-quant/tests/fixtures/.

Run with the project venv (PyPI `gguf`, `numpy`, `llama-cpp-python`):

    /work/venv/bin/python scripts/gen_quant_fixtures.py

Two oracles, both from the registries (see DESIGN.md "Oracles"):

a) Dequantization, `dequant_<type>.bin`: random blocks (fixed seed) whose fp16/f32 scale fields
   are overwritten with finite, modest values, decoded by PyPI gguf's numpy dequantizer
   (`gguf.quants.dequantize`). gguf has no Q8_1 and no Q8_K dequantizer: Q8_K is decoded by
   ggml's own C `dequantize_row_q8_K` (libggml-base.so shipped in llama-cpp-python, called via
   ctypes); ggml has no Q8_1 decoder at all, so Q8_1 is decoded in numpy as d*q (its meaning,
   the same formula as Q8_0). Every type gguf decodes is also decoded with ggml's C
   `dequantize_row_*` / `ggml_fp16_to_fp32_row` / `ggml_bf16_to_fp32_row`, and the script fails
   if the two oracles disagree in a single bit, with one exception: numpy passes fp16 signalling
   NaNs through signalling, while ggml returns them quieted; the fixture keeps ggml's bits.

b) Quantization, `quant_input.bin` + `quant_<type>.bin`: a tiny F32 llama GGUF with random
   weights (outliers, mixed scales, zero/constant/tiny rows) is quantized by llama.cpp's own
   quantizer (`llama_model_quantize`, pure, no importance matrix) to each storage type; the
   quantized rows are read back with gguf.GGUFReader. Rows from several tensors are kept (all
   ggml reference quantizers are block-local, so a row subset is a valid test). Q8_1 and Q8_K,
   which are activation types and never stored in files, are quantized from the same rows with
   ggml's C `quantize_row_q8_1_ref` / `quantize_row_q8_K_ref` via ctypes.

c) vec_dot, `vecdot_act_<type>.bin` + `vecdot_<type>.bin`: ggml's scalar kernels
   (ggml-cpu/quants.c `ggml_vec_dot_*_generic`) compiled here with `cc -O2 -ffp-contract=off`
   (no SIMD, no FMA: ggml's scalar build) from the llama.cpp sources of the installed
   llama-cpp-python, applied to weight rows of (b) and activation rows quantized by ggml's C
   `quantize_row_*_ref`. F32/F16/BF16 follow the scalar branch of ggml-cpu/vec.cpp (f32 products,
   f64 sum), computed in numpy. The result of ggml's SIMD kernel (libggml-cpu.so of the wheel) is
   recorded too, for comparison with a tolerance. The sources are taken from $LLAMA_CPP_SRC
   (a llama.cpp checkout, or vendor/llama.cpp of the llama-cpp-python sdist); without it this
   part is skipped and the committed vecdot fixtures are kept.

d) The IQ1/IQ2/IQ3 types (`--grid-types` regenerates only these): llama.cpp quantizes them only
   with an importance matrix, so their fixtures are random blocks (every bit pattern is a valid
   block; the fp16 scale set as in (a), for IQ1_M spread over its scale words' top nibbles) from
   a generator of their own, so adding them changed no other fixture. `dequant_<type>.bin` as in
   (a), decoded by gguf.quants and ggml's C `dequantize_row_*`, which must agree bit for bit;
   `vecdot_<type>.bin` as in (c), each block a 256-element weight row against the committed
   `vecdot_act_q8_K.bin` rows, its weight rows indexing the blocks of `dequant_<type>.bin`.

File formats (little-endian):
  dequant_<type>.bin: u32 n_blocks | n_blocks*type_size raw bytes | n_blocks*block_size f32
  quant_input.bin:    u32 n_rows | u32 n_per_row | n_rows*n_per_row f32
  quant_<type>.bin:   u32 n_rows | n_rows u32 row indices into quant_input | quantized rows
  vecdot_act_<type>.bin: u32 n_rows | u32 n_per_row | activation rows of that type
  vecdot_<type>.bin:  u32 n | n x (u32 weight row, u32 activation row) | n f32 scalar | n f32 SIMD
                      (weight rows index quant_<type>.bin, or quant_input.bin for f32)
"""

import ctypes
import importlib.metadata
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import gguf
import llama_cpp
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates" / "tandem-quant" / "tests" / "fixtures"
LIB_DIR = Path(llama_cpp.__file__).parent / "lib"
QK_K = 256

ggml = ctypes.CDLL(str(LIB_DIR / "libggml-base.so"))

# (gguf type, ggml C dequantizer name or None, byte offsets of fp16 scale fields)
DEQUANT_TYPES = {
    "f32": (T.F32, None, []),
    "f16": (T.F16, "ggml_fp16_to_fp32_row", []),
    "bf16": (T.BF16, "ggml_bf16_to_fp32_row", []),
    "q4_0": (T.Q4_0, "dequantize_row_q4_0", [0]),
    "q4_1": (T.Q4_1, "dequantize_row_q4_1", [0, 2]),
    "q5_0": (T.Q5_0, "dequantize_row_q5_0", [0]),
    "q5_1": (T.Q5_1, "dequantize_row_q5_1", [0, 2]),
    "q8_0": (T.Q8_0, "dequantize_row_q8_0", [0]),
    "q8_1": (T.Q8_1, None, [0, 2]),
    "q2_K": (T.Q2_K, "dequantize_row_q2_K", [80, 82]),
    "q3_K": (T.Q3_K, "dequantize_row_q3_K", [108]),
    "q4_K": (T.Q4_K, "dequantize_row_q4_K", [0, 2]),
    "q5_K": (T.Q5_K, "dequantize_row_q5_K", [0, 2]),
    "q6_K": (T.Q6_K, "dequantize_row_q6_K", [208]),
    "q8_K": (T.Q8_K, "dequantize_row_q8_K", []),  # f32 d at offset 0, set below
    "iq4_nl": (T.IQ4_NL, "dequantize_row_iq4_nl", [0]),
    "iq4_xs": (T.IQ4_XS, "dequantize_row_iq4_xs", [0]),
}

# ggml type name -> llama ftype whose `pure` default type it is.
QUANT_FTYPES = {
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "q3_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "q4_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q5_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "iq4_nl": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL,
    "iq4_xs": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS,
    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
}


def ggml_c_dequantize(fn_name: str, raw: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float32)
    fn = getattr(ggml, fn_name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    src = np.ascontiguousarray(raw)
    fn(src.ctypes.data, out.ctypes.data, n)
    return out


def ggml_c_quantize_ref(fn_name: str, x: np.ndarray, type_size: int, block: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    out = np.zeros(x.size // block * type_size, dtype=np.uint8)  # zeroed: see Q8_K bsums note
    fn = getattr(ggml, fn_name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def random_scales(rng: np.random.Generator, count: int) -> np.ndarray:
    """Finite fp16 scales over many binades, with zeros and fp16 subnormals mixed in."""
    mag = rng.uniform(0.5, 1.0, count) * 2.0 ** rng.integers(-16, 3, count)
    vals = (mag * rng.choice([-1.0, 1.0], count)).astype(np.float16)
    vals[rng.random(count) < 0.05] = 0.0
    return vals


def gen_dequant(rng: np.random.Generator) -> list[str]:
    report = []
    for name, (qtype, c_fn, scale_offsets) in DEQUANT_TYPES.items():
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if qtype == T.Q8_1:
            # gguf-py still lists the old 40-byte Q8_1 (f32 d and s); ggml's block_q8_1 is 36 bytes.
            type_size = 36
        n_elems = 512 if block == 1 else (8 * QK_K if block == QK_K else 32 * block)
        n_blocks = n_elems // block
        raw = rng.integers(0, 256, n_blocks * type_size, dtype=np.uint8).reshape(n_blocks, type_size)
        for off in scale_offsets:
            raw[:, off:off + 2] = random_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        if qtype == T.Q8_K:
            d = (rng.uniform(-1, 1, n_blocks) * 2.0 ** rng.integers(-12, 0, n_blocks)).astype(np.float32)
            raw[:, 0:4] = d.view(np.uint8).reshape(n_blocks, 4)
        raw = raw.ravel()
        if qtype == T.Q8_K:
            expected, oracle = ggml_c_dequantize(c_fn, raw, n_elems), "ggml C dequantize_row_q8_K"
        elif qtype == T.Q8_1:
            blocks = raw.reshape(n_blocks, type_size)
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
            qs = blocks[:, 4:].view(np.int8).astype(np.float32)
            expected, oracle = (qs * d).ravel(), "numpy d*q (no decoder in gguf or ggml)"
        else:
            expected = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).ravel()
            oracle = "gguf.quants"
            if c_fn is not None:
                c_out = ggml_c_dequantize(c_fn, raw, n_elems)
                ours, theirs = c_out.view(np.uint32), expected.view(np.uint32)
                bad = ours != theirs
                # numpy keeps fp16 signalling NaNs signalling; ggml (software and F16C alike)
                # returns them quieted. The fixture takes ggml's bits for those elements.
                snan = bad & ((ours & 0x7FC00000) == 0x7FC00000) & ((theirs | 0x00400000) == ours)
                if (bad & ~snan).any():
                    first = np.flatnonzero(bad & ~snan)[0]
                    sys.exit(f"{name}: gguf.quants and ggml C disagree at element {first}")
                expected = c_out
                oracle += " (== ggml C, bit for bit"
                oracle += f"; {snan.sum()} signalling NaNs quieted as ggml does)" if snan.any() else ")"
        assert expected.size == n_elems, (name, expected.size, n_elems)
        data = struct.pack("<I", n_blocks) + raw.tobytes() + expected.astype("<f4").tobytes()
        (OUT / f"dequant_{name}.bin").write_bytes(data)
        report.append(f"dequant_{name}.bin: {n_blocks} blocks, {len(data)} bytes, oracle {oracle}")
    return report


# --- quantization -------------------------------------------------------------------------------

N_EMBD, N_FF, N_VOCAB, N_HEAD = 256, 512, 64, 2


def special_rows(rng: np.random.Generator, n_rows: int, n: int) -> np.ndarray:
    """Rows that take the unusual branches of the quantizers."""
    rows = []
    rows.append(np.zeros(n))                                      # all zero
    rows.append(np.full(n, 0.37))                                 # constant positive
    rows.append(np.full(n, -1.25))                                # constant negative
    r = np.zeros(n); r[rng.integers(0, n, 4)] = [3.0, -7.5, 0.001, 12.0]
    rows.append(r)                                                # a few spikes in zeros
    rows.append(np.abs(rng.normal(0, 1, n)))                      # all positive
    rows.append(-np.abs(rng.normal(0, 0.01, n)))                  # all negative, small
    rows.append(rng.normal(0, 1e-18, n))                          # below GROUP_MAX_EPS
    rows.append(rng.integers(-16, 17, n) * 0.5)                   # rounding ties
    rows.append(rng.normal(0, 1, n) * 10.0 ** rng.integers(-6, 3, n))  # wild per-element scales
    r = rng.normal(0, 1, n); r[::32] *= 300.0
    rows.append(r)                                                # one outlier per 32-block
    r = rng.normal(0, 1, n).reshape(-1, 32) * 10.0 ** rng.uniform(-4, 2, (n // 32, 1))
    rows.append(r.ravel())                                        # per-block scales 1e-4..1e2
    r = rng.normal(0, 1, n); r[rng.random(n) < 0.5] = 0.0
    rows.append(r)                                                # half zeros
    rows.append(rng.standard_t(2, n))                             # heavy tails
    rows.append(rng.uniform(-1, 1, n) * 1e-30)                    # tiny (fp16 scale underflows)
    while len(rows) < n_rows:
        rows.append(rng.normal(0, 10.0 ** rng.uniform(-3, 1), n))
    return np.stack(rows[:n_rows]).astype(np.float32)


def weights(rng: np.random.Generator, n_rows: int, n: int, kind: str) -> np.ndarray:
    if kind == "special":
        return special_rows(rng, n_rows, n)
    if kind == "outliers":
        w = rng.normal(0, 0.02, (n_rows, n))
        mask = rng.random((n_rows, n)) < 0.01
        w[mask] = rng.normal(0, 2.0, mask.sum())
        return w.astype(np.float32)
    if kind == "blockscale":
        w = rng.normal(0, 1, (n_rows, n // 32, 32)) * 10.0 ** rng.uniform(-3, 1, (n_rows, n // 32, 1))
        return w.reshape(n_rows, n).astype(np.float32)
    return (rng.normal(0, 1, (n_rows, n)) * 10.0 ** rng.uniform(-2, 0.5, (n_rows, 1))).astype(np.float32)


def build_f32_model(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tandem-quant-fixture")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # ALL_F32
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(N_VOCAB - 3)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * N_VOCAB)
    w.add_token_types([2, 3, 3] + [1] * (N_VOCAB - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    tensors = {
        "token_embd.weight": weights(rng, N_VOCAB, N_EMBD, "gauss"),
        "blk.0.attn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        "blk.0.attn_q.weight": weights(rng, N_EMBD, N_EMBD, "special"),
        "blk.0.attn_k.weight": weights(rng, N_EMBD, N_EMBD, "outliers"),
        "blk.0.attn_v.weight": weights(rng, N_EMBD, N_EMBD, "blockscale"),
        "blk.0.attn_output.weight": weights(rng, N_EMBD, N_EMBD, "gauss"),
        "blk.0.ffn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        "blk.0.ffn_gate.weight": weights(rng, N_FF, N_EMBD, "gauss"),
        "blk.0.ffn_up.weight": weights(rng, N_FF, N_EMBD, "outliers"),
        "blk.0.ffn_down.weight": weights(rng, N_EMBD, N_FF, "blockscale"),
        "output_norm.weight": np.ones(N_EMBD, dtype=np.float32),
        "output.weight": weights(rng, N_VOCAB, N_EMBD, "gauss"),
    }
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


# Rows kept in the fixture: (tensor, row indices). All have 256 elements per row.
KEEP_ROWS = [
    ("blk.0.attn_q.weight", list(range(0, 24))),          # the special rows + gaussians
    ("blk.0.attn_k.weight", list(range(0, 8))),
    ("blk.0.attn_v.weight", list(range(0, 8))),
    ("blk.0.attn_output.weight", [7, 100, 200, 255]),
    ("blk.0.ffn_gate.weight", [1, 50, 99, 150, 222, 300, 404, 511]),
    ("blk.0.ffn_up.weight", [3, 300, 301, 500]),
    ("token_embd.weight", [0, 63, 17, 40]),
    ("output.weight", [5, 6, 7, 8]),
]
# F16 / BF16 rows are large and their conversion has no search: the attn_q rows are enough.
SMALL_KEEP = {"f16", "bf16"}


def quantize_with_llama(src: Path, dst: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = True
    params.nthread = 1
    assert not params.imatrix, "default params must carry no importance matrix"
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize(ftype={ftype}) returned {rc}")


def gen_quant(rng: np.random.Generator) -> list[str]:
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "f32.gguf"
        tensors = build_f32_model(src, rng)
        inputs = np.concatenate([tensors[t][rows] for t, rows in KEEP_ROWS]).astype(np.float32)
        n_rows, n_per_row = inputs.shape
        data = struct.pack("<II", n_rows, n_per_row) + inputs.astype("<f4").tobytes()
        (OUT / "quant_input.bin").write_bytes(data)
        report.append(f"quant_input.bin: {n_rows} rows x {n_per_row} f32, {len(data)} bytes")

        for name, ftype in QUANT_FTYPES.items():
            dst = Path(tmp) / f"{name}.gguf"
            quantize_with_llama(src, dst, ftype)
            reader = gguf.GGUFReader(str(dst))
            by_name = {t.name: t for t in reader.tensors}
            want = gguf.GGMLQuantizationType[name.upper()]
            indices, chunks, skipped = [], [], []
            base = 0
            for tname, rows in KEEP_ROWS[:1] if name in SMALL_KEEP else KEEP_ROWS:
                t = by_name[tname]
                if t.tensor_type != want:
                    skipped.append(f"{tname} ({t.tensor_type.name})")
                else:
                    q = np.asarray(t.data).view(np.uint8).reshape(len(tensors[tname]), -1)
                    for k, r in enumerate(rows):
                        indices.append(base + k)
                        chunks.append(q[r].tobytes())
                base += len(rows)
            if not indices:
                sys.exit(f"{name}: llama.cpp produced no tensor of that type")
            blob = struct.pack("<I", len(indices)) + struct.pack(f"<{len(indices)}I", *indices) + b"".join(chunks)
            (OUT / f"quant_{name}.bin").write_bytes(blob)
            note = f"; not {want.name} in llama.cpp's output: {', '.join(skipped)}" if skipped else ""
            report.append(f"quant_{name}.bin: {len(indices)} rows by llama_model_quantize, {len(blob)} bytes{note}")

        for name, fn, block, type_size in [("q8_1", "quantize_row_q8_1_ref", 32, 36),
                                           ("q8_K", "quantize_row_q8_K_ref", QK_K, 292)]:
            q = ggml_c_quantize_ref(fn, inputs, type_size, block)
            blob = struct.pack("<I", n_rows) + struct.pack(f"<{n_rows}I", *range(n_rows)) + q.tobytes()
            (OUT / f"quant_{name}.bin").write_bytes(blob)
            report.append(f"quant_{name}.bin: {n_rows} rows by ggml C {fn}, {len(blob)} bytes")
    return report


# --- vec_dot ------------------------------------------------------------------------------------

VEC_DOT_ACT = {
    "f32": "f32", "f16": "f16", "bf16": "bf16",
    "q4_0": "q8_0", "q5_0": "q8_0", "q8_0": "q8_0", "iq4_nl": "q8_0",
    "q4_1": "q8_1", "q5_1": "q8_1",
    "q2_K": "q8_K", "q3_K": "q8_K", "q4_K": "q8_K", "q5_K": "q8_K", "q6_K": "q8_K", "iq4_xs": "q8_K",
}
GGML_TYPE_ID = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q8_1": 9,
                "q2_K": 10, "q3_K": 11, "q4_K": 12, "q5_K": 13, "q6_K": 14, "q8_K": 15,
                "iq4_nl": 20, "iq4_xs": 23, "bf16": 30}
TYPE_SIZE = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (QK_K, 292)}
N_ACT_ROWS = 8

SHIM_C = r"""
// ggml's scalar vec_dot kernels (ggml-cpu/quants.c *_generic) without SIMD or FMA.
#include "quants.c"
float ggml_table_f32_f16[1 << 16];
float ggml_table_f32_e8m0_half[1 << 8];
float ggml_table_f32_ue4m3[1 << 8];
void shim_init(void) {
    for (int i = 0; i < (1 << 16); ++i) ggml_table_f32_f16[i] = GGML_COMPUTE_FP16_TO_FP32((ggml_fp16_t) i);
}
"""


class CpuTraits(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


VEC_DOT_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def build_scalar_kernels(ggml_src: Path, tmp: Path) -> ctypes.CDLL:
    (tmp / "shim.c").write_text(SHIM_C)
    cmd = ["cc", "-O2", "-std=gnu11", "-ffp-contract=off", "-fPIC", "-shared",
           f"-I{ggml_src / 'include'}", f"-I{ggml_src / 'src'}", f"-I{ggml_src / 'src' / 'ggml-cpu'}",
           str(tmp / "shim.c"), "-o", str(tmp / "libshim.so"),
           f"-L{LIB_DIR}", "-lggml-base", f"-Wl,-rpath,{LIB_DIR}"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(tmp / "libshim.so"))
    lib.shim_init()
    return lib


def scalar_float_dot(wt: str, x: bytes, y: bytes) -> float:
    """ggml-cpu/vec.cpp without GGML_SIMD: f32 products accumulated in f64, in order."""
    if wt == "f32":
        a, b = np.frombuffer(x, "<f4"), np.frombuffer(y, "<f4")
    else:
        dt = "<f2" if wt == "f16" else "<u2"
        a, b = np.frombuffer(x, dt), np.frombuffer(y, dt)
        if wt == "bf16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
            b = (b.astype(np.uint32) << 16).view(np.float32)
        a, b = a.astype(np.float32), b.astype(np.float32)
    products = (a * b).astype(np.float64)
    return float(np.float32(np.cumsum(products)[-1]))


def write_vec_dot(wt: str, at: str, pairs: list[int], scalar: list[float], vec: list[float]) -> str:
    """Writes vecdot_<wt>.bin (format in the module docstring); returns its report line."""
    blob = (struct.pack("<I", len(scalar)) + struct.pack(f"<{len(pairs)}I", *pairs)
            + np.array(scalar, "<f4").tobytes() + np.array(vec, "<f4").tobytes())
    (OUT / f"vecdot_{wt}.bin").write_bytes(blob)
    same = int(np.sum(np.array(scalar, np.float32).view(np.uint32) == np.array(vec, np.float32).view(np.uint32)))
    return (f"vecdot_{wt}.bin: {len(scalar)} dots with {at}, {len(blob)} bytes; "
            f"SIMD equals scalar bit for bit in {same} of {len(scalar)}")


def gen_vec_dot(rng: np.random.Generator) -> list[str]:
    src = os.environ.get("LLAMA_CPP_SRC")
    ggml_src = Path(src) / "ggml" if src else None
    if ggml_src is None or not (ggml_src / "src" / "ggml-cpu" / "quants.c").exists():
        return ["vecdot_*.bin not regenerated: set LLAMA_CPP_SRC to the llama.cpp sources of "
                f"llama-cpp-python {llama_cpp.__version__} (vendor/llama.cpp of its sdist)"]
    report = []
    inputs = np.frombuffer((OUT / "quant_input.bin").read_bytes()[8:], "<f4").reshape(-1, 256)
    n = inputs.shape[1]
    act_f32 = rng.normal(0, 1, (N_ACT_ROWS, n)) * 10.0 ** rng.uniform(-2, 1, (N_ACT_ROWS, 1))
    act_f32[:, ::61] *= 8.0
    act_f32 = act_f32.astype(np.float32)
    acts = {
        "f32": act_f32.tobytes(),
        "f16": act_f32.astype("<f2").tobytes(),
        "bf16": ggml_c_bf16(act_f32),
    }
    for a, fn in [("q8_0", "quantize_row_q8_0_ref"), ("q8_1", "quantize_row_q8_1_ref"), ("q8_K", "quantize_row_q8_K_ref")]:
        block, ts = TYPE_SIZE[a]
        acts[a] = ggml_c_quantize_ref(fn, act_f32, ts, block).tobytes()
    for a, data in acts.items():
        blob = struct.pack("<II", N_ACT_ROWS, n) + data
        (OUT / f"vecdot_act_{a}.bin").write_bytes(blob)
        report.append(f"vecdot_act_{a}.bin: {N_ACT_ROWS} rows, {len(blob)} bytes")

    ggml_cpu = ctypes.CDLL(str(LIB_DIR / "libggml-cpu.so"))
    ggml_cpu.ggml_cpu_init()
    ggml_cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(CpuTraits)
    simd_dots = {"f32": "ggml_vec_dot_f32", "f16": "ggml_vec_dot_f16", "bf16": "ggml_vec_dot_bf16"}
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_scalar_kernels(ggml_src, Path(tmp))
        for wt, at in VEC_DOT_ACT.items():
            if wt == "f32":
                w_rows = [inputs[i].tobytes() for i in range(len(inputs))]
            else:
                b = (OUT / f"quant_{wt}.bin").read_bytes()
                count = struct.unpack_from("<I", b)[0]
                data = b[4 + 4 * count:]
                size = len(data) // count
                w_rows = [data[k * size:(k + 1) * size] for k in range(count)]
            a_size = len(acts[at]) // N_ACT_ROWS
            a_rows = [acts[at][k * a_size:(k + 1) * a_size] for k in range(N_ACT_ROWS)]
            simd = VEC_DOT_FN(ctypes.cast(getattr(ggml_cpu, simd_dots[wt]), ctypes.c_void_p).value) if wt in simd_dots \
                else VEC_DOT_FN(ggml_cpu.ggml_get_type_traits_cpu(GGML_TYPE_ID[wt]).contents.vec_dot)
            pairs, scalar, vec = [], [], []
            for i, w in enumerate(w_rows):
                j = i % N_ACT_ROWS
                out = ctypes.c_float()
                wbuf, abuf = ctypes.create_string_buffer(w, len(w)), ctypes.create_string_buffer(a_rows[j], a_size)
                if wt in simd_dots:
                    scalar.append(scalar_float_dot(wt, w, a_rows[j]))
                else:
                    fn = getattr(shim, f"ggml_vec_dot_{wt}_{at}_generic")
                    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                                   ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                    fn(n, ctypes.byref(out), 0, wbuf, 0, abuf, 0, 1)
                    scalar.append(out.value)
                simd(n, ctypes.byref(out), 0, ctypes.cast(wbuf, ctypes.c_void_p), 0, ctypes.cast(abuf, ctypes.c_void_p), 0, 1)
                vec.append(out.value)
                pairs += [i, j]
            report.append(write_vec_dot(wt, at, pairs, scalar, vec))
    return report


# --- IQ1/IQ2/IQ3 --------------------------------------------------------------------------------

# name -> (gguf type, ggml type id)
GRID_TYPES = {
    "iq2_xxs": (T.IQ2_XXS, 16), "iq2_xs": (T.IQ2_XS, 17), "iq2_s": (T.IQ2_S, 22),
    "iq3_xxs": (T.IQ3_XXS, 18), "iq3_s": (T.IQ3_S, 21), "iq1_s": (T.IQ1_S, 19), "iq1_m": (T.IQ1_M, 29),
}


def gen_grid_types() -> list[str]:
    rng = np.random.default_rng(20261202)
    report = []
    blocks_of = {}
    for name, (qtype, _) in GRID_TYPES.items():
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = 24
        raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
        d = random_scales(rng, n_blocks).view(np.uint16).astype(np.uint16)
        if qtype == T.IQ1_M:
            # d's four nibbles in the top nibble of each u16 scale word (bytes 48..56).
            words = raw[:, 48:56].copy().view("<u2")
            for k in range(4):
                words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
            raw[:, 48:56] = words.view(np.uint8)
        else:
            raw[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
        raw = raw.ravel()
        n = n_blocks * block
        expected = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).ravel()
        c_out = ggml_c_dequantize(f"dequantize_row_{name}", raw, n)
        if (c_out.view(np.uint32) != expected.view(np.uint32)).any():
            first = np.flatnonzero(c_out.view(np.uint32) != expected.view(np.uint32))[0]
            sys.exit(f"{name}: gguf.quants and ggml C disagree at element {first}")
        data = struct.pack("<I", n_blocks) + raw.tobytes() + c_out.astype("<f4").tobytes()
        (OUT / f"dequant_{name}.bin").write_bytes(data)
        report.append(f"dequant_{name}.bin: {n_blocks} blocks, {len(data)} bytes, oracle gguf.quants (== ggml C, bit for bit)")
        blocks_of[name] = raw.reshape(n_blocks, type_size)

    src = os.environ.get("LLAMA_CPP_SRC")
    ggml_src = Path(src) / "ggml" if src else None
    if ggml_src is None or not (ggml_src / "src" / "ggml-cpu" / "quants.c").exists():
        return report + ["vecdot_iq*.bin not regenerated: set LLAMA_CPP_SRC (see (c))"]
    a = (OUT / "vecdot_act_q8_K.bin").read_bytes()
    n_rows, n = struct.unpack_from("<II", a)
    a_size = (len(a) - 8) // n_rows
    a_rows = [a[8 + k * a_size:8 + (k + 1) * a_size] for k in range(n_rows)]
    assert n == QK_K
    ggml_cpu = ctypes.CDLL(str(LIB_DIR / "libggml-cpu.so"))
    ggml_cpu.ggml_cpu_init()
    ggml_cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(CpuTraits)
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_scalar_kernels(ggml_src, Path(tmp))
        for name, (_, type_id) in GRID_TYPES.items():
            simd = VEC_DOT_FN(ggml_cpu.ggml_get_type_traits_cpu(type_id).contents.vec_dot)
            fn = getattr(shim, f"ggml_vec_dot_{name}_q8_K_generic")
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            pairs, scalar, vec = [], [], []
            for i, w in enumerate(blocks_of[name]):
                w = w.tobytes()
                for j in (i % n_rows, (3 * i + 1) % n_rows):
                    out = ctypes.c_float()
                    wbuf, abuf = ctypes.create_string_buffer(w, len(w)), ctypes.create_string_buffer(a_rows[j], a_size)
                    fn(n, ctypes.byref(out), 0, wbuf, 0, abuf, 0, 1)
                    scalar.append(out.value)
                    simd(n, ctypes.byref(out), 0, ctypes.cast(wbuf, ctypes.c_void_p), 0, ctypes.cast(abuf, ctypes.c_void_p), 0, 1)
                    vec.append(out.value)
                    pairs += [i, j]
            report.append(write_vec_dot(name, "q8_K", pairs, scalar, vec))
    return report


def ggml_c_bf16(x: np.ndarray) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    out = np.zeros(x.size, dtype=np.uint16)
    ggml.ggml_fp32_to_bf16_row_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    ggml.ggml_fp32_to_bf16_row_ref(x.ctypes.data, out.ctypes.data, x.size)
    return out.astype("<u2").tobytes()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if "--grid-types" in sys.argv[1:]:
        report = gen_grid_types()
    else:
        rng = np.random.default_rng(20240611)
        report = gen_dequant(rng)
        report += gen_quant(rng)
        report += gen_vec_dot(rng)
        report += gen_grid_types()
    for line in report:
        print(line)
    total = sum(p.stat().st_size for p in OUT.glob("*.bin"))
    print(f"total fixture size: {total} bytes in {OUT.relative_to(ROOT)}")
    print(f"gguf {importlib.metadata.version('gguf')}, llama-cpp-python {llama_cpp.__version__}, "
          f"numpy {np.__version__}, ggml C from {LIB_DIR}")


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Keeps llama.cpp's per-tensor progress off the output; errors (level 4) still show."""
    if level == 4:
        sys.stderr.write(text.decode(errors="replace"))


if __name__ == "__main__":
    llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    main()
