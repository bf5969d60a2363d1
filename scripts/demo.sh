#!/usr/bin/env bash
# The demo: builds moecache, generates a Mixture-of-Experts model with DeepSeek-V4-Flash routing
# skew, and runs real llama.cpp (node-llama-cpp, CPU, one thread) on it in a memory cgroup that
# holds the runtime and two thirds of the model: once with plain mmap, then beside moecached (in the
# foreground, a local configuration in a temporary directory, its own D-Bus for moecachectl) with
# the client runtime preloaded, cold and then warm (restarted with the heat it saved). Prints
# decode speeds, storage reads, experts per tier and what is locked; leaves nothing running.
# Environment: MOECACHE_DEMO_DIR (build/demo: the model, on disk), MOECACHE_DEMO_TOKENS (256).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"
source bench/common.sh

scripts/setup/install-deps.sh
if [ "$(id -u)" != 0 ]; then
  echo "The demo limits memory with a cgroup and runs moecached, which locks memory and loads BPF" >&2
  echo "programs: run it as root (sudo scripts/demo.sh)." >&2
  exit 1
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build -j "$(nproc)" moecached moecachectl moecache-mkmodel moecache-rearm

demo=${MOECACHE_DEMO_DIR:-$top/build/demo}
tokens=${MOECACHE_DEMO_TOKENS:-256}
mkdir -p "$demo"
model="$demo/deepseek-skew.gguf"
ctl=(build/ctl/moecachectl)
lib=build/client/libmoecache-rearm.so
run=$(mktemp -d /tmp/moecache-demo.XXXXXX)  # configuration, socket, heat, bus
chmod 755 "$run"
cg= dpid= bpid=
stop_daemon() {
  if [ -n "$dpid" ]; then kill "$dpid" 2>/dev/null || true; wait "$dpid" 2>/dev/null || true; fi
  dpid=
}
cleanup() {
  stop_daemon
  if [ -n "$bpid" ]; then kill "$bpid" 2>/dev/null || true; wait "$bpid" 2>/dev/null || true; fi
  [ -n "$cg" ] && rmdir "$cg" 2>/dev/null
  rm -rf "$run"
}
trap cleanup EXIT

echo
echo "== 1. generate a model: 8 MoE layers x 64 experts, 4 used per token, DeepSeek-V4-Flash skew =="
build/tools/mkmodel/moecache-mkmodel -o "$model" --preset deepseek-v4-flash --embd 512 --ff 256 --seed 42 --drop-cache
model_bytes=$(stat -c %s "$model")

echo
echo "== 2. moecachectl inspect =="
"${ctl[@]}" inspect "$model"

# A memory cgroup for the squeezed runs (bench/common.sh: memory_cgroup, set_limit, in_cgroup).
memory_cgroup "moecache-demo.$$"
dev=/sys/dev/block/$(stat -c '%Hd:%Ld' "$model")/stat
sectors() { if [ -r "$dev" ]; then awk '{print $3}' "$dev"; else echo 0; fi; }
declare -A speed read_mib
# generate NAME [in-cgroup] [ENV...]: one generation; records tokens/s and MiB read from storage.
generate() {
  local name=$1 where=$2 s0 out
  shift 2
  s0=$(sectors)
  local cmd=(env "$@" node tools/node/generate.mjs --model "$model" --tokens "$tokens" --threads 1 --max-seconds 30)
  if [ "$where" = in-cgroup ]; then out=$(in_cgroup "${cmd[@]}" 2>/dev/null); else out=$("${cmd[@]}" 2>/dev/null); fi
  read_mib[$name]=$(( ($(sectors) - s0) * 512 / 1048576 ))
  speed[$name]=$(node -e 'const j = JSON.parse(process.argv[1]); console.log(j.decode_tokens_per_second.toFixed(1))' "$out")
  anon=$(node -e 'console.log(JSON.parse(process.argv[1]).rss_anon_bytes)' "$out")
  printf '   %-26s %6s tokens/s, %5d MiB read from storage\n' "$name" "${speed[$name]}" "${read_mib[$name]}"
}

echo
echo "== 3. real llama.cpp (node-llama-cpp, 1 thread), $tokens tokens, model in RAM (no limit) =="
vmtouch -qt "$model"
generate "unsqueezed" free
limit=$(( anon + (48 << 20) + model_bytes * 2 / 3 ))
set_limit "$limit"

