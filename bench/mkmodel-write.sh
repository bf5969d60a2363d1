#!/usr/bin/env bash
# How close moecache-mkmodel writes to disk speed. Anchor, measured in the same run on the same
# file system: fio writing the same number of bytes sequentially (8 MiB blocks, buffered, fsync at
# the end, pages dropped afterwards as mkmodel --drop-cache does). Prints the median of N runs
# of each and the ratio.
#   bench/mkmodel-write.sh [DIR] [RUNS]     (DIR: where to write, default build/bench; RUNS: 3)
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$top/build/bench}
runs=${2:-3}
mk=${MOECACHE_BUILD:-$top/build}/tools/mkmodel/moecache-mkmodel
[ -x "$mk" ] || { echo "build first: cmake -S . -B build -G Ninja && ninja -C build" >&2; exit 1; }
command -v fio >/dev/null || { echo "fio is missing: scripts/setup/install-deps.sh installs it" >&2; exit 1; }
mkdir -p "$dir"
model="$dir/bench-write.gguf"
shape=(--layers 32 --embd 1024 --ff 512 --expert-type q8_0)

source "$top/bench/common.sh"

"$mk" -o "$model" "${shape[@]}" --drop-cache >/dev/null
bytes=$(stat -c %s "$model")
mk_rates=() fio_rates=()
for i in $(seq "$runs"); do
  rm -f "$model"
  start=$(date +%s.%N)
  "$mk" -o "$model" "${shape[@]}" --drop-cache >/dev/null
  end=$(date +%s.%N)
  mk_rates+=("$(echo "$bytes / ($end - $start) / 1000000" | bc -l)")
  rm -f "$model"
  out=$(fio --name=anchor --filename="$model" --rw=write --bs=8M --size="$bytes" --ioengine=psync \
            --end_fsync=1 --invalidate=1 --output-format=terse --terse-version=3)
  # terse v3: field 48 is the write bandwidth in KiB/s
  fio_rates+=("$(echo "$out" | awk -F';' '{print $48 * 1024 / 1000000}')")
  rm -f "$model"
done
mk_med=$(printf '%s\n' "${mk_rates[@]}" | median)
fio_med=$(printf '%s\n' "${fio_rates[@]}" | median)
printf 'model size           %d bytes (%s)\n' "$bytes" "${shape[*]}"
printf 'moecache-mkmodel     median %.0f MB/s  (runs: %s)\n' "$mk_med" "$(printf '%.0f ' "${mk_rates[@]}")"
printf 'fio sequential write median %.0f MB/s  (runs: %s)\n' "$fio_med" "$(printf '%.0f ' "${fio_rates[@]}")"
printf 'ratio mkmodel / fio  %.2f\n' "$(echo "$mk_med / $fio_med" | bc -l)"
