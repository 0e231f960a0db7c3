#!/usr/bin/env bash
# The CUDA backend on a GPU machine that has no Rust, from binaries built elsewhere by
# scripts/build-gpu-check.sh. Run from the repository root (the fixtures are read from tests/):
#
#     scripts/gpu-check.sh [BIN_DIR] [BENCH_MODEL_DIR]
#
# BIN_DIR (default target/gpu-check) holds `tandem`, `test-kernels`, `test-gpu`,
# `test-gpu_fallback` and manifest.txt. BENCH_MODEL_DIR, when given and present, holds .gguf
# models to benchmark. Results go to $OUT (default ./gpu-check-out): summary.txt first, then one
# log per step. Everything runs under one time budget, GPU_CHECK_BUDGET_S (default 480 s); each
# step gets at most what is left, so the script ends in time even when a step hangs.
#
#  1. nvidia-smi                      -> nvidia-smi.txt
#  2. tests/kernels.rs (every kernel against the CPU, on the emulator and on the GPU, Kimi's
#     shapes and attention over 32K rows) with TANDEM_REQUIRE_GPU=1 -> test-kernels.log
#  3. tests/gpu.rs (hybrid/all-GPU logits vs CPU on every fixture, prefill vs llama.cpp, a decode
#     step's crossings, the binary's GPU path) -> test-gpu.log
#  4. tests/gpu_fallback.rs (fallback with no visible device) -> test-gpu_fallback.log
#  5. `tandem logits` CPU vs hybrid (-ngl 999 -ot exps=CPU) vs all-GPU (-ngl 999) on every
#     fixture, compared in Python (tests/logits.rs's tolerance) -> logits.tsv, logits/*.log
#  6. A Kimi K2.5-shaped model made here (`tandem synth`, KIMI_LAYERS layers, default 4: ~31 GiB
#     in $SYNTH_DIR, default /tmp; deleted at the end): hybrid decode at depths 0, 8K and 32K
#     (cache filled with zero rows), prefill 512 and 2048, the ledger per decoded token and the
#     CPU's time in the experts; CPU-only decode and prefill 512 at depth 0 -> kimi-*.json
#  7. `tandem bench` and `tandem run` CPU vs hybrid on BENCH_MODEL_DIR -> bench*.log
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=$(cd "${1:-target/gpu-check}" 2>/dev/null && pwd) || { echo "gpu-check: no binary folder '${1:-target/gpu-check}' (make it with scripts/build-gpu-check.sh)" >&2; exit 2; }
bench_dir=${2:-}
out=${OUT:-$repo/gpu-check-out}
mkdir -p "$out/logits"
budget=${GPU_CHECK_BUDGET_S:-480}
t0=$(date +%s)
summary="$out/summary.txt"
: >"$summary"

left() { echo $(( budget - ($(date +%s) - t0) )); }
note() { echo "$*" | tee -a "$summary"; }
# step NAME MAX_SECONDS LOG COMMAND...: runs COMMAND with at most MAX_SECONDS (and what is left of
# the budget), its output in LOG, and one line in the summary.
step() {
    local name=$1 max=$2 log=$3
    shift 3
    local l
    l=$(left)
    if [ "$l" -le 5 ]; then
        note "SKIP  $name (time budget spent)"
        return 0
    fi
    [ "$max" -gt "$l" ] && max=$l
    local s
    s=$(date +%s)
    timeout -k 5 "$max" "$@" >"$log" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - s ))
    case $rc in
        0) note "PASS  $name (${took} s)" ;;
        124|137) note "TIME  $name: killed after ${max} s (see $(basename "$log"))" ;;
        *) note "FAIL  $name: exit $rc (${took} s; see $(basename "$log"))" ;;
    esac
    return 0
}

note "gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), budget ${budget} s"
grep '^#' "$bin/manifest.txt" 2>/dev/null | tee -a "$summary"
for f in tandem test-kernels test-gpu test-gpu_fallback; do
    [ -x "$bin/$f" ] || { note "FAIL  missing $bin/$f"; exit 1; }
