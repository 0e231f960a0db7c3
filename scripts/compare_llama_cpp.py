#!/usr/bin/env python3
"""tandem vs llama.cpp on the benchmark models, measured alternately in one run.

    /work/venv/bin/python scripts/compare_llama_cpp.py [--out results.json]
        [--models Q4_K_M,Q8_0] [--threads 1,2] [--depths 0,3072] [--tests tg32,pp256,pp512]
        [--rounds 5] [--pair] [--fa off,on] [--model-dir /work/bench-models] [--tandem target/release/tandem]
        [--cache-type-k f16] [--cache-type-v f16] [--parallel N] [--ik IK_BUILD/bin]

For every model x threads x depth x test, each round runs, as separate subprocesses and in an
order that rotates from round to round:

  tandem     target/release/tandem bench -m F -t T -p P -n N -d D -r 1 --json --no-progress
             -ctk K -ctv V [--tandem-args]
  llama.cpp  scripts/llama_cpp_bench.py --model F --threads T --pp P --tg N --depth D --reps 1
             --ubatch 512 --flash-attn off -ctk K -ctv V   (and again with --flash-attn on)

With --ik DIR, ik_llama.cpp runs in the same rounds (DIR holds its llama-bench and
llama-sweep-bench, built from a fetched snapshot; nothing of it is in this repository), with
`-rtr 1` and its own defaults (`-mla 3`, flash attention and fused MoE on):

  ik_llama.cpp  depth 0: DIR/llama-bench -m F -t T -p P -n N -r 1 -ub 512 -ctk K -ctv V -rtr 1 -o json
                depth D: DIR/llama-sweep-bench -m F -t T -c D+max(P,N) -ub P -n N -rtr
                         -ctk K -ctv V --output-format jsonl   (its row at N_KV = D; D a multiple of P)

Its llama-bench has no -d; its sweep prefills P tokens at every multiple of P up to D, timing
each, so a depth costs it more wall time than the others (not more measured time). The table
gains its median and the paired ratio tandem / ik_llama.cpp.

With --parallel N (depth 0 only) both measure N sequences batched together, as
llama-batched-bench: tandem `bench --parallel N`, llama.cpp `llama_cpp_bench.py --parallel N`;
the t/s are aggregates over the N sequences.

(llama.cpp refuses a quantized V cache without flash attention: pass --fa on for -ctv q8_0; a
failed engine is reported as errors and left out of the ratio.)

A test is `ppP` (prefill P tokens on top of D, `-n 0`) or `tgN` (N single-token decodes from
depth D, `-p 0`); with --pair one invocation measures one pp and one tg test together
(`-p P -n N`), which halves the depth fills. Medians over the rounds; tandem is compared with the
faster of llama.cpp's flash-attn off / on (both are reported). Prints a markdown table and writes
every raw sample to --out (rewritten after each sample, so an interrupted run keeps its data).
The table also has the paired ratio: each round's tandem sample against the faster llama.cpp
sample of the same round, the median over the rounds (a minute-scale drift of the machine moves
both sides of a round's ratio). `--from FILE` prints the table of an earlier run's --out file
without measuring anything.

Interleaving engines within a round keeps slow drifts of a shared machine (other jobs, thermal)
from favouring one side; the spread of the samples is in the JSON. llama.cpp's CPU threads are
OpenMP threads that spin at every barrier: on a machine with other jobs, -t 2 decode in llama.cpp
collapses (measured 1-5 t/s vs 59 t/s in a quiet moment on the 2-core dev box) and
OMP_WAIT_POLICY=passive (inherited from this script's environment) steadies it at a cost; the
setting is recorded in the JSON. Compare on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_BENCH = Path(__file__).resolve().parent / "llama_cpp_bench.py"
TEST_RE = re.compile(r"^(pp|tg)(\d+)$")
IK = "ik_llama.cpp"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_tests(s: str) -> list[tuple[str, int]]:
    out = []
    for t in csv(s):
        m = TEST_RE.match(t)
        if not m or int(m.group(2)) <= 0:
            raise argparse.ArgumentTypeError(f"bad test {t!r}: expected ppN or tgN with N > 0")
        out.append((m.group(1), int(m.group(2))))
    return out


def invocations(tests: list[tuple[str, int]], pair: bool) -> list[tuple[int, int]]:
    """(pp, tg) per subprocess call."""
    pps = [n for k, n in tests if k == "pp"]
    tgs = [n for k, n in tests if k == "tg"]
    if not pair:
        return [(p, 0) for p in pps] + [(0, n) for n in tgs]
    out = [(p, n) for p, n in zip(pps, tgs)]
    out += [(p, 0) for p in pps[len(tgs):]] + [(0, n) for n in tgs[len(pps):]]
    return out


def parse_json_stdout(text: str) -> dict:
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):  # last line that is a JSON object
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    i, j = text.find("{"), text.rfind("}")
    if i >= 0 and j > i:
        return json.loads(text[i: j + 1])
    raise ValueError("no JSON object on stdout")


def run_one(cmd: list[str], timeout: float, cwd: Path = REPO, raw: bool = False) -> tuple[dict | None, float, str | None]:
    """Runs `cmd`: the JSON object on its stdout, or with `raw` all it printed as {"text": ...}."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - t0, f"timeout after {timeout:.0f} s"
    except OSError as e:
        return None, time.perf_counter() - t0, f"cannot run: {e}"
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return None, wall, f"exit {p.returncode}: {tail}"
    if raw:
        return {"text": p.stdout + "\n" + p.stderr}, wall, None
    try:
        return parse_json_stdout(p.stdout), wall, None
    except ValueError as e:
        return None, wall, f"{e}: {p.stdout[-200:]!r}"