echo
echo "== 4. squeezed: a memory cgroup of $((limit >> 20)) MiB for the runtime ($((anon >> 20)) MiB of its own) and a $((model_bytes >> 20)) MiB model =="
vmtouch -qe "$model"
generate "plain mmap" in-cgroup

# moecached: foreground, local configuration, a private D-Bus that moecachectl reaches.
sed -e "s|@SOCKET@|$run/bus|" -e "s|@POLICY@|$top/dbus/org.moecache1.conf|" dbus/private-bus.conf.in > "$run/bus.conf"
dbus-daemon --config-file="$run/bus.conf" --nofork > "$run/bus.log" 2>&1 &
bpid=$!
for _ in $(seq 50); do [ -S "$run/bus" ] && break; sleep 0.1; done
export MOECACHE_BUS="unix:path=$run/bus"
cat > "$run/moecached.toml" <<TOML
[daemon]
state_dir = "$run/state"
socket = "$run/moecached.sock"
[budget]
lock = "$(( model_bytes / 3 ))"
reserve = "32MiB"
[pressure]
enabled = false
[metrics]
listen = ""
[dbus]
bus = "$MOECACHE_BUS"
[[model]]
path = "$model"
TOML
start_daemon() {
  sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$cg" build/daemon/moecached --config "$run/moecached.toml" \
    > "$run/moecached.log" 2>&1 &
  dpid=$!
  for _ in $(seq 100); do timeout 5 "${ctl[@]}" status >/dev/null 2>&1 && break; sleep 0.1; done
  sed 's/^/   moecached: /' "$run/moecached.log"
}
rearm=(LD_PRELOAD="$lib" MOECACHE_REARM_EXE=node MOECACHE_LOAD=lazy)
# Experts per tier, from moecachectl's JSON: locked in RAM, whole in the page cache (not locked),
# partly cached, on storage only.
tiers() {
  "${ctl[@]}" --json experts deepseek-skew.gguf --top 0 | node -e '
    let s = ""; process.stdin.on("data", d => s += d).on("end", () => {
      const e = JSON.parse(s), n = k => e.filter(k).length;
      const locked = n(x => x.tier === "ram"), cached = n(x => x.tier !== "ram" && x.cached_bytes >= x.bytes);
      const part = n(x => x.tier !== "ram" && x.cached_bytes > 0 && x.cached_bytes < x.bytes);
      console.log(`   experts: ${locked} locked in RAM, ${cached} cached (not locked), ${part} partly cached, ` +
                  `${e.length - locked - cached - part} on storage only (of ${e.length})`);
    })'
}

echo
echo "== 5. the same squeeze beside moecached, cold: no heat yet (lock budget $((model_bytes / 3 >> 20)) MiB) =="
vmtouch -qe "$model"
start_daemon
generate "moecache, cold start" in-cgroup "${rearm[@]}"
tiers
echo
echo "   moecachectl experts deepseek-skew.gguf --top 8 (what it learned, and where each one is):"
"${ctl[@]}" experts deepseek-skew.gguf --top 8 | sed 's/^/   /'
stop_daemon  # saves the heat

echo
echo "== 6. moecached restarted: warm from the heat it saved; it reads the hot set before the runtime starts =="
vmtouch -qe "$model"
start_daemon
for _ in $(seq 100); do
  [ "$("${ctl[@]}" --json status | node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>console.log(JSON.parse(s).prefetch_queued_bytes))')" = 0 ] && break
  sleep 0.1
done
generate "moecache, warm start" in-cgroup "${rearm[@]}"
tiers
echo
echo "   moecachectl status:"
"${ctl[@]}" status | sed 's/^/   /'
echo "   moecachectl models:"
"${ctl[@]}" models | sed 's/^/   /'
stop_daemon

echo
echo "== 7. what happened ($tokens tokens each; the cgroup's OOM kills: $(oom_kills)) =="
printf '   %-26s %10s %12s %14s\n' "" "tokens/s" "x plain" "MiB read"
for v in "unsqueezed" "plain mmap" "moecache, cold start" "moecache, warm start"; do
  awk -v v="$v" -v s="${speed[$v]}" -v p="${speed[plain mmap]}" -v r="${read_mib[$v]}" \
    'BEGIN {printf "   %-26s %10.1f %12s %14d\n", v, s, (p > 0 ? sprintf("%.1fx", s / p) : "-"), r}'
done
echo "   storage reads avoided by moecache (warm) against plain mmap: $(( read_mib[plain mmap] - read_mib[moecache, warm start] )) MiB"
echo
echo "The model stays in $demo; nothing is left running."
