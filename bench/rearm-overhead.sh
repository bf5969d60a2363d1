#!/usr/bin/env bash
# What the hit signal costs a runtime: decode speed of a real llama.cpp (node-llama-cpp, CPU, one
# thread) on a generated DeepSeek-skew model, RUNS times each with rounds interleaved, as medians:
#   plain          no LD_PRELOAD, no daemon (the anchor)
#   re-arm P/R     libmoecache-rearm.so preloaded, a round every P ms at most R pages a second
#                  (MOECACHE_REARM_MS, MOECACHE_REARM_RATE; R 0: no limit): 1000/400 (the
#                  defaults), 1000/0, 100/0 and 10/0; moecached runs beside it, its eBPF programs
#                  attached and the model registered (watching only: nothing locked), so the
#                  faults are seen and attributed
# and the ratio of each to plain; the daemon's count of faults shows the signal arrived.
#
#   bench/rearm-overhead.sh [RUNS] [TOKENS]      (RUNS: 5, TOKENS: 1000; root)
# Environment: MOECACHE_BUILD (build dir, default build), PACES ("1000/400 1000/0 100/0 10/0").
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$top/bench/common.sh"
build=${MOECACHE_BUILD:-$top/build}
runs=${1:-5}
tokens=${2:-1000}
mk=$build/tools/mkmodel/moecache-mkmodel
lib=$build/client/libmoecache-rearm.so
daemon=$build/daemon/moecached
gen=$top/tools/node/generate.mjs
require_built "$top" "$mk" "$lib" "$daemon"
[ "$(id -u)" = 0 ] || { echo "needs root: the daemon's BPF programs" >&2; exit 1; }

work=$(mktemp -d /var/tmp/moecache-rearm-bench.XXXXXX)
dpid=
cleanup() { [ -n "$dpid" ] && kill "$dpid" 2>/dev/null && wait "$dpid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
model=$work/ds.gguf
"$mk" -o "$model" --preset deepseek-v4-flash --layers 8 --experts-used 4 --expert-type q8_0 >/dev/null
cat > "$work/moecached.toml" <<TOML
[daemon]
state_dir = "$work/state"
socket = "$work/moecached.sock"
[budget]
lock = "1MiB"
reserve = "0"
[policy]
admit_after_uses = 1000000000
[pressure]
enabled = false
[telemetry]
page_cache = "on"
[[model]]
path = "$model"
lock_dense = false
TOML
"$daemon" --config "$work/moecached.toml" >"$work/daemon.log" 2>&1 &
dpid=$!
for _ in $(seq 100); do grep -q "moecached running" "$work/daemon.log" && break; sleep 0.1; done
grep -q "moecached running" "$work/daemon.log" || { cat "$work/daemon.log" >&2; exit 1; }

tps() { sed -n 's/.*"decode_tokens_per_second":\([0-9.]*\).*/\1/p'; }
run() {   # PERIOD/RATE (0: plain)
  if [ "$1" = 0 ]; then
    node "$gen" --model "$model" --tokens "$tokens" --threads 1 --seed 1 2>/dev/null | tps
  else
    LD_PRELOAD=$lib MOECACHE_REARM_MS=${1%/*} MOECACHE_REARM_RATE=${1#*/} \
      node "$gen" --model "$model" --tokens "$tokens" --threads 1 --seed 1 2>/dev/null | tps
  fi
}
periods=(${PACES:-1000/400 1000/0 100/0 10/0})
for p in "${periods[@]}"; do
  [[ $p =~ ^[0-9]+/[0-9]+$ ]] || { echo "PACES: '$p' is not PERIOD_MS/RATE" >&2; exit 1; }
done
declare -A rates
for i in $(seq "$runs"); do
  rates[0]+="$(run 0) "
  for p in "${periods[@]}"; do rates[$p]+="$(run "$p") "; done
done
plain=$(echo "${rates[0]}" | tr ' ' '\n' | grep . | median)
printf 'model               %s (deepseek-v4-flash preset, q8_0), %d tokens, 1 thread\n' "$model" "$tokens"
printf 'plain               median %6.1f tok/s  (runs: %s)\n' "$plain" "${rates[0]}"
for p in "${periods[@]}"; do
  m=$(echo "${rates[$p]}" | tr ' ' '\n' | grep . | median)
  printf 're-arm %-12s median %6.1f tok/s  (runs: %s) ratio %.3f\n' "$p" "$m" "${rates[$p]}" "$(echo "$m / $plain" | bc -l)"
done
kill -TERM "$dpid"; wait "$dpid" || true; dpid=
grep -q 'page-cache telemetry on' "$work/daemon.log" || echo "note: moecached ran without its BPF programs" >&2
