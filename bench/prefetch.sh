#!/usr/bin/env bash
# Cold-cache prefetch of every routed expert of a model, three ways, each measured RUNS times from
# a cold page cache (rounds interleaved, so that drift of the virtual disk hits all three alike),
# reported as medians:
#   moecache   the daemon's Prefetcher driven from an epoll loop: io_uring buffered reads, random
#              expert order, QD 32, reads of up to 1 MiB (one per expert slice)  (prefetch_bench.cpp)
#   fio        --ioengine=io_uring --rw=randread --bs=<slice> --iodepth=32 --direct=0, whole file
#   vmtouch    vmtouch -t of the whole file
# and the ratios moecache/fio (target >= 0.95) and moecache/vmtouch (target >= 2).
#
#   bench/prefetch.sh [DIR] [RUNS]     (DIR: where the model lives, default $MOECACHE_BUILD/bench; RUNS: 3)
# Environment: MOECACHE_BUILD (build dir, default build), QD (32), READ_SIZE (1048576),
#   PREFETCH_ARGS (more moecache-prefetch-bench options, e.g. "--fadvise normal"),
#   LOOP=0 (skip the second section).
#
# vmtouch's page faults read ahead read_ahead_kb of the device at a time. With the kernel's default
# 128 KiB (what NVMe and SATA disks get unless someone raises it) it is latency bound and a QD 32
# prefetcher is several times faster. With a large window (the virtio disks of these VMs have
# 8 MiB) it streams sequentially at close to the disk's ceiling, and no prefetcher can be twice as
# fast as that: the run also prints the ceiling (fio sequential O_DIRECT reads of 8 MiB) so that
# this can be seen. So, as root and where the model's disk reads ahead more than 128 KiB, a second
# section repeats the three measurements with the kernel-default read-ahead: on a loop device
# (direct I/O, so every read still goes to the same disk) whose read_ahead_kb is 128, holding a
# copy of the model. The system's own disk settings are never changed.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MOECACHE_BUILD:-$top/build}
dir=${1:-$build/bench}
runs=${2:-3}
qd=${QD:-32}
read_size=${READ_SIZE:-1048576}
mk=$build/tools/mkmodel/moecache-mkmodel
pf=$build/bench/moecache-prefetch-bench
for b in "$mk" "$pf"; do
  [ -x "$b" ] || { echo "build first: cmake -S . -B build -G Ninja && ninja -C build ($b is missing)" >&2; exit 1; }
done
for t in fio vmtouch bc; do
  command -v $t >/dev/null || { echo "$t is missing: scripts/setup/install-deps.sh installs it" >&2; exit 1; }
done
root=0; [ "$(id -u)" = 0 ] && root=1
[ $root = 1 ] || echo "note: not root; dropping the cache works on files you own, and the loop-device section is skipped" >&2
mkdir -p "$dir"
model="$dir/bench-prefetch.gguf"
shape=(--layers 32 --embd 1024 --ff 512 --expert-type q8_0)   # 3.5 GB, 2048 experts of 1.6 MiB

source "$top/bench/common.sh"
ratio() { printf '%.2f' "$(echo "$1 / $2" | bc -l)"; }
fio_mbps() { awk -F';' '{print $7 * 1024 / 1000000}'; }   # terse v3: field 7 is read bandwidth, KiB/s

read_ahead_of() {   # read_ahead_kb of the block device holding $1
  local dev f
  dev=$(stat -c '%Hd:%Ld' "$1")
  for f in /sys/dev/block/$dev/queue/read_ahead_kb /sys/dev/block/$dev/../queue/read_ahead_kb; do
    [ -r "$f" ] && { cat "$f"; return; }
  done
  echo '?'
}

