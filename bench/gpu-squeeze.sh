#!/usr/bin/env bash
# The whole stack on a GPU machine (issue 21): a model larger than the RAM the runtime may use,
# served from storage -> RAM -> VRAM with one place per expert, by stock CUDA llama-server, as
# people run it: requests through its HTTP API, a prompt and then decode each.
#
# Models: a decode model (q5_K: llama.cpp repacks neither it nor the prompt model for its x86 CPU
# kernels, so the CPU anchors run at their defaults and the weights stay in the page cache) and
# its low-bit sibling for prompts (q3_K), one family (same architecture, shape and name). A memory
# cgroup (v2, or v1's memory controller) around the runtime and moecached holds RAM_SHARE of the
# decode model (1/1.5 by default).
#
# Configurations (rounds interleaved; each run from a dropped page cache unless said):
#   unsq-cpu      no cgroup, model cached, -ot exps=CPU at llama.cpp's default offload threshold:
#                 the anchor users have today, unsqueezed
#   unsq-cpu-none the same with --load-mode none (llama.cpp's own pinned host buffers)
#   unsq-static   no cgroup, the last layers' experts in VRAM statically (as many bytes as the pool),
#                 the rest as unsq-cpu; unsq-static-none with --load-mode none: the best llama.cpp
#                 configuration of the same VRAM bytes where RAM holds the model
#   unsq-hook     no cgroup, no daemon: the hook alone as config/'s drop-in preloads it (its default
#                 pinning), a pool of POOL %
#   sq-cpu        the same in the cgroup
#   sq-recipe     in the cgroup, the unified-memory recipe (GGML_OP_OFFLOAD_MIN_BATCH=1, experts
#                 in pageable host memory, their math on the GPU)
#   sq-static     in the cgroup, the last layers' experts in VRAM statically (as many bytes as the
#                 pool), the rest as sq-cpu; the full requests (the CPU's share fits the cgroup
#                 when the pool is large)
#   mc-cold       moecached (in the cgroup, no heat) + the CUDA hook (pool POOL % of the experts,
#                 one place, the registered tier following the daemon's locks) + lazy load
#   mc-warm       the same, moecached restarted with the heat profile mc-cold saved
#   mcS-cold/-warm the same with a pool of SMALL_POOL %: RAM + VRAM < model, some comes from storage
#   mcP-cold/-warm mc-cold/-warm with the daemon's next-token prediction on ([policy] predict):
#                 mcP-warm starts from the profile the last cold run (mc-cold or mcP-cold) saved
#   mcF-cold/-warm the model fits RAM (the common GPU box): no cgroup, moecached's lock budget above
#                 the model (no one place: RAM keeps every expert, the pool holds copies), the
#                 hook's pool POOL % directed by the daemon; against unsq-cpu
#   mcFb-cold/-warm mcF with the bundle's lib/libmoecache-cuda-b.so instead of the hook (an A/B:
#                 another build of the hook, put there by hand)
#   bk-cold/-warm the ggml backend route (BACKEND, libmoecache-ggml.so built against LLAMA_BIN's
#                 source) in the cgroup with moecached and lazy load: -ot exps=MOECACHE, a pool of
#                 POOL % on the GPU computing its experts while the CPU computes the rest; bk-warm
#                 restarts the daemon with bk-cold's heat and the backend with its hot profile
#   bkS-cold/-warm the same with a pool of SMALL_POOL % (RAM + VRAM < model)
#   sq-static-none sq-static with --load-mode none (llama.cpp's pinned host buffers: the CPU's
#                 share must fit the cgroup); sq-staticF/-none the first layers' experts on the GPU;
#                 sqS-static/-none the last layers' experts, as many bytes as a pool of SMALL_POOL %
#   swap-family   moecached fresh; the prompt model processes a long prompt, then the decode model
#                 starts and decodes: its family's heat locks, reads and pools before its first token
#   swap-alone    the same with the two models in families of their own (no shared heat)
#   swap-warm     swap-family with the family's saved heat kept (run it after mc-cold: the profile
#                 of earlier decoding, as a daemon that has served the family before has it)
#   text          (one round) the recipe unsqueezed: the greedy text the hook must reproduce
# Each server run sends REQUESTS requests (bench/serve_requests.py, llama-server's /completion): a
# prompt of PROMPT_WORDS words (about 2.5 tokens each), then N_PREDICT greedy tokens, EOS ignored,
# the generated vocabulary's byte tokens (ids 3-258) never sampled (alone they are not UTF-8, and
# llama-server's output parser ends a stream that has one). Reported per configuration,
# medians over rounds: prompt and decode tok/s of each request, decode tok/s over tokens 25-50 and
# "steady" (after 50), storage bytes read per decoded token (the model disk's counters, between a
# request's first token and its last), OOM kills in the cgroup; for moecache also its pool hits
# (the hook's summary), locks and the one-place check: every few seconds `moecachectl experts
# --json` (with a private bus) or /metrics: no expert both locked in RAM and held by a pool.
#
#   bench/gpu-squeeze.sh LLAMA_BIN [WORKDIR]
# LLAMA_BIN: a folder with llama-server of a CUDA build and its libraries.
# Environment: SEED (11: the models' seed), PRESET (mkmodel's routing: deepseek-v4-flash), BUNDLE (a scripts/bundle.sh directory; made from MOECACHE_BUILD, default build,
#   when not given), CONFIGS, ROUNDS (2), POOL (50), SMALL_POOL (10), RAM_SHARE (0.66),
#   RESERVE (2GiB), REQUESTS (3), PROMPT_WORDS (1200), N_PREDICT (128), SQ_N_PREDICT (32: the
#   squeezed CPU runs decode this many), SQ_REQUESTS (REQUESTS: how many requests they send), LAYERS EXPERTS USED EMBD FF (the shape: 32 128 8 2048
#   1792), TYPE (q5_K), PROMPT_TYPE (q3_K), THREADS (llama-server's -t; its own default unless
#   set), DBUS_DAEMON (a dbus-daemon for a private bus; default the PATH's), SERVER_TIMEOUT (900 s
#   for a server to load), DEADLINE (seconds: no run starts after it; the table is still printed),
#   TRACE_CONFIGS (moecache configurations whose hook writes a router trace, RUN.trace.jsonl:
#   docs/trace.md), ROUND_FROM (1: the first round's number, so that the rounds of several calls share WORKDIR),
#   TABLE_ONLY=1 (print the table of what WORKDIR holds, every round found, and run nothing).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/.." && pwd)
source "$here/common.sh"
bin=$(realpath "${1:?usage: bench/gpu-squeeze.sh LLAMA_BIN [WORKDIR]}")
work=${2:-/var/tmp/moecache-gpu-squeeze}
rounds=${ROUNDS:-2}
round_from=${ROUND_FROM:-1}
configs=(${CONFIGS:-unsq-cpu sq-cpu sq-recipe sq-static mc-cold mc-warm mcS-cold mcS-warm swap-family swap-alone swap-warm text})
layers=${LAYERS:-32}
if [ "${TABLE_ONLY:-0}" != 1 ]; then
[ "$(id -u)" = 0 ] || { echo "gpu-squeeze: needs root (a memory cgroup, the daemon's locks, BPF)" >&2; exit 2; }
[ -x "$bin/llama-server" ] || { echo "gpu-squeeze: $bin/llama-server is missing" >&2; exit 2; }
pool=${POOL:-50}
small_pool=${SMALL_POOL:-10}
ram_share=${RAM_SHARE:-0.66}
reserve=${RESERVE:-2GiB}
requests=${REQUESTS:-3}
prompt_words=${PROMPT_WORDS:-1200}
n_predict=${N_PREDICT:-128}
sq_n_predict=${SQ_N_PREDICT:-32}
mkdir -p "$work"
work=$(realpath "$work")

