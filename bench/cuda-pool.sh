#!/usr/bin/env bash
# The VRAM pool benchmark (GPU machine): llama.cpp's expert-copy pattern replayed on a generated
# model (DeepSeek-V4-Flash skew preset), tokens/s for: no LD_PRELOAD, the hook in pass-through
# (MOECACHE_CUDA_POOL=0: it classifies and reports, serves nothing), pools of 10, 25 and 50 % of the
# expert bytes, 25 % with the expert bytes registered for DMA, and every expert resident in VRAM.
# Medians of REPEATS runs, interleaved; ratios against no LD_PRELOAD from the same run. Then the
# host cost of one intercepted call that the hook passes through.
#
#   bench/cuda-pool.sh WORKDIR [REPEATS]     (MOECACHE_BUILD: the build folder, default build)
# Model shape (environment): LAYERS 32, EXPERTS 128, USED 8, EMBD 2048, FF 768 (19.5 GiB q8_0),
# TOKENS 48 measured per run after WARMUP 16.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/common.sh"
build=${MOECACHE_BUILD:-build}
work=${1:?usage: bench/cuda-pool.sh WORKDIR [REPEATS]}
repeats=${2:-3}
bench=$build/bench/moecache-expert-copy-bench
hook=$(realpath "$build/cuda-hooks/libmoecache-cuda.so")
mkmodel=$build/tools/mkmodel/moecache-mkmodel
model=$work/pool-bench.gguf
tokens=${TOKENS:-48}
warmup=${WARMUP:-16}
mkdir -p "$work"
if [ ! -f "$model" ]; then
  "$mkmodel" --output "$model" --layers "${LAYERS:-32}" --experts "${EXPERTS:-128}" --experts-used "${USED:-8}" \
    --embd "${EMBD:-2048}" --ff "${FF:-768}" --preset deepseek-v4-flash >/dev/null
fi
cat "$model" >/dev/null  # in the page cache, as a runtime's mapping would have it after load

run() {  # run NAME ENV... : one measurement, JSON appended to $work/NAME.json
  local name=$1
  shift
  env "$@" "$bench" --model "$model" --tokens "$tokens" --warmup "$warmup" --seed "$RANDOM" >>"$work/$name.json"
}
configs=(nohook passthrough pool10 pool25 pool50 pool25pin vram)
rm -f "$work"/*.json
for r in $(seq "$repeats"); do
  run nohook MOECACHE_UNUSED=1
  run passthrough LD_PRELOAD="$hook" MOECACHE_CUDA_POOL=0 MOECACHE_CUDA_CLIENT=off
  run pool10 LD_PRELOAD="$hook" MOECACHE_CUDA_POOL=10% MOECACHE_CUDA_CLIENT=off
  run pool25 LD_PRELOAD="$hook" MOECACHE_CUDA_POOL=25% MOECACHE_CUDA_CLIENT=off
  run pool50 LD_PRELOAD="$hook" MOECACHE_CUDA_POOL=50% MOECACHE_CUDA_CLIENT=off
  run pool25pin LD_PRELOAD="$hook" MOECACHE_CUDA_POOL=25% MOECACHE_CUDA_PIN=all MOECACHE_CUDA_CLIENT=off
  "$bench" --model "$model" --mode vram --tokens "$tokens" --warmup "$warmup" --seed "$RANDOM" >>"$work/vram.json"
done
num() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
base=$(num tok_s <"$work/nohook.json" | median)
echo "model: $(head -1 "$work/nohook.json" | sed 's/"tokens".*//')}"
printf '%-12s %10s %9s %9s %10s %12s   %s\n' config tok/s vs_nohook hit_rate pool_share host_GiB/tok runs
for c in "${configs[@]}"; do
  f=$work/$c.json
  t=$(num tok_s <"$f" | median)
  printf '%-12s %10.2f %9.3f %9s %10s %12s   %s\n' "$c" "$t" "$(awk -v a="$t" -v b="$base" 'BEGIN{print a/b}')" \
    "$(num hit_rate <"$f" | median 2>/dev/null || true)" "$(num pool_share <"$f" | median 2>/dev/null || true)" \
    "$(num from_host_gib_per_token <"$f" | median 2>/dev/null || true)" "$(num tok_s <"$f" | tr '\n' ' ')"
done
echo "host time per cudaMemcpyAsync of 256 bytes (median of 7 x 200000 calls):"
plain=$("$bench" --model "$model" --mode overhead | num issue_us_per_call_median)
hooked=$(LD_PRELOAD="$hook" MOECACHE_CUDA_CLIENT=off "$bench" --model "$model" --mode overhead | num issue_us_per_call_median)
echo "  no hook ${plain} us, hook ${hooked} us: the hook adds $(awk -v a="$hooked" -v b="$plain" 'BEGIN{print a-b}') us per call"