done
export TANDEM_REPO=$repo TANDEM_BIN=$bin/tandem
# cuBLAS (prefill gemm) is loaded at run time as libcublas.so or libcublas.so.12; the toolkit's
# lib64 usually has the unversioned name. Without it, prefill uses the matvec kernels.
for d in "${CUDA_HOME:-}/lib64" /usr/local/cuda/lib64; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

# 1. The machine.
step "nvidia-smi" 30 "$out/nvidia-smi.txt" nvidia-smi
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,memory.used --format=csv,noheader 2>/dev/null | sed 's/^/      /' | tee -a "$summary"

# 2-4. The test executables (one test at a time, so the log reads in order).
TANDEM_REQUIRE_GPU=1 step "tests/kernels.rs" 150 "$out/test-kernels.log" "$bin/test-kernels" --test-threads=1 --nocapture
# The GPU's worst error of every kernel check, then the failed tests, then the counts.
grep -E "^GPU .*worst|GPU: [0-9.]+ s" "$out/test-kernels.log" | sed 's/^/      /' | tee -a "$summary"
sed -n '/^failures:$/,/^test result/p' "$out/test-kernels.log" | grep -E '^    [a-z_0-9]+$' | sed 's/^ */      failed: /' | tee -a "$summary"
grep -E "^test result" "$out/test-kernels.log" | sed 's/^/      /' | tee -a "$summary"
TANDEM_REQUIRE_GPU=1 step "tests/gpu.rs" 180 "$out/test-gpu.log" "$bin/test-gpu" --test-threads=1 --nocapture
grep -E "worst|median|skipped|token\(s\)" "$out/test-gpu.log" | sed 's/(CUDA0 (.*//' | sed 's/^/      /' | tee -a "$summary"
sed -n '/^failures:$/,/^test result/p' "$out/test-gpu.log" | grep -E '^    [a-z_0-9]+$' | sed 's/^ */      failed: /' | tee -a "$summary"
grep -E "^test result" "$out/test-gpu.log" | sed 's/^/      /' | tee -a "$summary"
step "tests/gpu_fallback.rs" 90 "$out/test-gpu_fallback.log" "$bin/test-gpu_fallback" --test-threads=1 --nocapture
grep -E "test result" "$out/test-gpu_fallback.log" | sed 's/^/      /' | tee -a "$summary"