bundle=${BUNDLE:-}
if [ -z "$bundle" ]; then
  bundle=$work/bundle
  "$top/scripts/bundle.sh" "$bundle" "${MOECACHE_BUILD:-$top/build}" >/dev/null
fi
bundle=$(realpath "$bundle")
daemon=$bundle/bin/moecached
ctl=$bundle/bin/moecachectl
mkmodel=$bundle/bin/moecache-mkmodel
backend=$(realpath "${BACKEND:-$bundle/lib/libmoecache-ggml.so}" 2>/dev/null || echo "${BACKEND:-}")
hook=$bundle/lib/libmoecache-cuda.so
rearm=$bundle/lib/libmoecache-rearm.so
for f in "$daemon" "$ctl" "$mkmodel" "$hook" "$rearm"; do [ -e "$f" ] || { echo "gpu-squeeze: $f is missing" >&2; exit 2; }; done

# The models: one family, two quantizations, the same routing (seed and preset).
# PRESET: mkmodel's routing preset (deepseek-v4-flash); the real-like ones (mixtral-like,
# qwen3-next-like, deepseek-like: docs/routing.md) bring their own expert counts unless EXPERTS
# and USED are given.
preset=${PRESET:-deepseek-v4-flash}
model_shape "$layers" "${SEED:-11}"
seed_tag=
[ "${SEED:-11}" = 11 ] || seed_tag=-s$SEED
[ "$preset" = deepseek-v4-flash ] || seed_tag=$seed_tag-$preset
model=$work/decode-${TYPE:-q5_K}$seed_tag.gguf
pmodel=$work/prompt-${PROMPT_TYPE:-q3_K}$seed_tag.gguf
[ -f "$model" ] || "$mkmodel" --output "$model" "${shape[@]}" --expert-type "${TYPE:-q5_K}" >/dev/null
# The prompt model only for the swaps (the disk holds a few such models, not many).
if [[ " ${configs[*]} " == *" swap-"* ]]; then
  [ -f "$pmodel" ] || "$mkmodel" --output "$pmodel" "${shape[@]}" --expert-type "${PROMPT_TYPE:-q3_K}" >/dev/null
