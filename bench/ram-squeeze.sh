#!/usr/bin/env bash
# Decode speed of a real llama.cpp (node-llama-cpp, CPU, one thread) when the model is larger than
# the memory the runtime may use: a generated model of ~2.85 GiB (28 layers x 64 experts, top-8,
# width 1024, q8_0, DeepSeek-like skew 2) and a memory cgroup of LIMIT (2000 MiB) around the runtime
# and, where it runs, moecached. Variants, rounds interleaved, each run from a dropped page cache:
#   unsqueezed    no cgroup, model cached (the anchor for the targets)
#   plain         in the cgroup, native load (MAP_POPULATE, WILLNEED, read-ahead)
#   plain-lazy    in the cgroup, libmoecache-rearm.so with MOECACHE_LOAD=lazy, no daemon
#   mlock         in the cgroup, the runtime's own mlock option (useMlock)
#   static-K      plain, with the dense part and the K hottest experts of every layer (the
#                 generator's own ranking: the best static choice there is) locked by `vmtouch -l`
#                 before the run; K from SQUEEZE_HOTSETS. The pages are read inside the cgroup (so
#                 they count against its limit), and the vmtouch processes run there too, as
#                 moecached does: one per range (vmtouch takes one range each), ~1000-1400 here at
#                 ~180 KiB each. SQUEEZE_LOCKERS=outside runs them outside the cgroup instead (the
#                 locked pages still count inside): a static lock without its own cost.
#   moecache-cold moecached in the cgroup (no heat yet) + lazy load + the hit signal
#   moecache-warm the same, moecached restarted with the heat profile the cold runs saved
#   moecache-cold-threads, moecache-warm-threads  the same with the daemon's pread engine
#                 ([prefetch] engine = "threads": where a container's seccomp profile denies
#                 io_uring), its own state folder; against io_uring's in the same rounds
# A run decodes TOKENS tokens or stops after SQUEEZE_SECONDS. Per variant, medians over the rounds:
# decode tokens/s over the whole run, over the first 50 tokens, over tokens 25-50 and after token 50
# ("steady"); the steady speed against plain, unsqueezed and the best static-K (each ratio the
# median of the rounds' own ratios: these machines drift between rounds more than within one);
# storage bytes read per token (the model's disk, everything on it: the daemon's reads count); OOM
# kills in the cgroup.
# Then the issue's targets: moecache at >= 80 % of unsqueezed and >= 1.2x the best static lock,
# a warm start at steady speed within 50 tokens (tokens 25-50 at >= 90 % of steady), no OOM kill.
#
#   bench/ram-squeeze.sh [RUNS] [TOKENS] [LIMIT]      (RUNS 3, TOKENS 256, LIMIT 2000M; root)
# Environment: MOECACHE_BUILD (build dir, default build), SQUEEZE_MODEL (reuse a model file),
# SQUEEZE_LOCK (moecached's lock budget, 900MiB), SQUEEZE_RESERVE (its reserve, 256MiB),
# SQUEEZE_HOTSETS ("16 24 32"), SQUEEZE_LOCKERS (inside), SQUEEZE_SECONDS (60), SQUEEZE_PORT (its
# metrics port, 18474), SQUEEZE_ENGINE (the daemon's [prefetch] engine: auto, io_uring, or threads,
# the pread engine that containers whose seccomp profile denies io_uring get),
# VARIANTS (all of the above, static-K expanded).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$top/bench/common.sh"
build=${MOECACHE_BUILD:-$top/build}
runs=${1:-3}
tokens=${2:-256}
limit=${3:-2000M}
lock=${SQUEEZE_LOCK:-900MiB}
reserve=${SQUEEZE_RESERVE:-256MiB}
hotsets=${SQUEEZE_HOTSETS:-16 24 32}
seconds=${SQUEEZE_SECONDS:-60}
port=${SQUEEZE_PORT:-18474}
lockers=${SQUEEZE_LOCKERS:-inside}
statics=$(for k in $hotsets; do printf 'static-%s ' "$k"; done)
variants=${VARIANTS:-"unsqueezed plain plain-lazy mlock $statics moecache-cold moecache-warm"}
mk=$build/tools/mkmodel/moecache-mkmodel
hotset=$build/bench/moecache-hotset
lib=$build/client/libmoecache-rearm.so
daemon=$build/daemon/moecached
gen=$top/tools/node/generate.mjs
require_built "$top" "$mk" "$hotset" "$lib" "$daemon"
[ "$(id -u)" = 0 ] || { echo "needs root: a memory cgroup, the daemon's locks and BPF programs" >&2; exit 1; }
for t in vmtouch curl; do command -v $t >/dev/null || { echo "needs $t (apt-get install $t)" >&2; exit 1; }; done

