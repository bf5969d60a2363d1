#!/usr/bin/env bash
# The CUDA hook's cost per intercepted call (host time), over tests' fake libcuda.so.1 so that the
# hook's own work is all that differs from the bare call: a copy from memory no model holds, an
# expert copy the pool does not serve (MOECACHE_CUDA_POOL=0: classified and reported only), and a
# pool hit (classified, planned, served device-to-device). Medians of 7 rounds of 100 000 calls,
# REPEATS runs (default 5), the median of those.
#   bench/hook-overhead.sh [REPEATS]      (MOECACHE_BUILD: the build folder, default build)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/common.sh"
build=$(realpath "${MOECACHE_BUILD:-build}")
repeats=${1:-5}
work=$(mktemp -d /tmp/moecache-hook-overhead.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$build/tools/mkmodel/moecache-mkmodel" --output "$work/m.gguf" --layers 4 --experts 64 --experts-used 4 --embd 256 \
  --ff 256 >/dev/null
run() {
  env LD_PRELOAD="$build/cuda-hooks/libmoecache-cuda.so" LD_LIBRARY_PATH="$build/tests/fake-cuda" \
    MOECACHE_CUDA_CLIENT=off "$@" "$build/bench/moecache-hook-overhead-bench" "$work/m.gguf"
}
num() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
for r in $(seq "$repeats"); do
  run MOECACHE_CUDA_POOL=0 >>"$work/nopool.json"
  run MOECACHE_CUDA_POOL=auto >>"$work/pool.json"
done
echo "microseconds per call, hook minus bare (medians of $repeats runs):"
echo "  a copy from memory no model holds:        $(num other_added_us <"$work/nopool.json" | median) (bare $(num other_bare_us <"$work/nopool.json" | median))"
echo "  an expert copy, not served (pool 0):      $(num expert_added_us <"$work/nopool.json" | median) (bare $(num expert_bare_us <"$work/nopool.json" | median))"
echo "  an expert copy served from the pool:      $(num expert_added_us <"$work/pool.json" | median) (bare $(num expert_bare_us <"$work/pool.json" | median); hits $(num slice_hits <"$work/pool.json" | median))"