fi
sync
model_bytes=$(stat -c %s "$model")
limit=$(awk -v b="$model_bytes" -v s="$ram_share" 'BEGIN {printf "%.0f", b * s}')
info=$("$ctl" inspect "$model" --json)
expert_bytes=$(python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["layers"][0]["bytes_per_expert"])' "$info" 2>/dev/null || echo 0)
dev=$(basename "$(df --output=source "$model" | tail -1)")
sectors() { awk -v d="$dev" '$3 == d {print $6}' /proc/diskstats; }

# Prompts of ordinary words, one per request (different texts: nothing is cached between them).
python3 - "$work" "$prompt_words" "$requests" "${SQ_REQUESTS:-$requests}" <<'EOF'
import json, random, sys
work, words, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
vocab = "the of and to in is was for on that with as by at from his her they this which or an be are".split()
def text(seed, k):
    r = random.Random(seed)
    return " ".join(r.choice(vocab) for _ in range(k))
json.dump([text(100 + i, words) for i in range(n)], open(f"{work}/prompts.json", "w"))
sq = int(sys.argv[4])  # the squeezed CPU runs: the first SQ_REQUESTS of them
json.dump([text(100 + i, words) for i in range(min(n, sq))], open(f"{work}/prompts-sq.json", "w"))
json.dump([text(7, words * 2)], open(f"{work}/long-prompt.json", "w"))  # the swap's prompt
json.dump([text(8, 24)], open(f"{work}/short-prompt.json", "w"))        # and its decode request
EOF

memory_cgroup "moecache-gpu-squeeze.$$" || exit 2
set_limit "$limit"
dpid= spid= bus_pid= sampler=
cleanup() {
  for p in $sampler $spid $dpid $bus_pid; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rmdir "$cg" 2>/dev/null || true
}
trap cleanup EXIT

# A private system-type bus for moecachectl, where a dbus-daemon is at hand (the GPU machine has
# none installed: carry one), else the one-place check reads /metrics.
bus=off
dbus=${DBUS_DAEMON:-$(command -v dbus-daemon || true)}
if [ -n "$dbus" ] && [ -x "$dbus" ]; then
  sed -e "s|@SOCKET@|$work/bus.sock|" -e "s|@POLICY@|$top/dbus/org.moecache1.conf|" \
    "$top/dbus/private-bus.conf.in" > "$work/bus.conf"
  rm -f "$work/bus.sock"
  "$dbus" --config-file="$work/bus.conf" --nofork --nopidfile > "$work/bus.log" 2>&1 &
  bus_pid=$!
  for _ in $(seq 50); do [ -S "$work/bus.sock" ] && break; sleep 0.1; done
  [ -S "$work/bus.sock" ] && bus="unix:path=$work/bus.sock"
