#!/usr/bin/env bash
# What the eBPF page-cache telemetry costs and how much the daemon takes in, measured RUNS times
# with rounds interleaved, reported as medians:
#   sequential read   a child reads the model from a cold page cache with 1 MiB read(2) calls,
#                     with the daemon's programs detached (nothing loaded: the anchor) and attached
#                     (the daemon running with the model registered); ratio attached/detached,
#                     target >= 0.97 (at most 3 % slower)
#   flood             a child touches every page of the model through a MADV_RANDOM mapping: one
#                     folio per page, an added-page and a fault event per page, the most events a
#                     reader makes; the daemon's CPU per event gives the rate it consumes on one core
# The model lives on a RAM-backed disk (ext4 on a loop device over a file in /dev/shm): reads run
# at memory speed there, so the programs' cost is not hidden behind a disk's. With DISK=1 the same
# runs also use the model's own disk (default $MOECACHE_BUILD/bench), where a virtual disk's noise
# is larger than the effect.
#
#   bench/page-cache-telemetry.sh [RUNS]       (RUNS: 5; root)
# Environment: MOECACHE_BUILD (build dir, default build), DISK=1 (also the model's own disk).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MOECACHE_BUILD:-$top/build}
runs=${1:-5}
mk=$build/tools/mkmodel/moecache-mkmodel
pb=$build/bench/moecache-page-cache-bench
for b in "$mk" "$pb"; do
  [ -x "$b" ] || { echo "build first: cmake -S . -B build -G Ninja && ninja -C build ($b is missing)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "needs root: BPF programs, a loop device, dropping caches" >&2; exit 1; }
for t in losetup mkfs.ext4 bc; do command -v $t >/dev/null || { echo "$t is missing" >&2; exit 1; }; done
shape=(--layers 8 --embd 1024 --ff 512 --expert-type q8_0)   # 0.9 GB, 512 experts of 1.6 MiB

source "$top/bench/common.sh"
loop_fs /dev/shm/moecache-bench-telemetry.img 1200M
mnt=$loop_mnt

measure() {   # LABEL MODEL
  local label=$1 m=$2 i out
  local det=() att=() att_events=() att_consume=() fl_rate=() fl_consume=() fl_events=() fl_drop=() fl_mbps=() fl_det=()
  # All read rounds first, then the floods (a flood leaves the page cache full of small folios,
  # which slows the read after it); within a round the order alternates.
  read_det() { out=$("$pb" "$m" --mode read); det+=("$(echo "$out" | field mbps)"); }
  read_att() {
    out=$("$pb" "$m" --mode read --attached 2>/dev/null)
    att+=("$(echo "$out" | field mbps)"); att_events+=("$(echo "$out" | field events)")
    att_consume+=("$(echo "$out" | field consume_cpu)")
  }
  flood_det() { out=$("$pb" "$m" --mode flood); fl_det+=("$(echo "$out" | field mbps)"); }
  flood_att() {
    local ev cpu secs
    out=$("$pb" "$m" --mode flood --attached 2>/dev/null)
    fl_mbps+=("$(echo "$out" | field mbps)")
    ev=$(echo "$out" | field events); cpu=$(echo "$out" | field consume_cpu); secs=$(echo "$out" | field seconds)
    fl_events+=("$ev"); fl_drop+=("$(echo "$out" | field dropped)")
    fl_rate+=("$(echo "$ev / $secs" | bc -l)")
    fl_consume+=("$(echo "$ev / $cpu" | bc -l)")
  }
  for i in $(seq "$runs"); do
    if [ $((i % 2)) = 1 ]; then read_det; read_att; else read_att; read_det; fi
  done
  for i in $(seq "$runs"); do
    if [ $((i % 2)) = 1 ]; then flood_det; flood_att; else flood_att; flood_det; fi
  done
  local d a r
  d=$(printf '%s\n' "${det[@]}" | median); a=$(printf '%s\n' "${att[@]}" | median)
  printf '\n== %s\n' "$label"
  printf 'sequential read, detached   median %6.0f MB/s  (runs: %s)\n' "$d" "$(runs_of "${det[@]}")"
  printf 'sequential read, attached   median %6.0f MB/s  (runs: %s; %s events each; consume CPU s: %s)\n' \
    "$a" "$(runs_of "${att[@]}")" "${att_events[0]}" "${att_consume[*]}"
  printf 'attached / detached         %.3f  (target >= 0.97)\n' "$(echo "$a / $d" | bc -l)"
  d=$(printf '%s\n' "${fl_det[@]}" | median); a=$(printf '%s\n' "${fl_mbps[@]}" | median)
  printf 'flood read, detached        median %6.0f MB/s  (runs: %s)\n' "$d" "$(runs_of "${fl_det[@]}")"
  printf 'flood read, attached        median %6.0f MB/s  (runs: %s; attached/detached %.3f)\n' "$a" \
    "$(runs_of "${fl_mbps[@]}")" "$(echo "$a / $d" | bc -l)"
  r=$(printf '%s\n' "${fl_rate[@]}" | median)
  printf 'flood events                median %9.0f events/s produced and consumed  (%s events a run; dropped: %s)\n' \
    "$r" "${fl_events[0]}" "${fl_drop[*]}"
  r=$(printf '%s\n' "${fl_consume[@]}" | median)
  printf 'daemon consume rate         median %9.0f events per CPU-second on one core  (runs: %s)\n' \
    "$r" "$(runs_of "${fl_consume[@]}")"
}

"$mk" -o "$mnt/bench-telemetry.gguf" "${shape[@]}" >/dev/null
measure "RAM-backed disk (ext4 on $loopdev over /dev/shm)" "$mnt/bench-telemetry.gguf"
if [ "${DISK:-0}" = 1 ]; then
  dir=$build/bench
  mkdir -p "$dir"
  [ -f "$dir/bench-telemetry.gguf" ] || "$mk" -o "$dir/bench-telemetry.gguf" "${shape[@]}" --drop-cache >/dev/null
  measure "the model's own disk ($dir)" "$dir/bench-telemetry.gguf"
fi
