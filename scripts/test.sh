#!/usr/bin/env bash
# Builds moecache and runs every test. On a fresh machine it first installs what it needs.
#   1. GCC, warnings as errors: all tests (labels unit, e2e; root and gpu as they come).
#   2. clang with ASan + UBSan: the unit tests again, and the GGUF reader's fuzzer for a fixed time.
#   First, the house style on every changed line (scripts/check-format.sh).
#   The boot under a real systemd (label systemd: debootstrap, systemd-nspawn -b, the .deb inside;
#   ~1 min with a cached root, ~2 without) runs with MOECACHE_SYSTEMD_TEST=1, or alone with
#   `ctest --test-dir build -L systemd --output-on-failure`.
# Environment: MOECACHE_FUZZ_SECONDS (60), MOECACHE_SKIP_SANITIZE=1 to run step 1 only,
# MOECACHE_SYSTEMD_TEST=1 to boot the package under systemd too.
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"

scripts/setup/install-deps.sh

jobs=$(nproc)
status=0

# Why each skipped test skipped (ctest prints the reason only with -V): grouped by reason, from the
# test log of BUILD_DIR's last ctest run (GTEST_SKIP's line after "Skipped", a script's "SKIP: ...").
skip_reasons() {
  local log=$1/Testing/Temporary/LastTest.log
  [ -f "$log" ] || return 0
  awk '/^[0-9]+\/[0-9]+ Testing: / { name = $3 }
       /: Skipped$/ { if ((getline reason) > 0) add(reason) }
       /^SKIP: / { add(substr($0, 7)) }
       function add(r) { if (!((name, r) in seen)) { seen[name, r] = 1; n[r]++; if (n[r] <= 3) who[r] = who[r] ((n[r] > 1) ? ", " : "") name } }
       END { for (r in n) { more = n[r] > 3 ? ", ..." : ""; printf "  %d skipped: %s (%s%s)\n", n[r], r, who[r], more } }' "$log" | sort -rn
}

echo "== format (scripts/check-format.sh) =="
scripts/check-format.sh || status=1

# The CUDA hook needs the toolkit's headers (CUDA_HOME, /usr/local/cuda): a machine without them
# builds and tests the rest, and says so (a build by hand stops instead).
hook=()
if [ ! -f "${CUDA_HOME:-/usr/local/cuda}/include/cuda.h" ] && [ ! -f /usr/include/cuda.h ]; then
  echo "== no CUDA headers here: building without the CUDA hook (-DMOECACHE_CUDA_HOOK=OFF) =="
  hook=(-DMOECACHE_CUDA_HOOK=OFF)
fi

echo "== build (gcc, -Werror) =="
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOECACHE_WERROR=ON "${hook[@]}" >/dev/null
ninja -C build -j "$jobs"
echo "== tests (gcc build) =="
skip_systemd=(-LE systemd)
[ "${MOECACHE_SYSTEMD_TEST:-0}" = 1 ] && skip_systemd=()
ctest --test-dir build --output-on-failure -j "$jobs" "${skip_systemd[@]}" || status=1
echo "== skipped tests and why =="
skip_reasons build

if [ "${MOECACHE_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "== build (clang, ASan + UBSan, libFuzzer) =="
  CC=clang CXX=clang++ cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug "${hook[@]}" \
      -DMOECACHE_WERROR=ON -DMOECACHE_SANITIZE=ON -DMOECACHE_FUZZ=ON \
      -DMOECACHE_FUZZ_SECONDS="${MOECACHE_FUZZ_SECONDS:-60}" >/dev/null
  ninja -C build-sanitize -j "$jobs" moecache-unit-tier  # what the unit and fuzz labels run
  echo "== tests (sanitizer build: unit, fuzz) =="
  # Not the statistical replays and presets (a minute or two each under ASan, ~11 CPU-minutes in
  # all; the gcc build above runs them): their code paths run here in the short sim, tracegen and
  # mkmodel tests.
  long='SimReplay\.(RamFollowsRecency|ThePolicyKeepsUp|PredictionIsPrecise|BurstyRouting|APoolFollowsRecency|ARecordedGpuServer)'
  long+='|TraceGen\.PresetsLand|TraceGen\.RealLike|MkModel\.PresetsMeet|MkModel\.RealRouting|Baselines\.OnTheDeepSeekPreset'
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-sanitize --output-on-failure -L 'unit|fuzz' -E "$long" -j "$jobs" || status=1
  echo "== skipped tests and why (sanitizer build) =="
  skip_reasons build-sanitize
fi
exit $status