fi
export DBUS_SYSTEM_BUS_ADDRESS=${bus#off}

port=18475
# GET URL to stdout (python3's: the GPU machine may have no curl); fails quietly.
http_get() { python3 -c 'import sys, urllib.request
try: sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
except Exception as e: sys.stderr.write(f"http_get {sys.argv[1]}: {e}\n"); sys.exit(1)' "$1"; }
# daemon_config [separate] [predict]: both models configured; separate gives each a family of its
# own; predict turns the daemon's next-token prediction on ([policy] predict).
daemon_config() {
  local fam_d= fam_p= predict=false
  [[ " $* " == *" separate "* ]] && { fam_d='family = "decode-alone"'; fam_p='family = "prompt-alone"'; }
  [[ " $* " == *" predict "* ]] && predict=true
  local lock=$limit
  [[ " $* " == *" fit "* ]] && lock=$(( model_bytes * 5 / 4 ))
  cat > "$work/moecached.toml" <<TOML
[daemon]
state_dir = "$work/state"
socket = "$work/moecached.sock"
[budget]
lock = "$lock"
reserve = "$reserve"
[pressure]
# As bench/ram-squeeze.sh: a runtime whose model is larger than the cgroup always stalls on memory
# at first, and PSI back-off would give the locks up to it; the cap under the cgroup's limit less
# the reserve and what the runtime holds is what keeps it alive here.
enabled = false
[policy]
predict = $predict
[metrics]
listen = "127.0.0.1:$port"
[dbus]
bus = "$( [ "$bus" = off ] && echo off || echo "$bus")"
[[model]]
path = "$model"
$fam_d
TOML
  [ -f "$pmodel" ] && printf '[[model]]\npath = "%s"\n%s\n' "$pmodel" "$fam_p" >> "$work/moecached.toml"
  return 0
}
start_daemon() {  # start_daemon [nocg]: in the cgroup unless told
  # Each line stamped with the time (epoch seconds, as RUN.times: the swap's timeline).
  local where=$cg
  [ "${1:-}" = nocg ] && where=
  sh -c '[ -n "$0" ] && echo $$ > "$0/cgroup.procs"; exec "$@"' "$where" "$daemon" --config "$work/moecached.toml" \
    > >(while IFS= read -r l; do printf '%s %s\n' "${EPOCHREALTIME%????}" "$l"; done > "$work/daemon.log") 2>&1 &
  dpid=$!
  for _ in $(seq 200); do grep -q 'moecached running' "$work/daemon.log" && break; sleep 0.1; done
  # A warm start's reads and locks done before the runtime comes (the service runs from boot): the
  # metrics answer, nothing is queued and the locks stay the same for 2 s; at most 90 s.
  local m q l prev=-1 same=0
  for _ in $(seq 180); do
    sleep 0.5
    m=$(http_get "http://127.0.0.1:$port/metrics" 2>/dev/null) || continue
    q=$(awk '$1 == "moecache_prefetch_queued_bytes" {print $2}' <<< "$m")
    l=$(awk 'index($1, "moecache_locked_bytes") == 1 {s += $2} END {printf "%.0f", s}' <<< "$m")
    if [ "${q:-1}" = 0 ] && [ "$l" = "$prev" ]; then
      same=$(( same + 1 ))
      [ $same -ge 4 ] && break
    else
      same=0
    fi
    prev=$l
  done
}
stop_daemon() {  # stop_daemon RUN: its log kept as RUN.daemon.log
  [ -n "$dpid" ] || return 0
  kill "$dpid" 2>/dev/null || echo "  (moecached had exited: $(tail -1 "$work/daemon.log"))" >&2
  wait "$dpid" 2>/dev/null || true
  dpid=
  cp "$work/daemon.log" "$work/$1.daemon.log" 2>/dev/null || true
}
# One place, live: experts both locked and in a pool (not pinned, keep_ram_copy off), sampled:
# "BOTH POOLED LOCKED EPOCH" a line.
sample_one_place() {
  local out=$1
  : > "$out"
  while sleep 3; do
    if [ "$bus" != off ]; then
      "$ctl" experts "$model" --top 0 --json 2>/dev/null | python3 -c '
import json, sys
try: e = json.load(sys.stdin)
except ValueError: sys.exit()
both = sum(1 for x in e if x["tier"] == "vram+ram" and not x["pinned"])
import time
print(both, sum(1 for x in e if x["vram_pools"]), sum(1 for x in e if x["tier"] == "ram"), f"{time.time():.1f}")' >> "$out" || true
    else
      http_get "http://127.0.0.1:$port/metrics" 2>/dev/null | awk '
        /^moecache_experts\{/ && /decode/ { if ($0 ~ /tier="vram\+ram"/) b += $2; if ($0 ~ /tier="vram"/) v += $2; if ($0 ~ /tier="ram"/) r += $2 }
        END { srand(); print b + 0, v + 0, r + 0, srand() }' >> "$out" || true
    fi
  done
}

static_ot() {  # [first]: the last (or first) layers' experts on the GPU, as many bytes as a pool of $pool %
  local n=$(( layers * pool / 100 )) first
  first=$(( layers - n ))
  [ "${1:-}" = first ] && first=0
  echo "blk\.($(seq -s '|' "$first" $(( first + n - 1 ))))\.ffn_.*_exps\.=CUDA0"
}

# wait_settled MODEL: until moecached has placed MODEL (reads done, pools filled: `moecachectl wait`,
# or moecache_model_settled on /metrics without a bus), at most WARM_WAIT seconds; prints the seconds.
wait_settled() {
  local m=$1 t0=$SECONDS
  if [ "$bus" != off ]; then
    "$ctl" wait "$m" --timeout "${WARM_WAIT:-150}" >&2 || true
  else
    local same=0
    while [ $(( SECONDS - t0 )) -lt "${WARM_WAIT:-150}" ] && [ $same -lt 4 ]; do
      if http_get "http://127.0.0.1:$port/metrics" 2>/dev/null | grep -F "file=\"$m\"" | grep -q '^moecache_model_settled{.* 1$'; then
        same=$(( same + 1 ))
      else
        same=0
      fi
      sleep 0.5
    done
  fi
  echo $(( SECONDS - t0 ))
}

# serve NAME MODEL CGROUP(0/1) PROMPTS N_PREDICT ENV...: one llama-server, the requests, stopped.
# With GATE=1 the requests wait for wait_settled (a swap's decode model: placed before its first token).
serve() {
  local name=$1 m=$2 in_cg=$3 prompts=$4 n=$5
  shift 5
  local ot=(-ot exps=CPU) lm=()
  case $name in
    sq-staticF*) ot=(-ot "$(static_ot first),exps=CPU") ;;
    sqS-static*) ot=(-ot "$(pool=$small_pool static_ot),exps=CPU") ;;
    sq-static*|unsq-static*) ot=(-ot "$(static_ot),exps=CPU") ;;
    bk*) ot=(-ot exps=MOECACHE) ;;
  esac
  case $name in *-none.*) lm=(--load-mode none) ;; esac
  local args=(-m "$m" -ngl 99 "${ot[@]}" "${lm[@]}" -fa off -c 8192 -np 1 --port 18080 --no-webui --seed 1)
  [ -n "${THREADS:-}" ] && args+=(-t "$THREADS")
  if [ "$in_cg" = 1 ]; then
    sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$cg" env "$@" "$bin/llama-server" "${args[@]}" > "$work/$name.server.log" 2>&1 &
  else
    env "$@" "$bin/llama-server" "${args[@]}" > "$work/$name.server.log" 2>&1 &
  fi
  spid=$!
  local t0 ok=0
  t0=$(date +%s.%N)
  echo "start $t0" > "$work/$name.times"
  for _ in $(seq $(( ${SERVER_TIMEOUT:-900} * 5 ))); do
    kill -0 "$spid" 2>/dev/null || break
    http_get http://127.0.0.1:18080/health >/dev/null 2>&1 && { ok=1; break; }
    sleep 0.2
  done
  local load_s
  load_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  echo "healthy ${EPOCHREALTIME%????}" >> "$work/$name.times"
  if [ $ok = 1 ] && [ "${GATE:-0}" = 1 ]; then
    wait_settled "$m" > "$work/$name.settle"
    echo "settled ${EPOCHREALTIME%????}" >> "$work/$name.times"
  fi
  if [ $ok = 1 ]; then
    python3 "$here/serve_requests.py" http://127.0.0.1:18080 "$prompts" "$work/$name.json" --n-predict "$n" --disk "$dev" --raw --ban 3-258 ||
      echo "gpu-squeeze: $name: the requests failed" >&2
  else
    echo "gpu-squeeze: $name: llama-server did not come up: $(tail -n 3 "$work/$name.server.log")" >&2
    echo '[{"error": "no server"}]' > "$work/$name.json"
  fi
  echo "done ${EPOCHREALTIME%????}" >> "$work/$name.times"
  kill "$spid" 2>/dev/null || true
  wait "$spid" 2>/dev/null || true
  spid=
  echo "$load_s" > "$work/$name.load"
}