def ik_result(res: dict | list, threads: int, depth: int) -> dict:
    """ik_llama.cpp's output in the rows tandem's JSON has: llama-bench's `-o json` array (one
    object per test, `n_prompt` / `n_gen`, `avg_ns`), or llama-sweep-bench's jsonl line at N_KV =
    `depth` (it writes them to stderr, and rounds its context up, so rows past it may follow)."""
    if isinstance(res, list):
        row: dict = dict(threads=threads, n_kv=depth)
        for x in res:
            t_s = float(x["avg_ns"]) * 1e-9
            if int(x["n_prompt"]) > 0 and int(x["n_gen"]) == 0:
                row.update(pp=int(x["n_prompt"]), t_pp_s=t_s, s_pp_tps=float(x["avg_ts"]))
            elif int(x["n_gen"]) > 0 and int(x["n_prompt"]) == 0:
                row.update(tg=int(x["n_gen"]), t_tg_s=t_s, s_tg_tps=float(x["avg_ts"]))
        return dict(rows=[row])
    lines = [json.loads(x) for x in res["text"].splitlines() if x.startswith("{") and '"speed_pp"' in x]
    at = [x for x in lines if int(x["n_kv"]) == depth]
    if not at:
        raise ValueError(f"its sweep has no row at N_KV {depth} ({len(lines)} rows)")
    res = at[0]
    return dict(rows=[dict(threads=threads, n_kv=depth, pp=int(res["pp"]), tg=int(res["tg"]),
                           t_pp_s=float(res["t_pp"]), s_pp_tps=float(res["speed_pp"]),
                           t_tg_s=float(res["t_tg"]), s_tg_tps=float(res["speed_tg"]))])