work=$(mktemp -d /var/tmp/moecache-squeeze.XXXXXX)
dpid=
cg=
cleanup() {
  if [ -n "$dpid" ]; then kill "$dpid" 2>/dev/null || true; wait "$dpid" 2>/dev/null || true; fi
  unlock_hotset
  [ -n "$cg" ] && rmdir "$cg" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

memory_cgroup "moecache-squeeze.$$" || exit 1
set_limit "$limit"

model=${SQUEEZE_MODEL:-$work/squeeze.gguf}
if [ ! -f "$model" ]; then
  "$mk" -o "$model" --layers 28 --experts 64 --experts-used 8 --embd 1024 --ff 512 --skew 2 --seed 7 >/dev/null
fi
dev=$(basename "$(df --output=source "$model" | tail -1)")
sectors_read() { awk -v d="$dev" '$3 == d {print $6}' /proc/diskstats; }

# config ENGINE STATE: moecached's configuration for one prefetch engine.
config() {
  cat <<TOML
[daemon]
state_dir = "$2"
socket = "$work/moecached.sock"
[budget]
lock = "$lock"
reserve = "$reserve"
[prefetch]
engine = "$1"
[pressure]
enabled = false
[metrics]
listen = "127.0.0.1:$port"
[dbus]
bus = "off"
[[model]]
path = "$model"
TOML
}
config "${SQUEEZE_ENGINE:-auto}" "$work/state" > "$work/moecached.toml"
config threads "$work/state-threads" > "$work/moecached-threads.toml"
mkdir -p "$work/state" "$work/state-threads"
# Per variant: its daemon's configuration and state folder; whether it starts the daemon cold.
conf_of() { [[ $1 == *-threads ]] && echo "$work/moecached-threads.toml" || echo "$work/moecached.toml"; }
state_of() { [[ $1 == *-threads ]] && echo "$work/state-threads" || echo "$work/state"; }
is_cold() { [[ $1 == moecache-cold* ]]; }
is_warm() { [[ $1 == moecache-warm* ]]; }

metric() { curl -sf "http://127.0.0.1:$port/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
start_daemon() {  # [CONFIG]
  # Not through in_cgroup: a function in the background is a subshell, and $! would be its pid.
  sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$cg" "$daemon" --config "${1:-$work/moecached.toml}" > "$work/daemon.log" 2>&1 &
  dpid=$!
  echo -250 > "/proc/$dpid/oom_score_adj" 2>/dev/null || true  # as its unit says (OOMScoreAdjust=)
  for _ in $(seq 100); do grep -q 'moecached running' "$work/daemon.log" && break; sleep 0.1; done
  # What its heat says is hot (nothing on a cold start) is read before the runtime starts.
  for _ in $(seq 300); do [ "$(metric moecache_prefetch_queued_bytes)" = 0 ] && break; sleep 0.1; done
  sleep 0.5
}
stop_daemon() {
  if [ -n "$dpid" ]; then
    kill "$dpid" 2>/dev/null || echo "  (moecached had exited: $(tail -1 "$work/daemon.log"))" >&2
    wait "$dpid" 2>/dev/null || true
  fi
  dpid=
}

# static-K: read the hot set inside the cgroup, then lock it with one vmtouch per range.
lock_hotset() {
  local k=$1
  [ -s "$work/hot-$k" ] || "$hotset" "$model" --top "$k" > "$work/hot-$k" 2>/dev/null
  in_cgroup sh -c 'while read -r f s e; do vmtouch -qt -p "$s-$e" "$f"; done' < "$work/hot-$k"
  mkdir -p "$work/pids"
  local lock='i=0; while read -r f s e; do i=$((i + 1)); vmtouch -qdlw -P "$0/$i" -p "$s-$e" "$f"; done'
  if [ "$lockers" = inside ]; then in_cgroup sh -c "$lock" "$work/pids" < "$work/hot-$k"
  else sh -c "$lock" "$work/pids" < "$work/hot-$k"; fi
}
unlock_hotset() {
  [ -d "$work/pids" ] || return 0
  local pids p
  pids=$(cat "$work"/pids/* 2>/dev/null || true)
  [ -z "$pids" ] || kill $pids 2>/dev/null || true
  for p in $pids; do  # gone, and their locks with them, before the next run evicts the model
    while kill -0 "$p" 2>/dev/null; do sleep 0.05; done
  done
  rm -rf "$work/pids"
}

# run VARIANT: one generation; prints "decode first50 late50 steady bytes_read tokens oom_kills".
run() {
  local v=$1 env=() cmd=(node "$gen" --model "$model" --tokens "$tokens" --threads 1 --max-seconds "$seconds")
  case $v in
    unsqueezed) vmtouch -qt "$model" ;;
    *) vmtouch -qe "$model" ;;
  esac
  case $v in
    plain-lazy) env=(LD_PRELOAD="$lib" MOECACHE_REARM_MS=0 MOECACHE_LOAD=lazy) ;;
    mlock) cmd+=(--mlock true) ;;
    static-*) lock_hotset "${v#static-}" ;;
    moecache-*) env=(LD_PRELOAD="$lib" MOECACHE_REARM_EXE=node MOECACHE_LOAD=lazy) ;;
  esac
  is_warm "$v" && start_daemon "$(conf_of "$v")"
  local s0 k0 out
  s0=$(sectors_read)
  k0=$(oom_kills)
  if [ "$v" = unsqueezed ]; then
    out=$(env "${env[@]}" "${cmd[@]}" 2>/dev/null || true)
  else
    out=$(in_cgroup env "${env[@]}" "${cmd[@]}" 2>/dev/null || true)
  fi
  local r
  r=$(printf '%s' "$out" | node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>{try{const j=JSON.parse(s);
    console.log([j.decode_tokens_per_second, j.warmup_tokens_per_second, j.late_warmup_tokens_per_second,
                 j.steady_tokens_per_second || j.decode_tokens_per_second, j.tokens].join(" "))}catch{console.log("0 0 0 0 0")}})')
  read -r dec w50 l50 st n <<<"$r"
  echo "$dec $w50 $l50 $st $(( ($(sectors_read) - s0) * 512 )) $n $(( $(oom_kills) - k0 ))"
  is_warm "$v" && stop_daemon
  case $v in static-*) unlock_hotset ;; esac
  return 0
}

echo "model $(du -h "$model" | cut -f1) ($model), memory cgroup $limit ($cg), moecached lock budget $lock," \
     "reserve $reserve, static lockers $lockers of the cgroup, $tokens tokens or $seconds s per run, $runs rounds"
declare -A dec w50 l50 st bytes ntok ooms per_round  # per_round[VARIANT,ROUND]: steady tok/s
for r in $(seq "$runs"); do
  for v in $variants; do
    k_before=$(oom_kills)
    if is_cold "$v"; then
      rm -rf "$(state_of "$v")/profiles"
      vmtouch -qe "$model"
      start_daemon "$(conf_of "$v")"
    fi
    read -r a b c d e f g < <(run "$v")
    is_cold "$v" && stop_daemon  # saves the heat the warm variant starts from
    dec[$v]+="$a "; w50[$v]+="$b "; l50[$v]+="$c "; st[$v]+="$d "; bytes[$v]+="$e "; ntok[$v]+="$f "
    per_round[$v,$r]=$d
    ooms[$v]=$(( ${ooms[$v]:-0} + $(oom_kills) - k_before ))  # the daemon's start and stop included
    printf '  round %d %-21s %6.2f tok/s (first 50 %6.2f, steady %6.2f) %4d tokens %7.0f MiB read\n' \
      "$r" "$v" "$a" "$b" "$d" "$f" "$(awk -v b="$e" 'BEGIN {print b / 1048576}')"
  done
done

med() { tr ' ' '\n' <<<"$1" | grep -v '^$' | median; }
# ratio V BASE: the median over the rounds of V's steady speed over BASE's in the same round.
ratio() {
  local r out=
  for r in $(seq "$runs"); do
    out+="$(awk -v a="${per_round[$1,$r]:-0}" -v b="${per_round[$2,$r]:-0}" 'BEGIN {print (b > 0 ? a / b : 0)}') "
  done
  med "$out"
}
best_static=0 best_k=
for v in $variants; do
  case $v in static-*)
    s=$(med "${st[$v]}")
    if awk -v a="$s" -v b="$best_static" 'BEGIN {exit !(a > b)}'; then best_static=$s; best_k=$v; fi ;;
  esac
done
has() { [[ " $variants " == *" $1 "* ]]; }
echo
printf '%-21s %8s %9s %9s %8s %8s %8s %8s %10s %4s\n' variant "tok/s" "first 50" "25-50" steady "x plain" "x unsq" "x static" "read/tok" OOM
declare -A xp xu xs
for v in $variants; do
  xp[$v]=-; xu[$v]=-; xs[$v]=-
  has plain && xp[$v]=$(ratio "$v" plain)
  has unsqueezed && xu[$v]=$(ratio "$v" unsqueezed)
  [ -n "$best_k" ] && xs[$v]=$(ratio "$v" "$best_k")
  awk -v v="$v" -v a="$(med "${dec[$v]}")" -v b="$(med "${w50[$v]}")" -v c="$(med "${l50[$v]}")" \
      -v s="$(med "${st[$v]}")" -v p="${xp[$v]}" -v u="${xu[$v]}" -v x="${xs[$v]}" \
      -v bt="$(med "${bytes[$v]}")" -v n="$(med "${ntok[$v]}")" -v o="${ooms[$v]}" '
    function f(r) { return r == "-" ? "-" : sprintf("%.2f", r) }
    BEGIN { printf "%-21s %8.2f %9.2f %9.2f %8.2f %8s %8s %8s %6.1f MiB %4d\n", v, a, b, c, s, f(p), f(u), f(x),
            (n > 0 ? bt / n / 1048576 : 0), o }'
done
echo
echo "best static lock: ${best_k:-none} ($best_static tok/s steady)"
for v in moecache-cold moecache-warm moecache-cold-threads moecache-warm-threads; do
  has "$v" || continue
  ramp=$(paste -d' ' <(tr ' ' '\n' <<<"${l50[$v]}") <(tr ' ' '\n' <<<"${st[$v]}") | awk 'NF == 2 && $2 > 0 {print $1 / $2}' | median)
  awk -v v="$v" -v u="${xu[$v]}" -v x="${xs[$v]}" -v l="${ramp:-0}" -v o="${ooms[$v]}" '
    function ok(c) { return c ? "met" : "NOT met" }
    BEGIN {
      printf "%s: %s of unsqueezed (target 80 %%: %s), %s the best static lock (target 1.2x: %s), ", v,
             (u == "-" ? "-" : sprintf("%.0f %%", 100 * u)), ok(u != "-" && u >= 0.8),
             (x == "-" ? "-" : sprintf("%.2fx", x)), ok(x != "-" && x >= 1.2)
      printf "tokens 25-50 at %.0f %% of steady (target 90 %%: %s), OOM kills %d\n", 100 * l, ok(l >= 0.9), o }'
done
# The pread engine against io_uring, round by round (the same rounds, the same anchor).
for v in cold warm; do
  has "moecache-$v-threads" && has "moecache-$v" &&
    printf 'moecache-%s: pread threads at %.2fx io_uring (median of the rounds'"'"' steady ratios)\n' "$v" \
      "$(ratio "moecache-$v-threads" "moecache-$v")"
done

true  # the comparison above may have nothing to say