drop_caches() { sync; echo 1 > /proc/sys/vm/drop_caches; }
hook_env() {  # hook_env POOL_PERCENT [b]: the environment of config/'s llama-server drop-in, with the bundle's paths (b: its hook B)
  local hook=libmoecache-cuda.so
  [ "${2:-}" = b ] && hook=libmoecache-cuda-b.so
  sed -n 's/^Environment=//p' "$top/config/llama-server.service.d/moecache.conf" |
    sed -e "s|/usr/lib/libmoecache-cuda.so|/usr/lib/$hook|" -e "s|/usr/lib/|$bundle/lib/|g" -e "s|/run/moecache/moecached.sock|$work/moecached.sock|"
  # The hook's own hot profile off: warm and cold here are the daemon's (HOOK_PROFILE: a folder for it).
  echo MOECACHE_CUDA_POOL="$1%" MOECACHE_CUDA_LOG=1 MOECACHE_CUDA_PROFILE="${HOOK_PROFILE:-off}"
}

bk_env() {  # bk_env POOL_PERCENT: the backend route beside moecached, with lazy load
  echo LD_PRELOAD="$rearm" MOECACHE_SOCKET="$work/moecached.sock" MOECACHE_REARM_MS=0 \
    GGML_BACKEND_PATH="$backend" MOECACHE_GGML_POOL="$1%" MOECACHE_GGML_LOG=1 MOECACHE_GGML_PROFILE="$work/bk-profiles"
}

