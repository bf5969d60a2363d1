#!/usr/bin/env bash
# The pinned tier, measured (GPU machine): how fast decode-shaped expert copies reach the GPU, and
# what it costs to make their source DMA-able, for each way a miss can go (moecache-pin-bench):
# as the runtime asks (pageable: the driver stages it, one thread), through the hook's pinned
# staging (MOECACHE_CUDA_PIN=staging, no pool), from the slices of the experts the daemon would
# keep locked registered one by one (a tier that follows lock/unlock directives), and from every
# expert byte registered (MOECACHE_CUDA_PIN=all). Medians of ROUNDS runs; ratios to pageable.
#   bench/pin-modes.sh MODEL.gguf [ROUNDS]     (MOECACHE_BUILD: the build folder, default build)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/common.sh"
build=${MOECACHE_BUILD:-build}
model=${1:?usage: bench/pin-modes.sh MODEL.gguf [ROUNDS]}
rounds=${2:-3}
bench=$build/bench/moecache-pin-bench
hook=$(realpath "$build/cuda-hooks/libmoecache-cuda.so")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat "$model" >/dev/null
for r in $(seq "$rounds"); do
  "$bench" --model "$model" --mode pageable >>"$work/pageable.json"
  LD_PRELOAD="$hook" MOECACHE_CUDA_PIN=staging MOECACHE_CUDA_POOL=0 MOECACHE_CUDA_CLIENT=off MOECACHE_CUDA_LOG=1 \
    "$bench" --model "$model" --mode pageable >>"$work/staging.json" 2>>"$work/staging.err"
  "$bench" --model "$model" --mode experts >>"$work/experts.json"
  "$bench" --model "$model" --mode all >>"$work/all.json"
done
num() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
base=$(num gb_s <"$work/pageable.json" | median)
printf '%-10s %8s %8s %12s %14s %16s %14s\n' way GB/s vs_pageable pinned_share register_us register_s_per_GiB unregister_us
for m in pageable staging experts all; do
  f=$work/$m.json
  g=$(num gb_s <"$f" | median)
  printf '%-10s %8.2f %8.2f %12s %14s %16s %14s\n' "$m" "$g" "$(awk -v a="$g" -v b="$base" 'BEGIN{print a/b}')" \
    "$(num pinned_share <"$f" | median)" "$(num register_us_per_call <"$f" | median)" \
    "$(num register_s_per_gib <"$f" | median)" "$(num unregister_us_per_call <"$f" | median)"
done
grep -h "staging" "$work/staging.err" | head -2 || true
