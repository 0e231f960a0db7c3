#!/usr/bin/env bash
# Decode of a model larger than the memory it may use, with a cold page cache, with and without
# --read-ahead, alternating in one run:
#
#   sudo scripts/read_ahead_check.sh MODEL.gguf [LIMIT_MIB=1200] [ROUNDS=3] [extra bench flags...]
#
# The model stays where it is; the process runs in a memory cgroup limited to LIMIT_MIB (page
# cache included), so a 2.2 GB model is "larger than RAM" on any machine. Before each run the
# file's pages are dropped from the page cache (posix_fadvise DONTNEED), so each run starts cold.
# Needs root (to make the cgroup), cgroup v1 or v2 with the memory controller, python3 and a
# release build (target/release/tandem).
set -euo pipefail
model=${1:?usage: read_ahead_check.sh MODEL.gguf [LIMIT_MIB] [ROUNDS] [bench flags...]}
limit_mib=${2:-1200}
rounds=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
bin=${TANDEM:-target/release/tandem}

if [ -d /sys/fs/cgroup/memory ]; then
  cg=/sys/fs/cgroup/memory/tandem-read-ahead
  mkdir -p "$cg"
  echo $((limit_mib << 20)) > "$cg/memory.limit_in_bytes"
else
  cg=/sys/fs/cgroup/tandem-read-ahead
  mkdir -p "$cg"
  echo $((limit_mib << 20)) > "$cg/memory.max"
fi

evict() {
  python3 - "$1" <<'PY'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
PY
}

echo "model $model, memory limit $limit_mib MiB, $rounds rounds, $(nproc) cores"
for round in $(seq 1 "$rounds"); do
  for mode in off on; do
    evict "$model"
    line=$(sh -c "echo \$\$ > $cg/cgroup.procs; exec $bin bench -m $model -p 0 -n 16 -r 2 -t 2 --no-progress --no-warmup --bandwidth-mib 0 --json --read-ahead $mode $*" 2>/dev/null |
      python3 -c 'import json,sys; r=json.load(sys.stdin)["rows"][0]; print("%.2f %.1f" % (r["s_tg_tps"], r["major_faults_per_tg_token"]))')
    read -r tps faults <<< "$line"
    echo "round $round read-ahead $mode: decode $tps t/s, $faults major faults per token"
    eval "tps_$mode=$tps"
  done
  python3 -c "print(f'round $round: on / off = {$tps_on / $tps_off:.2f}x')"
done
rmdir "$cg" 2>/dev/null || true
