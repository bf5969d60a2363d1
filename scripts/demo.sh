#!/usr/bin/env bash
# The demo: builds moecache, generates a Mixture-of-Experts model (2.85 GiB: 28 layers x 64
# experts, 8 used per token, a DeepSeek-like skew), and runs real llama.cpp (node-llama-cpp, CPU,
# one thread) on it in a memory cgroup of 2000 MiB around the runtime and the daemon, as
# bench/ram-squeeze.sh does (the same model, cgroup and budgets: the demo shows what the benchmark
# measures): once with plain mmap, then beside moecached (in the foreground, a local configuration
# in a temporary directory, its own D-Bus for moecachectl) with the client runtime preloaded, cold
# and then warm (restarted with the heat it saved). Prints decode speeds against the unsqueezed
# run, storage reads per token, experts per tier, and moecachectl status's "is it helping?";
# leaves nothing running. Builds without the CUDA hook where CUDA's headers are missing (it needs
# none of it), and says so.
# Environment: MOECACHE_DEMO_DIR (build/demo: the model, on disk), MOECACHE_DEMO_TOKENS (128).
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
hook=()
if [ ! -f "${CUDA_HOME:-/usr/local/cuda}/include/cuda.h" ] && [ ! -f /usr/include/cuda.h ] &&
  ! grep -qs '^MOECACHE_CUDA_HOOK:BOOL=ON' build/CMakeCache.txt; then
  echo "No CUDA toolkit headers here (${CUDA_HOME:-/usr/local/cuda}/include/cuda.h): building without the CUDA hook," \
    "which this demo (llama.cpp on the CPU) does not use."
  hook=(-DMOECACHE_CUDA_HOOK=OFF)
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${hook[@]}" >/dev/null
ninja -C build -j "$(nproc)" moecached moecachectl moecache-mkmodel moecache-rearm

demo=${MOECACHE_DEMO_DIR:-$top/build/demo}
tokens=${MOECACHE_DEMO_TOKENS:-128}
limit_mib=2000 lock_mib=900
mkdir -p "$demo"
model="$demo/squeeze.gguf"
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
echo "== 1. generate a model: 28 MoE layers x 64 experts, 8 used per token, a DeepSeek-like skew (bench/ram-squeeze.sh's) =="
[ -f "$model" ] && [ "$(stat -c %s "$model")" -gt $((2 << 30)) ] ||
  build/tools/mkmodel/moecache-mkmodel -o "$model" --layers 28 --experts 64 --experts-used 8 --embd 1024 --ff 512 \
    --skew 2 --seed 7 --drop-cache
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
  done_tokens[$name]=$(node -e 'console.log(JSON.parse(process.argv[1]).tokens)' "$out")
  printf '   %-26s %6s tokens/s, %5d MiB read from storage\n' "$name" "${speed[$name]}" "${read_mib[$name]}"
}
declare -A done_tokens

echo
echo "== 3. real llama.cpp (node-llama-cpp, 1 thread), $tokens tokens, model in RAM (no limit) =="
vmtouch -qt "$model"
generate "unsqueezed" free
set_limit "${limit_mib}M"

echo
echo "== 4. squeezed: a memory cgroup of $limit_mib MiB around the runtime (and, below, moecached) for a $((model_bytes >> 20)) MiB model =="
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
lock = "${lock_mib}MiB"
reserve = "256MiB"
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
  "${ctl[@]}" --json experts squeeze.gguf --top 0 | node -e '
    let s = ""; process.stdin.on("data", d => s += d).on("end", () => {
      const e = JSON.parse(s), n = k => e.filter(k).length;
      const locked = n(x => x.tier === "ram"), cached = n(x => x.tier !== "ram" && x.cached_bytes >= x.bytes);
      const part = n(x => x.tier !== "ram" && x.cached_bytes > 0 && x.cached_bytes < x.bytes);
      console.log(`   experts: ${locked} locked in RAM, ${cached} cached (not locked), ${part} partly cached, ` +
                  `${e.length - locked - cached - part} on storage only (of ${e.length})`);
    })'
}

echo
echo "== 5. the same squeeze beside moecached, cold: no heat yet (lock budget $lock_mib MiB, in the cgroup) =="
vmtouch -qe "$model"
start_daemon
generate "moecache, cold start" in-cgroup "${rearm[@]}"
tiers
echo
echo "   moecachectl experts squeeze.gguf --top 8 (what it learned, and where each one is):"
"${ctl[@]}" experts squeeze.gguf --top 8 | sed 's/^/   /'
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
echo "== 7. what happened ($tokens tokens each, or 30 s; the cgroup's OOM kills: $(oom_kills)) =="
printf '   %-26s %10s %14s %16s\n' "" "tokens/s" "x unsqueezed" "MiB read/token"
for v in "unsqueezed" "plain mmap" "moecache, cold start" "moecache, warm start"; do
  awk -v v="$v" -v s="${speed[$v]}" -v u="${speed[unsqueezed]}" -v r="${read_mib[$v]}" -v n="${done_tokens[$v]:-0}" \
    'BEGIN {printf "   %-26s %10.1f %14s %16s\n", v, s, (u > 0 ? sprintf("%.2fx", s / u) : "-"), (n > 0 ? sprintf("%.1f", r / n) : "-")}'
done
cat <<TEXT
   unsqueezed: the model wholly in RAM, no limit: the speed to reach.
   plain mmap: the same runtime in $limit_mib MiB, as it loads by itself: the kernel evicts hot experts and
               reads them again from storage.
   moecache, cold: moecached and the re-arm preload in the same $limit_mib MiB, no heat yet: it learns
               the hot experts from the runtime's faults and locks them within $lock_mib MiB.
   moecache, warm: moecached restarted with the heat it saved: the hot set is read and locked before
               the first token.
   On the same squeeze bench/ram-squeeze.sh measures moecache warm at about 0.9x unsqueezed
   (medians of several rounds; this is one run of each, on a machine that may be busy).
TEXT
echo "The model stays in $demo; nothing is left running."