trace_env() {  # trace_env CONFIG RUN: MOECACHE_TRACE for the configurations TRACE_CONFIGS names
  [[ " ${TRACE_CONFIGS:-} " == *" $1 "* ]] && echo MOECACHE_TRACE="$work/$2.trace.jsonl"
  return 0
}

# run CONFIG ROUND: one configuration's run, its rows in $work/CONFIG.ROUND.*.
run() {
  local c=$1 r=$2 out=$c.$r k0 s0
  k0=$(oom_kills)
  s0=$(sectors)
  case $c in
    unsq-cpu|unsq-cpu-none|unsq-static|unsq-static-none)
      cat "$model" > /dev/null; serve "$out" "$model" 0 "$work/prompts.json" "$n_predict" MOECACHE_UNUSED=1 ;;
    unsq-hook)
      cat "$model" > /dev/null
      # shellcheck disable=SC2046
      serve "$out" "$model" 0 "$work/prompts.json" "$n_predict" $(hook_env "$pool") MOECACHE_CUDA_CLIENT=off ;;
    text) cat "$model" > /dev/null; serve "$out" "$model" 0 "$work/prompts.json" "$n_predict" GGML_OP_OFFLOAD_MIN_BATCH=1 ;;
    sq-cpu) drop_caches; serve "$out" "$model" 1 "$work/prompts-sq.json" "$sq_n_predict" MOECACHE_UNUSED=1 ;;
    sq-recipe) drop_caches; serve "$out" "$model" 1 "$work/prompts-sq.json" "$sq_n_predict" GGML_OP_OFFLOAD_MIN_BATCH=1 ;;
    # The CPU's share of its experts fits the cgroup when the pool is large: the full requests.
    sq-static|sq-static-none|sq-staticF|sq-staticF-none)
      drop_caches; serve "$out" "$model" 1 "$work/prompts.json" "$n_predict" MOECACHE_UNUSED=1 ;;
    # Most of the model on the CPU in a cgroup that cannot hold it: the squeezed CPU runs' requests.
    sqS-static|sqS-static-none)
      drop_caches; serve "$out" "$model" 1 "$work/prompts-sq.json" "$sq_n_predict" MOECACHE_UNUSED=1 ;;
    bk-cold|bk-warm|bkS-cold|bkS-warm)
      [ -f "$backend" ] || { echo "gpu-squeeze: $c: BACKEND ($backend) is missing" >&2; return 0; }
      local p=$pool
      [[ $c == bkS-* ]] && p=$small_pool
      daemon_config
      [[ $c == *-cold ]] && rm -rf "$work/state/profiles" "$work/bk-profiles"
      drop_caches
      start_daemon
      sample_one_place "$work/$out.oneplace" & sampler=$!
      # shellcheck disable=SC2046
      serve "$out" "$model" 1 "$work/prompts.json" "$n_predict" $(bk_env "$p")
      kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true; sampler=
      http_get "http://127.0.0.1:$port/metrics" > "$work/$out.metrics" || true
      cat "$cg/memory.stat" > "$work/$out.memstat" 2>/dev/null
      stop_daemon "$out" ;;
    mc-cold|mcS-cold|mc-warm|mcS-warm|mcP-cold|mcP-warm|mcF-cold|mcF-warm|mcFb-cold|mcFb-warm)
      # mcF*: the model fits RAM: no cgroup around the runtime or the daemon (cg= its argument).
      local p=$pool ab='' in_cg=1 where=''
      [[ $c == mcS-* ]] && p=$small_pool
      [[ $c == mcFb-* ]] && ab=b
      case $c in
        mcP-*) daemon_config predict ;;
        mcF*) daemon_config fit; in_cg=0; where=nocg ;;
        *) daemon_config ;;
      esac
      [[ $c == *-cold ]] && rm -rf "$work/state/profiles"
      drop_caches
      start_daemon $where
      sample_one_place "$work/$out.oneplace" & sampler=$!
      # shellcheck disable=SC2046
      serve "$out" "$model" "$in_cg" "$work/prompts.json" "$n_predict" $(hook_env "$p" $ab) $(trace_env "$c" "$out")
      kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true; sampler=
      http_get "http://127.0.0.1:$port/metrics" > "$work/$out.metrics" || true
      [ "$in_cg" = 1 ] && cat "$cg/memory.stat" > "$work/$out.memstat" 2>/dev/null
      stop_daemon "$out" ;;  # saves the heat the warm run starts from
    swap-family|swap-alone|swap-warm)
      [ "$c" = swap-alone ] && daemon_config separate || daemon_config
      [ "$c" = swap-warm ] || rm -rf "$work/state/profiles"
      drop_caches
      start_daemon
      # shellcheck disable=SC2046
      serve "$out.prompt" "$pmodel" 1 "$work/long-prompt.json" 1 $(hook_env "$pool")
      sample_one_place "$work/$out.oneplace" & sampler=$!
      # The decode model's requests wait until moecached has placed it (SWAP_GATE=0: at once).
      # shellcheck disable=SC2046
      GATE=${SWAP_GATE:-1} serve "$out" "$model" 1 "$work/short-prompt.json" "$n_predict" $(hook_env "$pool")
      kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true; sampler=
      http_get "http://127.0.0.1:$port/metrics" > "$work/$out.metrics" || true
      cat "$cg/memory.stat" > "$work/$out.memstat" 2>/dev/null || true
      stop_daemon "$out" ;;
    *) echo "gpu-squeeze: unknown configuration $c" >&2; exit 2 ;;
  esac
  echo $(( $(oom_kills) - k0 )) > "$work/$out.oom"
  echo $(( ($(sectors) - s0) * 512 )) > "$work/$out.disk"
}

