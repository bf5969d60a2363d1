# Helpers the bench/*.sh scripts share (sourced, not run).

# The median of the numbers on stdin, one per line.
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
# The value of KEY=VALUE in the text on stdin.
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p"; }
# The arguments as whole numbers, for "runs: ..." lists.
runs_of() { printf '%.0f ' "$@"; }

# model_shape LAYERS SEED: sets the array `shape` to moecache-mkmodel's arguments for a generated
# model of LAYERS layers: EMBD (2048), FF (1792), PRESET (deepseek-v4-flash: the routing), SEED;
# the real-like presets (mixtral-like, qwen3-next-like, deepseek-like: docs/routing.md) bring their
# own expert counts unless EXPERTS and USED are given, the others 128 and 8 by default.
model_shape() {
  shape=(--layers "$1" --embd "${EMBD:-2048}" --ff "${FF:-1792}" --preset "${PRESET:-deepseek-v4-flash}" --seed "$2")
  case ${PRESET:-deepseek-v4-flash} in
    mixtral-like|qwen3-next-like|deepseek-like)
      [ -n "${EXPERTS:-}" ] && shape+=(--experts "$EXPERTS")
      [ -n "${USED:-}" ] && shape+=(--experts-used "$USED") ;;
    *) shape+=(--experts "${EXPERTS:-128}" --experts-used "${USED:-8}") ;;
  esac
  return 0
}

# loop_fs IMAGE BYTES [LOSETUP OPTIONS...]: a fresh ext4 on a loop device over the file IMAGE,
# mounted; sets $loopdev and $loop_mnt, and removes all of it (image too) when the script exits.
loop_fs() {
  local image=$1 bytes=$2
  shift 2
  loop_img=$image
  loop_mnt=$(mktemp -d /tmp/moecache-bench.XXXXXX)
  loopdev=
  trap loop_fs_cleanup EXIT
  truncate -s "$bytes" "$loop_img"
  loopdev=$(losetup "$@" -f --show "$loop_img")
  mkfs.ext4 -q -E nodiscard,lazy_itable_init=0 "$loopdev"
  mount "$loopdev" "$loop_mnt"
}
loop_fs_cleanup() {
  mountpoint -q "$loop_mnt" && umount "$loop_mnt"
  [ -n "$loopdev" ] && losetup -d "$loopdev"
  rmdir "$loop_mnt"
  rm -f "$loop_img"
}

# require_built TOP FILE...: each FILE exists (what a build makes) and node-llama-cpp is installed
# under TOP/tools/node, or the script stops saying what to run.
require_built() {
  local top=$1 b
  shift
  for b in "$@"; do
    [ -e "$b" ] || { echo "build first: cmake -S . -B build -G Ninja && ninja -C build ($b is missing)" >&2; exit 1; }
  done
  [ -d "$top/tools/node/node_modules/node-llama-cpp" ] || { echo "run scripts/setup/install-deps.sh first" >&2; exit 1; }
}

# memory_cgroup NAME: creates a memory cgroup NAME (v2 where the unified hierarchy has the memory
# controller, else v1's memory controller) and sets $cg to it; then set_limit BYTES, oom_kills
# (OOM kills in it so far) and in_cgroup CMD... (runs CMD inside it). The caller removes $cg.
memory_cgroup() {
  if grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    cg=/sys/fs/cgroup/$1
    set_limit() { echo "$1" > "$cg/memory.max"; echo 0 > "$cg/memory.swap.max" 2>/dev/null || true; }
    oom_kills() { sed -n 's/^oom_kill //p' "$cg/memory.events"; }
  elif [ -d /sys/fs/cgroup/memory ]; then
    cg=/sys/fs/cgroup/memory/$1
    set_limit() { echo "$1" > "$cg/memory.limit_in_bytes"; }
    oom_kills() { sed -n 's/^oom_kill //p' "$cg/memory.oom_control"; }
  else
    echo "no memory cgroup controller (v1 or v2) here" >&2
    return 1
  fi
  mkdir "$cg"
}
in_cgroup() { sh -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$cg" "$@"; }
