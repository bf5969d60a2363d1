#!/usr/bin/env bash
# The fuzz test: generates the seed corpus afresh, then runs the fuzzer for a fixed time on a copy
# of it, so that the inputs libFuzzer adds never leak into the next run's seeds. Crashing inputs
# are kept in DIR/artifacts.
# usage: run_fuzz.sh MAKE_SEED_CORPUS FUZZER DIR SECONDS   (MAKE_SEED_CORPUS may carry arguments;
# it is called with the corpus directory, which exists, appended)
set -euo pipefail
make_seed_corpus=$1 fuzzer=$2 dir=$3 seconds=$4

rm -rf "$dir/corpus" "$dir/work"
mkdir -p "$dir/corpus"
$make_seed_corpus "$dir/corpus"   # a command with its arguments
cp -r "$dir/corpus" "$dir/work"
mkdir -p "$dir/artifacts"
exec "$fuzzer" "$dir/work" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$dir/artifacts/" -print_final_stats=1
