#!/usr/bin/env bash
# Decode speed of a real llama.cpp (node-llama-cpp, CPU, one thread) when the model is larger than
# the memory the runtime may use: a generated model of ~2.85 GiB (28 layers x 64 experts, top-8,
# width 1024, q8_0, DeepSeek-like skew 2) and a memory cgroup of LIMIT (2000 MiB) around the runtime
# and, where it runs, moecached. Variants, rounds interleaved, each run from a dropped page cache:
#   unsqueezed    no cgroup, model cached (the anchor for the targets)
#   plain         in the cgroup, native load (MAP_POPULATE, WILLNEED, read-ahead)
#   plain lazy    in the cgroup, libmoecache-rearm.so with MOECACHE_LOAD=lazy
#   mlock         in the cgroup, the runtime's own mlock option (useMlock)
#   moecache cold moecached in the cgroup (no heat yet) + lazy load + the hit signal
#   moecache warm the same, moecached restarted with the heat profile the cold runs saved
# Prints per variant the median decode tokens/s, the ratio to plain and to unsqueezed, storage
# bytes read per token (the model's disk, everything on it: the daemon's prefetch counts), and OOM
# kills in the cgroup.
#
#   bench/ram-squeeze.sh [RUNS] [TOKENS] [LIMIT]      (RUNS 3, TOKENS 128, LIMIT 2000M; root)
# Environment: MOECACHE_BUILD (build dir, default build), SQUEEZE_LOCK (moecached's lock budget,
# default 900MiB), SQUEEZE_MODEL (reuse a model file), VARIANTS (all of the above).
# Not yet here (issue 8, open): a static `vmtouch -l` of the hot set as a second anchor. First
# figures (cgroup v1, 2 rounds of 64 tokens): plain 1.11 tok/s, lazy 3.85, moecache cold 4.24, warm
# 6.61, unsqueezed 33.6; the runtime's mlock OOM-killed.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$top/bench/common.sh"
build=${MOECACHE_BUILD:-$top/build}
runs=${1:-3}
tokens=${2:-128}
limit=${3:-2000M}
lock=${SQUEEZE_LOCK:-900MiB}
variants=${VARIANTS:-"unsqueezed plain plain-lazy mlock moecache-cold moecache-warm"}
mk=$build/tools/mkmodel/moecache-mkmodel
lib=$build/client/libmoecache-rearm.so
daemon=$build/daemon/moecached
gen=$top/tools/node/generate.mjs
require_built "$top" "$mk" "$lib" "$daemon"
[ "$(id -u)" = 0 ] || { echo "needs root: a memory cgroup, the daemon's locks and BPF programs" >&2; exit 1; }
command -v vmtouch >/dev/null || { echo "needs vmtouch (apt-get install vmtouch)" >&2; exit 1; }