# 4. tandem logits: CPU vs hybrid vs all-GPU on every fixture.
logits_all() {
    local tokens="1,17,42,99,100,200,300,301,302,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21"
    local models
    models=$(ls tests/fixtures/models/*.gguf tests/fixtures/inference/*.gguf 2>/dev/null | grep -v -- '-0000[2-9]-of-')
    : >"$out/logits.list"
    for m in $models; do
        local name
        name=$(basename "$m" .gguf)
        for mode in cpu hybrid gpu; do
            local flags=()
            case $mode in
                hybrid) flags=(-ngl 999 -ot exps=CPU) ;;
                gpu) flags=(-ngl 999) ;;
            esac
            "$bin/tandem" logits -m "$m" --tokens "$tokens" -c 64 --out "$out/logits/$name.$mode.f32" "${flags[@]}" \
                >"$out/logits/$name.$mode.log" 2>&1 || echo "FAILED: exit $?" >>"$out/logits/$name.$mode.log"
        done
        echo "$name" >>"$out/logits.list"
    done
    if ! command -v python3 >/dev/null; then
        echo "no python3: logits written to $out/logits but not compared (tests/gpu.rs compares them too)"
        return 1
    fi
    python3 - "$out" <<'PY'
import array, os, sys
out = sys.argv[1]
tol = 2e-2
rows, bad = [], 0
for name in open(os.path.join(out, "logits.list")).read().split():
    def load(mode):
        p = os.path.join(out, "logits", f"{name}.{mode}.f32")
        a = array.array("f")
        if os.path.exists(p):
            with open(p, "rb") as f:
                a.frombytes(f.read())
        return a
    def log(mode):
        return open(os.path.join(out, "logits", f"{name}.{mode}.log")).read()
    cpu = load("cpu")
    n_tok = 24
    if not cpu or len(cpu) % n_tok:
        rows.append(f"{name}\tcpu\tNO OUTPUT"); bad += 1; continue
    n_vocab = len(cpu) // n_tok
    for mode in ("hybrid", "gpu"):
        got, err = load(mode), log(mode)
        used = "fallback" if "CUDA unavailable" in err else ("GPU" if "tandem: CUDA: " in err else "?")
        if len(got) != len(cpu):
            rows.append(f"{name}\t{mode}\tNO OUTPUT ({used}): {err.strip().splitlines()[-1:] }"); bad += 1; continue
        errs, agree, clear, clear_agree = [], 0, 0, 0
        for t in range(n_tok):
            g, w = got[t*n_vocab:(t+1)*n_vocab], cpu[t*n_vocab:(t+1)*n_vocab]
            scale = max(abs(v) for v in w) or 1.0
            errs.append(max(abs(a - b) for a, b in zip(g, w)) / scale)
            ag, aw = max(range(n_vocab), key=g.__getitem__), max(range(n_vocab), key=w.__getitem__)
            agree += ag == aw
            s = sorted(w, reverse=True)
            if (s[0] - s[1]) / scale > 2 * tol:
                clear += 1; clear_agree += ag == aw
        med = sorted(errs)[n_tok // 2]
        ok = used == "GPU" and med <= tol and clear_agree == clear and agree >= 0.95 * n_tok
        bad += not ok
        rows.append(f"{name}\t{mode}\t{'ok' if ok else 'FAIL'}\t{used}\tworst {max(errs):.2e}\tmedian {med:.2e}\targmax {agree}/{n_tok} ({clear_agree}/{clear} clear)")
open(os.path.join(out, "logits.tsv"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
sys.exit(1 if bad else 0)
PY
}
export -f logits_all
export out bin
step "tandem logits CPU vs hybrid vs all-GPU" 150 "$out/logits.log" bash -c logits_all
sed 's/^/      /' "$out/logits.tsv" 2>/dev/null | tee -a "$summary"

# 6. The synthetic Kimi K2.5: hybrid at depth, prefill, ledger; CPU-only for the comparison.
kimi_all() {
    local m="$synth_dir/kimi-k2.5-synth.gguf" t
    t=$(nproc)
    "$bin/tandem" synth kimi-k2.5 --layers "${KIMI_LAYERS:-4}" -o "$m" || return 1
    local common=(-m "$m" -t "$t" --no-progress --bandwidth-mib 0 -r 2)
    "$bin/tandem" bench "${common[@]}" -ngl 999 -ot exps=CPU -p 512 -n 32 -d 0,8192,32768 --zero-depth -c 33400 --json \
        >"$out/kimi-hybrid-decode.json" || return 1
    "$bin/tandem" bench "${common[@]}" -ngl 999 -ot exps=CPU -p 2048 -n 0 -ub 2048 -b 2048 -r 1 --json \
        >"$out/kimi-hybrid-pp2048.json" || return 1
    "$bin/tandem" bench "${common[@]}" -p 512 -n 16 -r 1 --json >"$out/kimi-cpu.json" || return 1
    rm -f "$m"
    python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
load = lambda n: json.load(open(os.path.join(out, n)))
dec = {r["n_kv"]: r for r in load("kimi-hybrid-decode.json")["rows"]}
pp512 = dec[0]["s_pp_tps"]
pp2048 = load("kimi-hybrid-pp2048.json")["rows"][0]["s_pp_tps"]
cpu = load("kimi-cpu.json")["rows"][0]
lines = []
for d in sorted(dec):
    r = dec[d]
    gpu = r.get("gpu", {}).get("CUDA0", {})
    busy = r.get("cpu_busy_s_per_token") or 0
    lines.append(f"hybrid at depth {d}: decode {r['s_tg_tps']:.2f} t/s ({1e3 / r['s_tg_tps']:.1f} ms/token, CPU in experts {busy * 1e3:.1f} ms), prefill 512 {r['s_pp_tps']:.1f} t/s; "
                 f"CUDA0 per token: {gpu.get('launches', 0):.0f} launches, {gpu.get('h2d', 0):.1f} up, {gpu.get('d2h', 0):.1f} down, {gpu.get('syncs', 0):.1f} waits")
lines.append(f"hybrid prefill: {pp512:.1f} t/s (512), {pp2048:.1f} t/s (2048)")
lines.append(f"CPU only: decode {cpu['s_tg_tps']:.2f} t/s, prefill {cpu['s_pp_tps']:.1f} t/s (512)")
d0, d32 = dec.get(0), dec.get(32768)
ok = True
if d0 and d32:
    ratio = d32["s_tg_tps"] / d0["s_tg_tps"]
    ok &= ratio >= 0.9
    lines.append(f"acceptance: decode at 32K / at 0 = {ratio:.2f} (>= 0.90: {'yes' if ratio >= 0.9 else 'NO'})")
    busy = d0.get("cpu_busy_s_per_token") or 0
    per = 1 / d0["s_tg_tps"]
    if busy:
        ok &= per <= 1.15 * busy
        lines.append(f"acceptance: hybrid time per token / CPU experts' = {per / busy:.2f} (<= 1.15: {'yes' if per <= 1.15 * busy else 'NO'})")
print("\n".join(lines))
sys.exit(0 if ok else 1)
PY
}
export -f kimi_all
synth_dir=${SYNTH_DIR:-/tmp}
export synth_dir
step "synthetic Kimi K2.5: hybrid vs CPU" 300 "$out/kimi.log" bash -c kimi_all
grep -E "^(hybrid|CPU only|acceptance)" "$out/kimi.log" | sed 's/^/      /' | tee -a "$summary"
rm -f "$synth_dir/kimi-k2.5-synth.gguf"

# 7. Benchmarks on real models, if there are any.
if [ -n "$bench_dir" ] && [ -d "$bench_dir" ]; then
    for m in $(ls "$bench_dir"/*.gguf 2>/dev/null | grep -v -- '-0000[2-9]-of-' | head -n 2); do
        name=$(basename "$m" .gguf)
        l=$(left)
        [ "$l" -le 20 ] && { note "SKIP  bench $name (time budget spent)"; continue; }
        if "$bin/tandem" bench --help 2>/dev/null | grep -q -- '--n-gpu-layers'; then
            step "tandem bench $name -ngl 999 -ot exps=CPU" $(( l / 2 )) "$out/bench-$name-hybrid.log" \
                "$bin/tandem" bench -m "$m" -p 128 -n 32 -r 1 -ngl 999 -ot exps=CPU --no-progress
        fi
        step "tandem bench $name (CPU)" $(( $(left) / 3 )) "$out/bench-$name-cpu.log" \
            "$bin/tandem" bench -m "$m" -p 128 -n 32 -r 1 --no-progress
        for mode in cpu hybrid; do
            flags=()
            [ $mode = hybrid ] && flags=(-ngl 999 -ot exps=CPU)
            step "tandem run $name ($mode)" $(( $(left) / 2 )) "$out/run-$name-$mode.log" \
                "$bin/tandem" run -m "$m" -p "Write a short story about a lighthouse keeper." -n 64 --temp 0 -c 1024 "${flags[@]}"
            grep -E "CUDA|prompt:" "$out/run-$name-$mode.log" | sed "s/^/      $mode: /" | tee -a "$summary"
        done
    done
elif [ -n "$bench_dir" ]; then
    note "SKIP  bench: no folder $bench_dir"
fi

note "done in $(( $(date +%s) - t0 )) s; logs in $out"
grep -q '^FAIL\|^TIME' "$summary" && exit 1
exit 0