# measure LABEL MODEL CEILING: RUNS interleaved rounds, then the section's lines. CEILING=1 adds
# the disk's sequential O_DIRECT ceiling to each round.
measure() {
  local label=$1 m=$2 ceiling=$3 i out secs ra
  local mc_rates=() fio_rates=() vt_rates=() mc_sys=() ceil_rates=()
  local slice file_bytes info
  info=$("$pf" "$m" --info)
  slice=$(echo "$info" | field slice)
  file_bytes=$(echo "$info" | field file_bytes)
  ra=$(read_ahead_of "$m")
  drop() { vmtouch -qe "$m"; }   # POSIX_FADV_DONTNEED on the whole file
  for i in $(seq "$runs"); do
    drop
    # shellcheck disable=SC2086
    out=$("$pf" "$m" --qd "$qd" --read-size "$read_size" ${PREFETCH_ARGS:-})
    mc_rates+=("$(echo "$out" | field mbps)")
    mc_sys+=("$(echo "$out" | field sys)")

    drop
    out=$(fio --name=prefetch --filename="$m" --ioengine=io_uring --rw=randread --bs="$slice" \
              --iodepth="$qd" --direct=0 --size="$file_bytes" --invalidate=1 \
              --output-format=terse --terse-version=3)
    fio_rates+=("$(echo "$out" | fio_mbps)")

    drop
    secs=$(vmtouch -t "$m" | awk '/Elapsed:/ {print $2}')
    vt_rates+=("$(echo "$file_bytes / $secs / 1000000" | bc -l)")

    if [ "$ceiling" = 1 ]; then
      out=$(fio --name=ceiling --filename="$m" --ioengine=io_uring --rw=read --bs=8M --iodepth=4 \
                --direct=1 --size="$file_bytes" --output-format=terse --terse-version=3)
      ceil_rates+=("$(echo "$out" | fio_mbps)")
    fi
  done
  local mc fio_med vt
  mc=$(printf '%s\n' "${mc_rates[@]}" | median)
  fio_med=$(printf '%s\n' "${fio_rates[@]}" | median)
  vt=$(printf '%s\n' "${vt_rates[@]}" | median)
  printf '\n== %s\n' "$label"
  printf 'model               %s: %d bytes, expert slices of %d bytes, device read_ahead_kb %s\n' \
    "$m" "$file_bytes" "$slice" "$ra"
  printf 'moecache prefetch   median %5.0f MB/s  (runs: %s; QD %d, reads <= %d bytes%s; kernel CPU s: %s)\n' \
    "$mc" "$(runs_of "${mc_rates[@]}")" "$qd" "$read_size" "${PREFETCH_ARGS:+, $PREFETCH_ARGS}" "${mc_sys[*]}"
  printf 'fio randread        median %5.0f MB/s  (runs: %s; io_uring, buffered, bs %d, QD %d)\n' \
    "$fio_med" "$(runs_of "${fio_rates[@]}")" "$slice" "$qd"
  printf 'vmtouch -t          median %5.0f MB/s  (runs: %s)\n' "$vt" "$(runs_of "${vt_rates[@]}")"
  if [ "$ceiling" = 1 ]; then
    local ceil
    ceil=$(printf '%s\n' "${ceil_rates[@]}" | median)
    printf 'disk sequential     median %5.0f MB/s  (runs: %s; fio sequential O_DIRECT, bs 8 MiB, QD 4)\n' \
      "$ceil" "$(runs_of "${ceil_rates[@]}")"
    printf 'sequential/vmtouch  %s  (near or below 1: vmtouch reads as fast as the disk streams; nothing doubles it)\n' \
      "$(ratio "$ceil" "$vt")"
  fi
  printf 'moecache / fio      %s  (target >= 0.95)\n' "$(ratio "$mc" "$fio_med")"
  printf 'moecache / vmtouch  %s  (target >= 2)\n' "$(ratio "$mc" "$vt")"
}

[ -f "$model" ] || "$mk" -o "$model" "${shape[@]}" --drop-cache >/dev/null
measure "the model's own disk, as configured" "$model" 1

ra=$(read_ahead_of "$model")
if [ "${LOOP:-1}" = 0 ] || [ $root = 0 ] || [ "$ra" = 128 ] || [ "$ra" = '?' ]; then
  exit 0
fi
for t in losetup mkfs.ext4 mount; do
  command -v $t >/dev/null || { echo "$t is missing: the loop-device section is skipped" >&2; exit 0; }
done
file_bytes=$(stat -c %s "$model")
loop_fs "$dir/bench-prefetch-loop.img" $(( (file_bytes >> 20) * 1048576 + 256 * 1048576 )) --direct-io=on
mnt=$loop_mnt
echo 128 > "/sys/block/${loopdev#/dev/}/queue/read_ahead_kb"
cp "$model" "$mnt/"
sync
measure "kernel-default read-ahead (128 KiB): a loop device ($loopdev, direct I/O) on the same disk" \
  "$mnt/$(basename "$model")" 0
