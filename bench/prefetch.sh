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
#   PREFETCH_ARGS (more moecache-prefetch-bench options, e.g. "--fadvise normal").
#
# vmtouch's page faults read ahead read_ahead_kb of the device at a time (printed): with the common
# 128 KiB it is latency bound and a QD 32 prefetcher is several times faster; with a large window
# (this VM's virtio disk has 8 MiB) it streams sequentially at what the disk gives, like fio. To see
# the 128 KiB case without touching the system disk, give DIR on a loop device of your own:
#   truncate -s 4G /var/tmp/l.img && L=$(losetup --direct-io=on -f --show /var/tmp/l.img)
#   mkfs.ext4 -q $L && mkdir -p /mnt/l && mount $L /mnt/l && echo 128 > /sys/block/${L#/dev/}/queue/read_ahead_kb
#   bench/prefetch.sh /mnt/l; umount /mnt/l; losetup -d $L; rm /var/tmp/l.img
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
for t in fio vmtouch; do
  command -v $t >/dev/null || { echo "$t is missing: tools/setup/install-deps.sh installs it" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || echo "note: not root; dropping the cache works on files you own" >&2
mkdir -p "$dir"
model="$dir/bench-prefetch.gguf"
shape=(--layers 32 --embd 1024 --ff 512 --expert-type q8_0)   # 3.5 GB, 2048 experts of 1.6 MiB

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p"; }
drop() { vmtouch -qe "$model"; }   # POSIX_FADV_DONTNEED on the whole file

[ -f "$model" ] || "$mk" -o "$model" "${shape[@]}" --drop-cache >/dev/null
info=$("$pf" "$model" --info)
slice=$(echo "$info" | field slice)
file_bytes=$(echo "$info" | field file_bytes)

dev=$(stat -c '%Hd:%Ld' "$model")
ra_file=/sys/dev/block/$dev/queue/read_ahead_kb
[ -r "$ra_file" ] || ra_file=/sys/dev/block/$dev/../queue/read_ahead_kb   # a partition
read_ahead_kb=$(cat "$ra_file" 2>/dev/null || echo '?')

mc_rates=() fio_rates=() vt_rates=() mc_sys=()
for i in $(seq "$runs"); do
  drop
  # shellcheck disable=SC2086
  out=$("$pf" "$model" --qd "$qd" --read-size "$read_size" ${PREFETCH_ARGS:-})
  mc_rates+=("$(echo "$out" | field mbps)")
  mc_sys+=("$(echo "$out" | field sys)")

  drop
  out=$(fio --name=prefetch --filename="$model" --ioengine=io_uring --rw=randread --bs="$slice" \
            --iodepth="$qd" --direct=0 --size="$file_bytes" --invalidate=1 \
            --output-format=terse --terse-version=3)
  # terse v3: field 7 is the read bandwidth in KiB/s
  fio_rates+=("$(echo "$out" | awk -F';' '{print $7 * 1024 / 1000000}')")

  drop
  secs=$(vmtouch -t "$model" | awk '/Elapsed:/ {print $2}')
  vt_rates+=("$(echo "$file_bytes / $secs / 1000000" | bc -l)")
done
mc=$(printf '%s\n' "${mc_rates[@]}" | median)
fio_med=$(printf '%s\n' "${fio_rates[@]}" | median)
vt=$(printf '%s\n' "${vt_rates[@]}" | median)
runs_of() { printf '%.0f ' "$@"; }
printf 'model               %s: %d bytes, expert slices of %d bytes\n' "$model" "$file_bytes" "$slice"
printf 'moecache prefetch   median %5.0f MB/s  (runs: %s; QD %d, reads <= %d bytes%s; kernel CPU s: %s)\n' \
  "$mc" "$(runs_of "${mc_rates[@]}")" "$qd" "$read_size" "${PREFETCH_ARGS:+, $PREFETCH_ARGS}" "${mc_sys[*]}"
printf 'fio randread        median %5.0f MB/s  (runs: %s; io_uring, buffered, bs %d, QD %d)\n' \
  "$fio_med" "$(runs_of "${fio_rates[@]}")" "$slice" "$qd"
printf 'vmtouch -t          median %5.0f MB/s  (runs: %s; device read_ahead_kb %s)\n' \
  "$vt" "$(runs_of "${vt_rates[@]}")" "$read_ahead_kb"
printf 'moecache / fio      %.2f  (target >= 0.95)\n' "$(echo "$mc / $fio_med" | bc -l)"
printf 'moecache / vmtouch  %.2f  (target >= 2)\n' "$(echo "$mc / $vt" | bc -l)"