work=$(mktemp -d /var/tmp/moecache-squeeze.XXXXXX)
dpid=
cg=
cleanup() {
  if [ -n "$dpid" ]; then kill "$dpid" 2>/dev/null || true; wait "$dpid" 2>/dev/null || true; fi
  [ -n "$cg" ] && rmdir "$cg" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# The memory cgroup: v2 where the unified hierarchy has the memory controller, else v1.
if grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
  cg=/sys/fs/cgroup/moecache-squeeze.$$
  mkdir "$cg"
  echo "$limit" > "$cg/memory.max"
  echo 0 > "$cg/memory.swap.max" 2>/dev/null || true
  oom_kills() { sed -n 's/^oom_kill //p' "$cg/memory.events"; }
elif [ -d /sys/fs/cgroup/memory ]; then
  cg=/sys/fs/cgroup/memory/moecache-squeeze.$$
  mkdir "$cg"
  echo "$limit" > "$cg/memory.limit_in_bytes"
  oom_kills() { sed -n 's/^oom_kill //p' "$cg/memory.oom_control"; }
else
  echo "no memory cgroup controller (v1 or v2) here" >&2
  exit 1
fi
in_cgroup() { sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$cg" "$@"; }

model=${SQUEEZE_MODEL:-$work/squeeze.gguf}
if [ ! -f "$model" ]; then
  "$mk" -o "$model" --layers 28 --experts 64 --experts-used 8 --embd 1024 --ff 512 --skew 2 --seed 7 >/dev/null
fi
dev=$(basename "$(df --output=source "$model" | tail -1)")
sectors_read() { awk -v d="$dev" '$3 == d {print $6}' /proc/diskstats; }

cat > "$work/moecached.toml" <<TOML
[daemon]
state_dir = "$work/state"
socket = "$work/moecached.sock"
[budget]
lock = "$lock"
reserve = "0"
[pressure]
enabled = false
[metrics]
listen = ""
[dbus]
bus = "off"
[[model]]
path = "$model"
TOML
mkdir -p "$work/state"

start_daemon() {
  # Not through in_cgroup: a function in the background is a subshell, and $! would be its pid.
  sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$cg" "$daemon" --config "$work/moecached.toml" > "$work/daemon.log" 2>&1 &
  dpid=$!
  echo -250 > "/proc/$dpid/oom_score_adj" 2>/dev/null || true  # as its unit says (OOMScoreAdjust=)
  for _ in $(seq 100); do grep -q 'moecached running' "$work/daemon.log" && break; sleep 0.1; done
  sleep 5  # its prefetch of what the heat says is hot
}
stop_daemon() {
  if [ -n "$dpid" ]; then
    kill "$dpid" 2>/dev/null || echo "  (moecached had exited: $(tail -1 "$work/daemon.log"))" >&2
    wait "$dpid" 2>/dev/null || true
  fi
  dpid=
}

# run VARIANT: one generation; prints "tok/s bytes_read oom_kills".
run() {
  local v=$1 env=() cmd=(node "$gen" --model "$model" --tokens "$tokens" --threads 1)
  case $v in
    unsqueezed) vmtouch -t "$model" >/dev/null ;;
    *) vmtouch -e "$model" >/dev/null ;;
  esac
  case $v in
    plain-lazy) env=(LD_PRELOAD="$lib" MOECACHE_REARM_MS=0 MOECACHE_LOAD=lazy) ;;
    mlock) cmd+=(--mlock true) ;;
    moecache-*) env=(LD_PRELOAD="$lib" MOECACHE_REARM_EXE=node MOECACHE_LOAD=lazy) ;;
  esac
  [ "$v" = moecache-warm ] && start_daemon
  local s0 k0 out
  s0=$(sectors_read)
  k0=$(oom_kills)
  if [ "$v" = unsqueezed ]; then
    out=$(env "${env[@]}" "${cmd[@]}" 2>/dev/null || true)
  else
    out=$(in_cgroup env "${env[@]}" "${cmd[@]}" 2>/dev/null || true)
  fi
  local tps
  tps=$(printf '%s' "$out" | node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>{try{console.log(JSON.parse(s).decode_tokens_per_second)}catch{console.log(0)}})')
  echo "$tps $(( ($(sectors_read) - s0) * 512 )) $(( $(oom_kills) - k0 ))"
  [ "$v" = moecache-warm ] && stop_daemon
  return 0
}

echo "model $(du -h "$model" | cut -f1) ($model), memory cgroup $limit ($cg), moecached lock budget $lock, $tokens tokens, $runs runs"
declare -A tps bytes ooms
for r in $(seq "$runs"); do
  for v in $variants; do
    k_before=$(oom_kills)
    if [ "$v" = moecache-cold ]; then
      rm -rf "$work/state/profiles"
      start_daemon
    fi
    read -r t b k < <(run "$v")
    [ "$v" = moecache-cold ] && stop_daemon  # saves the heat the warm variant starts from
    tps[$v]+="$t "
    bytes[$v]+="$b "
    ooms[$v]=$(( ${ooms[$v]:-0} + $(oom_kills) - k_before ))  # the daemon's start and stop included
    printf '  round %d %-14s %6.2f tok/s  %6.0f MiB read\n' "$r" "$v" "$t" "$(awk -v b="$b" 'BEGIN {print b / 1048576}')"
  done
done

med() { tr ' ' '\n' <<<"$1" | grep -v '^$' | median; }
plain=$(med "${tps[plain]:-0}")
unsq=$(med "${tps[unsqueezed]:-0}")
echo
printf '%-14s %10s %10s %12s %14s %5s\n' variant "tok/s" "x plain" "x unsqueezed" "read/token" OOM
for v in $variants; do
  t=$(med "${tps[$v]}")
  b=$(med "${bytes[$v]}")
  awk -v v="$v" -v t="$t" -v p="${plain:-0}" -v u="${unsq:-0}" -v b="$b" -v n="$tokens" -v o="${ooms[$v]}" \
    'BEGIN {printf "%-14s %10.2f %10s %12s %11.1f MiB %5d\n", v, t, (p > 0 ? sprintf("%.2f", t / p) : "-"), (u > 0 ? sprintf("%.2f", t / u) : "-"), b / n / 1048576, o}'
done