echo "decode model $(numfmt --to=iec "$model_bytes") ($model), prompt model $(du -h "$pmodel" | cut -f1);" \
     "memory cgroup $(numfmt --to=iec "$limit") ($cg), pool $pool % / $small_pool %, reserve $reserve, bus $bus, $rounds round(s)"
started=$SECONDS
for r in $(seq "$round_from" $(( round_from + rounds - 1 ))); do
  for c in "${configs[@]}"; do
    [ "$c" = text ] && [ "$r" != "$round_from" ] && continue  # once a call
    if [ -n "${DEADLINE:-}" ] && [ $(( SECONDS - started )) -ge "$DEADLINE" ]; then
      echo "  round $r: $c skipped: DEADLINE ($DEADLINE s) passed" >&2
      continue
    fi
    echo "  round $r: $c ($(( SECONDS - started )) s)" >&2
    run "$c" "$r"
  done
done
echo "$expert_bytes" > "$work/expert_bytes"
fi  # TABLE_ONLY

expert_bytes=$(cat "$work/expert_bytes" 2>/dev/null || echo 0)
rounds=$(ls "$work" | sed -n 's/^[a-zA-Z-]*\.\([0-9]*\)\.json$/\1/p' | sort -n | tail -1)
rounds=${rounds:-0}

python3 - "$work" "$rounds" "$expert_bytes" "$layers" "${configs[*]}" <<'EOF'
import json, os, re, statistics, sys
work, rounds, expert_bytes, layers, configs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split()
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
def load(path):
    try: return json.load(open(path))
    except (OSError, ValueError): return None
def num(path):
    try: return float(open(path).read().split()[0])
    except (OSError, ValueError, IndexError): return None
