#!/usr/bin/env python3
"""Measure llama.cpp prefill / decode speed at a given KV depth, the way llama-bench -d does,
through llama-cpp-python's low-level API (llama_decode on explicit batches).

    /work/venv/bin/python scripts/llama_cpp_bench.py --model F --threads 2 --pp 512 --tg 32 \
        --depth 3072 --reps 3 [--ubatch 512] [--flash-attn off|on] [--cache-type-k f16] [--cache-type-v f16]

--parallel N measures as llama-batched-bench does (`tandem bench --parallel N` the same): N
sequences (n_seq_max N) each get P random ids, all in one batch (logits of each sequence's last
token), then N decode steps of one token per sequence in one batch each (logits for all N); the
rates count every sequence's tokens, and rows carry "n_parallel". Only at depth 0.

--pp and --threads take comma lists (--pp 256,512: one row per size, the decode test on the
first row, all from one depth fill).

Prints one JSON object on stdout, in the shape `tandem bench --json` prints:

    {"model": F, "threads": [T], "rows": [{"threads": T, "n_kv": D, "pp": P, "tg": N,
      "t_pp_s": .., "s_pp_tps": .., "t_tg_s": .., "s_tg_tps": ..}]}

plus a few extra keys tandem's consumers can ignore ("engine", "flash_attn", "ubatch",
"reps", and per row the raw samples "t_pp_samples_s" / "t_tg_samples_s"). Progress goes to stderr.

Method (llama-bench's, tools/llama-bench/llama-bench.cpp): one warmup (prefill P from an empty
cache, then one decode), then the cache is filled once, untimed, with D random token ids; every
test starts from exactly those D tokens (later positions dropped with llama_memory_seq_rm):
prefill = P random ids decoded as one batch (n_batch >= P, n_ubatch 512, logits of the last
token only), decode = N single-token llama_decode calls from depth D (one logit row each,
llama_synchronize after each). Times are medians over the reps; n_threads = n_threads_batch = T;
n_ctx = D + P + N; an F16 KV cache unless -ctk/-ctv say otherwise; CPU only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np
import llama_cpp as L

SEED = 1234


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@L.llama_log_callback
def _quiet_log(level, text, user_data):  # noqa: ANN001 - ctypes callback
    return None


class Bench:
    def __init__(self, model_path: str, quiet: bool):
        if quiet:
            L.llama_log_set(_quiet_log, ctypes.c_void_p())
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp failed to load {model_path}")
        vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(vocab)
        self.rng = np.random.default_rng(SEED)
        self.ctx = None

    def new_context(self, threads: int, n_ctx: int, n_batch: int, n_ubatch: int, flash_attn: bool,
                    cache: tuple[int, int], n_seq: int = 1) -> None:
        self.free_context()
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch
        cp.n_seq_max = n_seq
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k, cp.type_v = cache
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("llama_init_from_model failed (llama.cpp needs --flash-attn on for a quantized V cache)")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        L.llama_set_n_threads(self.ctx, threads, threads)

    def free_context(self) -> None:
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None

    def decode(self, n_tokens: int) -> None:
        """n_tokens random ids appended to sequence 0 as one batch (positions follow the cache)."""
        ids = (L.llama_token * n_tokens)(*self.rng.integers(0, self.n_vocab, n_tokens).tolist())
        batch = L.llama_batch_get_one(ids, n_tokens)  # logits of the last token only
        rc = L.llama_decode(self.ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode failed with {rc} (n_tokens {n_tokens})")

    def prompt(self, n: int) -> None:
        """llama-bench test_prompt: chunks of n_batch, synchronize at the end."""
        done = 0
        while done < n:
            k = min(n - done, self.n_batch)
            self.decode(k)
            done += k
        L.llama_synchronize(self.ctx)

    def gen(self, n: int) -> None:
        """llama-bench test_gen: n single-token decodes, synchronize after each."""
        for _ in range(n):
            self.decode(1)
            L.llama_synchronize(self.ctx)

    def batched(self, seqs: int, n: int, logits_all: bool) -> None:
        """n random ids for each of sequences 0..seqs (positions follow each sequence's cache), in
        one batch split at n_batch; logits for every token or each sequence's last."""
        entries = []
        for s in range(seqs):
            start = L.llama_memory_seq_pos_max(self.mem, s) + 1
            ids = self.rng.integers(0, self.n_vocab, n).tolist()
            entries += [(t, start + i, s, logits_all or i == n - 1) for i, t in enumerate(ids)]
        for at in range(0, len(entries), self.n_batch):
            part = entries[at: at + self.n_batch]
            batch = L.llama_batch_init(len(part), 0, 1)
            try:
                for i, (t, pos, s, want) in enumerate(part):
                    batch.token[i] = t
                    batch.pos[i] = pos
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = s
                    batch.logits[i] = want
                batch.n_tokens = len(part)
                rc = L.llama_decode(self.ctx, batch)
                if rc != 0:
                    raise SystemExit(f"llama_decode failed with {rc} ({len(part)} tokens of {seqs} sequences)")
            finally:
                L.llama_batch_free(batch)
        L.llama_synchronize(self.ctx)

    def run_parallel(self, threads: int, seqs: int, pp: int, tg: int, reps: int, ubatch: int, flash_attn: bool,
                     cache: tuple[int, int]) -> list[dict]:
        """llama-batched-bench: seqs prompts of pp tokens in one batch, then tg steps of seqs tokens."""
        n_batch = max(seqs * pp, ubatch)
        self.new_context(threads, seqs * (pp + tg) + seqs, n_batch, ubatch, flash_attn, cache, n_seq=seqs)
        # warmup: one prompt batch and one step, then an empty cache
        self.batched(seqs, max(1, min(pp, ubatch // seqs or 1)), False)
        self.batched(seqs, 1, True)
        t_pp: list[float] = []
        t_tg: list[float] = []
        for r in range(reps):
            L.llama_memory_clear(self.mem, False)
            msg = []
            if pp > 0:
                t0 = time.perf_counter()
                self.batched(seqs, pp, False)
                t_pp.append(time.perf_counter() - t0)
                msg.append(f"pp{pp} x {seqs} {seqs * pp / t_pp[-1]:.2f} t/s")
            if tg > 0:
                t0 = time.perf_counter()
                for _ in range(tg):
                    self.batched(seqs, 1, True)
                t_tg.append(time.perf_counter() - t0)
                msg.append(f"tg{tg} x {seqs} {seqs * tg / t_tg[-1]:.2f} t/s")
            log(f"  rep {r + 1}/{reps}: t={threads} npl={seqs} fa={'on' if flash_attn else 'off'}: " + ", ".join(msg))
        self.free_context()
        mp = statistics.median(t_pp) if t_pp else 0.0
        mt = statistics.median(t_tg) if t_tg else 0.0
        return [dict(threads=threads, n_parallel=seqs, n_kv=0, pp=pp, tg=tg,
                     t_pp_s=mp, s_pp_tps=seqs * pp / mp if mp > 0 else 0.0,
                     t_tg_s=mt, s_tg_tps=seqs * tg / mt if mt > 0 else 0.0,
                     t_pp_samples_s=t_pp, t_tg_samples_s=t_tg)]

    def truncate(self, depth: int) -> None:
        if depth == 0:
            L.llama_memory_clear(self.mem, False)
        elif not L.llama_memory_seq_rm(self.mem, 0, depth, -1):
            raise SystemExit(f"llama_memory_seq_rm(0, {depth}, -1) failed")
        assert L.llama_memory_seq_pos_max(self.mem, 0) == depth - 1

    def run(self, threads: int, pps: list[int], tg: int, depth: int, reps: int, ubatch: int,
            flash_attn: bool, cache: tuple[int, int]) -> list[dict]:
        """One row per prefill size (the decode test rides on the first row), all from one depth fill."""
        pps = pps or [0]
        n_batch = max(max(pps), ubatch)
        self.new_context(threads, depth + max(pps) + tg, n_batch, ubatch, flash_attn, cache)
        # warmup, as llama-bench: prefill P from an empty cache, one decode
        if max(pps) > 0:
            self.prompt(max(pps))
        if tg > 0:
            self.gen(1)
        L.llama_memory_clear(self.mem, False)
        if depth > 0:
            t0 = time.perf_counter()
            self.prompt(depth)
            log(f"  filled depth {depth} in {time.perf_counter() - t0:.1f} s")
        t_pp: dict[int, list[float]] = {pp: [] for pp in pps if pp > 0}
        t_tg: list[float] = []
        for r in range(reps):
            msg = []
            for pp in t_pp:
                self.truncate(depth)
                t0 = time.perf_counter()
                self.prompt(pp)
                t_pp[pp].append(time.perf_counter() - t0)
                msg.append(f"pp{pp} {pp / t_pp[pp][-1]:.2f} t/s")
            if tg > 0:
                self.truncate(depth)
                t0 = time.perf_counter()
                self.gen(tg)
                t_tg.append(time.perf_counter() - t0)
                msg.append(f"tg{tg} {tg / t_tg[-1]:.2f} t/s")
            log(f"  rep {r + 1}/{reps}: t={threads} d={depth} fa={'on' if flash_attn else 'off'}: " + ", ".join(msg))
        self.free_context()
        rows = []
        for i, pp in enumerate(pps):
            n = tg if i == 0 else 0
            tp = t_pp.get(pp, [])
            tt = t_tg if n > 0 else []
            mp = statistics.median(tp) if tp else 0.0
            mt = statistics.median(tt) if tt else 0.0
            rows.append(dict(threads=threads, n_kv=depth, pp=pp, tg=n,
                             t_pp_s=mp, s_pp_tps=pp / mp if mp > 0 else 0.0,
                             t_tg_s=mt, s_tg_tps=n / mt if mt > 0 else 0.0,
                             t_pp_samples_s=tp, t_tg_samples_s=tt))
        return rows


def on_off(s: str) -> bool:
    if s in ("on", "1", "true"):
        return True
    if s in ("off", "0", "false"):
        return False
    raise argparse.ArgumentTypeError(f"expected on|off, got {s!r}")


CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def cache_type(s: str) -> int:
    """A -ctk/-ctv name (llama.cpp's common/arg.cpp list) as a GGML_TYPE_* value."""
    if s.lower() not in CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"{s!r} is not a KV cache type; use one of {', '.join(CACHE_TYPES)}")
    # llama-cpp-python's constants stop before BF16 (ggml.h: GGML_TYPE_BF16 = 30)
    return getattr(L, f"GGML_TYPE_{s.upper()}", 30 if s.lower() == "bf16" else None)


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", required=True)
    ap.add_argument("--threads", "-t", type=int_list, default=[2], help="comma-separated thread counts")
    ap.add_argument("--pp", "-p", type=int_list, default=[512],
                    help="prefill tokens (0: none); a comma list gives one row per size, one depth fill")
    ap.add_argument("--tg", "-n", type=int, default=32, help="decoded tokens (0: none)")
    ap.add_argument("--depth", "-d", type=int, default=0, help="tokens already in the KV cache")
    ap.add_argument("--reps", "-r", type=int, default=3)
    ap.add_argument("--ubatch", "-ub", type=int, default=512)
    ap.add_argument("--flash-attn", "-fa", type=on_off, default=False, help="on|off (default off)")
    ap.add_argument("--cache-type-k", "-ctk", default="f16", help="KV cache type for K (default f16)")
    ap.add_argument("--cache-type-v", "-ctv", default="f16", help="KV cache type for V (default f16)")
    ap.add_argument("--parallel", "-npl", type=int, default=1,
                    help="sequences batched together, as llama-batched-bench (depth 0, one --pp)")
    ap.add_argument("--verbose", action="store_true", help="keep llama.cpp's own log on stderr")
    args = ap.parse_args()
    if args.reps < 1 or min(args.pp) < 0 or args.tg < 0 or args.depth < 0 or (max(args.pp) == 0 and args.tg == 0):
        ap.error("need reps >= 1, pp/tg/depth >= 0 and pp + tg > 0")

    try:
        cache = (cache_type(args.cache_type_k), cache_type(args.cache_type_v))
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    b = Bench(args.model, quiet=not args.verbose)
    log(f"llama.cpp (llama-cpp-python {L.__version__}): loaded {args.model} in {time.perf_counter() - t0:.1f} s")
    if args.parallel > 1:
        if args.depth != 0 or len(args.pp) != 1:
            ap.error("--parallel runs at depth 0 with one --pp")
        rows = [r for t in args.threads for r in
                b.run_parallel(t, args.parallel, args.pp[0], args.tg, args.reps, args.ubatch, args.flash_attn, cache)]
    else:
        rows = [r for t in args.threads for r in b.run(t, args.pp, args.tg, args.depth, args.reps, args.ubatch, args.flash_attn, cache)]
    L.llama_model_free(b.model)
    out = dict(model=args.model, threads=args.threads, rows=rows, engine=f"llama.cpp (llama-cpp-python {L.__version__})",
               flash_attn=args.flash_attn, ubatch=args.ubatch, reps=args.reps,
               cache_type_k=args.cache_type_k.lower(), cache_type_v=args.cache_type_v.lower())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