def row_of(res: dict, threads: int, depth: int) -> dict:
    rows = res.get("rows") or []
    for r in rows:
        if int(r.get("threads", threads)) == threads and int(r.get("n_kv", depth)) == depth:
            return r
    if len(rows) == 1:
        return rows[0]
    raise ValueError(f"no row for threads={threads} n_kv={depth} in {rows}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=csv, default=["Q4_K_M", "Q8_0"], help="quant names: bench-<NAME>.gguf")
    ap.add_argument("--model-dir", type=Path, default=Path("/work/bench-models"))
    ap.add_argument("--threads", type=lambda s: [int(x) for x in csv(s)], default=[1, 2])
    ap.add_argument("--depths", type=lambda s: [int(x) for x in csv(s)], default=[0, 3072])
    ap.add_argument("--tests", type=parse_tests, default=parse_tests("tg32,pp256,pp512"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pair", action="store_true", help="measure one pp and one tg test per subprocess")
    ap.add_argument("--fa", type=csv, default=["off", "on"], help="llama.cpp flash-attn settings to run")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--tandem", default=str(REPO / "target" / "release" / "tandem"),
                    help="tandem binary (or a stand-in that prints the same JSON)")
    ap.add_argument("--tandem-args", default="", help="extra flags for tandem bench, e.g. '--bandwidth-mib 0'")
    ap.add_argument("--no-tandem", action="store_true", help="only measure llama.cpp")
    ap.add_argument("--python", default=sys.executable, help="Python with llama-cpp-python")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    ap.add_argument("--cache-type-k", "-ctk", default="f16", help="KV cache type for K, for both engines (default f16)")
    ap.add_argument("--cache-type-v", "-ctv", default="f16", help="KV cache type for V, for both engines (default f16)")
    ap.add_argument("--parallel", type=int, default=1, help="sequences batched together (depth 0 only)")
    ap.add_argument("--ik", type=Path, help="directory of ik_llama.cpp's llama-bench and llama-sweep-bench")
    ap.add_argument("--out", type=Path, help="JSON with every raw sample")
    ap.add_argument("--from", dest="from_file", type=Path, help="print the table of an earlier --out file and exit")
    args = ap.parse_args()
    if args.from_file:
        try:
            old = json.loads(args.from_file.read_text())
            cfg, samples = old["config"], old["samples"]
            tests = parse_tests(",".join(cfg["tests"]))
            print_report(summarize(samples, list(cfg["models"]), tests, cfg["engines"], cfg["rounds"]),
                         cfg["engines"], cfg["rounds"])
        except (OSError, ValueError, KeyError, TypeError, argparse.ArgumentTypeError) as e:
            print(f"error: cannot read the run in {args.from_file}: {e}", file=sys.stderr)
            return 1
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.parallel < 1 or (args.parallel > 1 and any(args.depths)):
        ap.error("--parallel N needs N >= 1 and --depths 0")
    for fa in args.fa:
        if fa not in ("on", "off"):
            ap.error(f"--fa takes on/off, got {fa!r}")

    if args.ik:
        for b in ("llama-bench", "llama-sweep-bench"):
            if not (args.ik / b).is_file():
                ap.error(f"--ik {args.ik}: no {b} there (ik_llama.cpp's build/bin)")
        if args.parallel > 1:
            ap.error("--ik does not apply to --parallel")

    models = {m: args.model_dir / f"bench-{m}.gguf" for m in args.models}
    for m, p in models.items():
        if not p.is_file():
            ap.error(f"model {m}: {p} not found (scripts/gen_bench_model.py writes it)")
    if not args.no_tandem and not Path(args.tandem).exists():
        ap.error(f"tandem binary {args.tandem} not found (cargo build --release, or --no-tandem)")

    if args.fa and subprocess.run([args.python, "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        ap.error(f"{args.python} cannot import llama_cpp (pass --python /work/venv/bin/python)")

    engines = ([] if args.no_tandem else ["tandem"]) + [f"llama.cpp fa={fa}" for fa in args.fa] + \
        ([IK] if args.ik else [])
    calls = invocations(args.tests, args.pair)

    def command(engine: str, model: Path, t: int, d: int, pp: int, tg: int) -> list[str]:
        if engine == "tandem":
            return [args.tandem, "bench", "-m", str(model), "-t", str(t), "-p", str(pp), "-n", str(tg),
                    "-d", str(d), "-r", "1", "--json", "--no-progress", "-ctk", args.cache_type_k,
                    "-ctv", args.cache_type_v] + (["--parallel", str(args.parallel)] if args.parallel > 1 else []) + \
                shlex.split(args.tandem_args)
        if engine == IK:
            kv = ["-ctk", args.cache_type_k, "-ctv", args.cache_type_v]
            if d == 0:
                return [str(args.ik / "llama-bench"), "-m", str(model), "-t", str(t), "-p", str(pp), "-n", str(tg),
                        "-r", "1", "-ub", str(args.ubatch), "-rtr", "1", "-o", "json"] + kv
            ub = pp or args.ubatch
            return [str(args.ik / "llama-sweep-bench"), "-m", str(model), "-t", str(t), "-c", str(d + max(ub, tg)),
                    "-ub", str(ub), "-n", str(max(tg, 1)), "-rtr", "--output-format", "jsonl"] + kv
        fa = engine.split("=")[1]
        return [args.python, str(LLAMA_BENCH), "--model", str(model), "--threads", str(t), "--pp", str(pp),
                "--tg", str(tg), "--depth", str(d), "--reps", "1", "--ubatch", str(args.ubatch), "--flash-attn", fa,
                "--cache-type-k", args.cache_type_k, "--cache-type-v", args.cache_type_v] + \
            (["--parallel", str(args.parallel)] if args.parallel > 1 else [])

    samples: list[dict] = []
    config = dict(models={m: str(p) for m, p in models.items()}, threads=args.threads, depths=args.depths,
                  tests=[f"{k}{n}" for k, n in args.tests], rounds=args.rounds, pair=args.pair, engines=engines,
                  ubatch=args.ubatch, parallel=args.parallel, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v, tandem=args.tandem, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), host=os.uname().nodename, cpus=os.cpu_count(),
                  started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def save(summary: list[dict] | None = None) -> None:
        if args.out:
            tmp = args.out.with_suffix(args.out.suffix + ".tmp")
            tmp.write_text(json.dumps(dict(config=config, samples=samples, summary=summary), indent=1) + "\n")
            tmp.replace(args.out)

    n_total = args.rounds * len(models) * len(args.threads) * len(args.depths) * len(calls) * len(engines)
    k = 0
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        for mname, mpath in models.items():
            for t in args.threads:
                for d in args.depths:
                    for pp, tg in calls:
                        # rotate the engine order so no engine always runs first (warm caches, drift)
                        shift = rnd % len(engines)
                        for engine in engines[shift:] + engines[:shift]:
                            k += 1
                            cmd = command(engine, mpath, t, d, pp, tg)
                            if engine == IK and d % (pp or args.ubatch):
                                res, wall, err = None, 0.0, f"depth {d} is not a multiple of {pp or args.ubatch} (its sweep)"
                            else:
                                # ik_llama.cpp writes llama.log where it runs: not into the checkout
                                cwd = Path(tempfile.gettempdir()) if engine == IK else REPO
                                res, wall, err = run_one(cmd, args.timeout, cwd, raw=engine == IK and d > 0)
                            if engine == IK and err is None:
                                try:
                                    res = ik_result(res, t, d)
                                except (ValueError, KeyError, TypeError) as e:
                                    err = f"bad JSON: {e}"
                            base = dict(round=rnd, model=mname, threads=t, depth=d, engine=engine,
                                        wall_s=round(wall, 3), cmd=shlex.join(cmd))
                            got = []
                            if err is None:
                                try:
                                    row = row_of(res, t, d)
                                    if pp > 0:
                                        got.append(dict(base, test=f"pp{pp}", tps=float(row["s_pp_tps"]),
                                                        t_s=float(row["t_pp_s"]), row=row))
                                    if tg > 0:
                                        got.append(dict(base, test=f"tg{tg}", tps=float(row["s_tg_tps"]),
                                                        t_s=float(row["t_tg_s"]), row=row))
                                except (ValueError, KeyError, TypeError) as e:
                                    err = f"bad JSON: {e}"
                            if err is not None:
                                got = [dict(base, test=f"{kind}{n}", error=err)
                                       for kind, n in (("pp", pp), ("tg", tg)) if n > 0]
                            samples.extend(got)
                            save()
                            el = time.perf_counter() - t_start
                            desc = ", ".join(f"{s['test']} {s['tps']:.2f} t/s" if "tps" in s else f"{s['test']} ERROR {s['error']}"
                                             for s in got)
                            log(f"[{k}/{n_total} {el:.0f} s] round {rnd + 1} {mname} t={t} d={d} {engine}: {desc} "
                                f"(wall {wall:.1f} s)")

    summary = summarize(samples, args.models, args.tests, engines, args.rounds)
    save(summary)
    print_report(summary, engines, args.rounds)
    n_err = sum(1 for s in samples if "error" in s)
    if n_err:
        print(f"\n{n_err} sample(s) failed; see the errors in {args.out or 'the log above'}")
    if args.out:
        print(f"\nraw samples: {args.out}")
    return 0


def summarize(samples: list[dict], models: list[str], tests: list[tuple[str, int]], engines: list[str],
              rounds: int) -> list[dict]:
    """Per model x threads x depth x test: each engine's median, the ratio of tandem's median to the
    faster llama.cpp median, and the median of the rounds' own ratios (`paired_ratio`)."""
    keys = []
    for s in samples:
        key = (s["model"], s["threads"], s["depth"], s["test"])
        if key not in keys:
            keys.append(key)
    order = {f"{k}{n}": i for i, (k, n) in enumerate(tests)}
    keys.sort(key=lambda x: (models.index(x[0]) if x[0] in models else 99, x[1], x[2], order.get(x[3], 99)))
    summary = []
    for key in keys:
        mine = [s for s in samples if (s["model"], s["threads"], s["depth"], s["test"]) == key and "tps" in s]
        med = {}
        nsamp = {}
        for e in engines:
            v = [s["tps"] for s in mine if s["engine"] == e]
            med[e] = statistics.median(v) if v else None
            nsamp[e] = len(v)
        llama = {e: v for e, v in med.items() if e.startswith("llama.cpp") and v is not None}
        best_e = max(llama, key=llama.get) if llama else None
        best = llama.get(best_e) if best_e else None
        tan = med.get("tandem")
        pairs, ik_pairs = [], []
        for r in range(rounds):
            at = {s["engine"]: s["tps"] for s in mine if s["round"] == r}
            ll = [v for e, v in at.items() if e.startswith("llama.cpp")]
            if at.get("tandem") and ll and max(ll) > 0:
                pairs.append(round(at["tandem"] / max(ll), 4))
            if at.get("tandem") and at.get(IK):
                ik_pairs.append(round(at["tandem"] / at[IK], 4))
        summary.append(dict(model=key[0], threads=key[1], depth=key[2], test=key[3], median_tps=med, n=nsamp,
                            llama_best=best_e, ratio=(tan / best) if tan and best else None,
                            paired_ratios=pairs, paired_ratio=statistics.median(pairs) if pairs else None,
                            ik_paired_ratios=ik_pairs,
                            ik_paired_ratio=statistics.median(ik_pairs) if ik_pairs else None))
    return summary


def print_report(summary: list[dict], engines: list[str], rounds: int) -> None:
    def f(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}"

    fa_cols = [e for e in engines if e.startswith("llama.cpp")]
    ik = IK in engines
    head = ["model", "threads", "depth", "test", "tandem t/s"] + [f"{e} t/s" for e in fa_cols] + \
        ["llama.cpp best t/s", "ratio tandem/best", "paired ratio (rounds)"] + \
        ([f"{IK} t/s", f"paired tandem/{IK} (rounds)"] if ik else [])
    print(f"\nmedians of {rounds} round(s); t/s = tokens per second; the paired ratio is the median of each "
          "round's tandem / faster llama.cpp, the rounds' own in brackets\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for s in summary:
        m = s["median_tps"]
        best = m.get(s["llama_best"]) if s["llama_best"] else None
        paired = "—" if s.get("paired_ratio") is None else \
            f"{s['paired_ratio']:.3f} ({' / '.join(f'{r:.2f}' for r in s['paired_ratios'])})"
        cells = [s["model"], str(s["threads"]), str(s["depth"]), s["test"], f(m.get("tandem"))] + \
            [f(m.get(e)) for e in fa_cols] + \
            [f"{f(best)} ({s['llama_best'].split('=')[1] if s['llama_best'] else '—'})",
             "—" if s["ratio"] is None else f"{s['ratio']:.3f}", paired]
        if ik:
            ikp = "—" if s.get("ik_paired_ratio") is None else \
                f"{s['ik_paired_ratio']:.3f} ({' / '.join(f'{r:.2f}' for r in s['ik_paired_ratios'])})"
            cells += [f(m.get(IK)), ikp]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