def f(x, d=1): return "-" if x is None else f"{x:.{d}f}"
rows, texts = {}, {}
for c in configs:
    for r in range(1, rounds + 1):
        base = f"{work}/{c}.{r}"
        reqs = load(base + ".json")
        if reqs is None: continue
        row = rows.setdefault(c, {"pp": [], "tg": [], "tg1": [], "l50": [], "steady": [], "disk_tok": [], "oom": [], "load": [],
                                  "hit": [], "both": [], "locked": [], "ramp": [], "filled": [], "settle": []})
        ok = [q for q in reqs if "error" not in q]
        if ok:
            row["pp"].append(med([q["prompt_tps"] for q in ok]))
            row["tg"].append(med([q["decode_tps"] for q in ok]))
            row["tg1"].append(ok[0]["decode_tps"])
            row["l50"].append(ok[0]["tps_25_50"])
            row["steady"].append(med([q["tps_steady"] for q in ok]))
            later = ok[1:] or ok
            toks = sum(q["decode_tokens"] or 0 for q in later)
            row["disk_tok"].append(sum(q["disk_bytes_decode"] for q in later) / toks if toks else None)
            if ok[0]["tps_25_50"] and ok[0]["tps_steady"]: row["ramp"].append(ok[0]["tps_25_50"] / ok[0]["tps_steady"])
            texts.setdefault(c, []).append([q["text"] for q in ok])
        row["oom"].append(num(base + ".oom"))
        row["load"].append(num(base + ".load"))
        if os.path.exists(base + ".settle"): row["settle"].append(num(base + ".settle"))
        try:
            log = open(base + ".server.log", errors="replace").read()
            h = re.findall(r"slices (\d+) hit / (\d+) missed", log)
            if h: row["hit"].append(100.0 * sum(int(a) for a, _ in h) / max(sum(int(a) + int(b) for a, b in h), 1))
            bk = re.findall(r"expert rows computed: ([\d.]+) % from the pool", log)  # the backend's
            if bk: row["hit"].append(float(bk[-1]))
            fl = re.findall(r"slices filled ahead (\d+)", log)
            if fl: row["filled"].append(sum(int(x) for x in fl))
        except OSError: pass
        try:
            samples = [list(map(int, l.split()[:3])) for l in open(base + ".oneplace") if l.strip()]
            if samples:
                row["both"].append(max(s[0] for s in samples))
        except (OSError, ValueError): pass
        try:
            m = open(base + ".metrics").read()
            lk = sum(float(l.split()[-1]) for l in m.splitlines() if l.startswith("moecache_locked_bytes{"))
            row["locked"].append(lk / 2**30)
        except OSError: pass
anchor = med(rows.get("unsq-cpu", {}).get("steady", [])) or med(rows.get("unsq-cpu", {}).get("tg", []))
sq = med(rows.get("sq-cpu", {}).get("tg", []))
sq_pp = med(rows.get("sq-cpu", {}).get("pp", []))
print(f"\nmedians of {rounds} round(s); tok/s; x unsq / x sq: steady decode against unsq-cpu's, and against sq-cpu's decode; "
      f"storage MiB per decoded token (requests 2.., between first and last token); 1 % of an expert per layer = "
      f"{expert_bytes * layers / 100 / 2**20:.2f} MiB")
print("| config | load s | settle s | pp | pp x sq | decode | steady | x unsq | x sq | first request 25-50 / steady | storage MiB/token | pool hit % | slices filled ahead | locked GiB | both (max) | OOM |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for c in configs:
    if c not in rows: continue
    w = rows[c]
    st, pp = med(w["steady"]), med(w["pp"])
    xu = st / anchor if st and anchor else None
    xs = st / sq if st and sq else None
    ppx = pp / sq_pp if pp and sq_pp else None
    dt = med(w["disk_tok"])
    print(f"| {c} | {f(med(w['load']))} | {f(med(w['settle']))} | {f(pp)} | {f(ppx, 2)} | {f(med(w['tg']))} | {f(st)} | {f(xu, 2)} | {f(xs, 2)} | "
          f"{f(med(w['ramp']), 2)} | {f(dt / 2**20 if dt is not None else None, 2)} | {f(med(w['hit']))} | {f(med(w['filled']), 0)} | {f(med(w['locked']))} | "
          f"{f(med(w['both']), 0)} | {f(sum(x for x in w['oom'] if x) if w['oom'] else None, 0)} |")
ref = texts.get("text", [None])[0]
if ref:
    for c in configs:
        if (c.startswith("mc") or c == "unsq-hook") and c in texts:  # the backend computes on the CPU too: bench/gpu-backend-ppl.sh
            same = all(t == ref for t in texts[c])
            print(f"greedy text of {c} = the recipe's: {'yes' if same else 'NO'}")
EOF
