#!/usr/bin/env bash
# Measures how often each expert of each layer is routed when llama.cpp (node-llama-cpp, CPU, one
# thread) generates from MODEL, with libmoecache-routeprobe.so preloaded, and prints the coverage
# curve next to what the generator intended. Builds nothing: build first (ninja -C build).
#   tools/routeprobe/measure-coverage.sh MODEL.gguf [TOKENS]
# Environment: MOECACHE_ROUTEPROBE_LIB (default: build/tools/routeprobe/libmoecache-routeprobe.so),
# OUT (the JSON report; default: a new file under ${TMPDIR:-/tmp}), SEED (sampling seed, 1),
# MOECACHE_ROUTEPROBE_TRACE (also write the run as a router trace for moecache-sim; docs/trace.md).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 MODEL.gguf [TOKENS]" >&2
  exit 2
fi
model=$1
tokens=${2:-300}
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
lib=${MOECACHE_ROUTEPROBE_LIB:-$top/build/tools/routeprobe/libmoecache-routeprobe.so}
node_dir=$top/tools/node

[ -f "$model" ] || { echo "measure-coverage: no model at $model" >&2; exit 1; }
[ -f "$lib" ] || { echo "measure-coverage: no $lib: build it first (cmake -S $top -B $top/build -G Ninja && ninja -C $top/build moecache-routeprobe)" >&2; exit 1; }
command -v node >/dev/null || { echo "measure-coverage: node is not installed: run scripts/setup/install-deps.sh" >&2; exit 1; }
[ -f "$node_dir/node_modules/node-llama-cpp/package.json" ] || { echo "measure-coverage: node-llama-cpp is not installed in $node_dir: run scripts/setup/install-deps.sh" >&2; exit 1; }
[[ $tokens =~ ^[0-9]+$ ]] && [ "$tokens" -gt 0 ] || { echo "measure-coverage: TOKENS must be a positive number, not '$tokens'" >&2; exit 2; }

# llama.cpp opens a split model from its first part; the probe takes any part.
first=$model
if [[ $model =~ ^(.*)-([0-9]{5})-of-([0-9]{5})\.gguf$ ]]; then first="${BASH_REMATCH[1]}-00001-of-${BASH_REMATCH[3]}.gguf"; fi

out=${OUT:-$(mktemp "${TMPDIR:-/tmp}/routeprobe-$(basename "$model" .gguf)-XXXXXX.json")}
rm -f "$out"
gen=$(mktemp "${TMPDIR:-/tmp}/routeprobe-generate-XXXXXX.json")
trap 'rm -f "$gen"' EXIT

MOECACHE_ROUTEPROBE_MODEL=$model MOECACHE_ROUTEPROBE_OUT=$out LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}" \
  node "$node_dir/generate.mjs" --model "$first" --tokens "$tokens" --threads 1 --seed "${SEED:-1}" >"$gen"

if [ ! -s "$out" ]; then
  echo "measure-coverage: the probe wrote no report to $out (its message on stderr above says why)" >&2
  exit 1
fi

node - "$out" "$gen" <<'JS'
const fs = require("fs");
const r = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const g = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
const pct = (x) => (x == null ? "   -  " : (100 * x).toFixed(1).padStart(5) + " %");
const f = ["0.125", "0.25", "0.5"];
console.log(`model            ${r.model}`);
console.log(`shape            ${r.n_layers} MoE layers x ${r.n_experts} experts, ${r.n_experts_used} per token`);
console.log(`run              ${r.single_token_steps} single-token steps (+ ${r.batches} batch(es) of ${r.batch_tokens} tokens in all), ` +
            `${g.decode_tokens_per_second.toFixed(1)} tokens/s, ${r.probe_seconds.toFixed(2)} s in the probe`);
const m = r.mean_experts_per_layer_per_step;
const ok = m >= r.n_experts_used && m <= r.n_experts_used + 0.5;
console.log(`self-check       ${m.toFixed(3)} experts seen per layer per step (expert_used_count ${r.n_experts_used}): ` +
            (ok ? "ok" : m < r.n_experts_used ? "TOO FEW: weights repacked or read elsewhere?" : "TOO MANY: pages of unread experts were mapped"));
const pred = r.intended && r.intended.predicted_coverage;
console.log(`coverage         hottest 12.5 % / 25 % / 50 % of a layer's experts take`);
console.log(`  measured       ${f.map((k) => pct(r.coverage[k])).join("  ")}   (mean over layers)`);
console.log(`  split-half     ${f.map((k) => pct(r.coverage_split_half[k])).join("  ")}   (hottest chosen on odd steps, share read on even ones, and back)`);
if (pred) console.log(`  intended       ${f.map((k) => pct(pred[k])).join("  ")}   (mkmodel preset '${r.intended.preset}', simulated)`);
console.log(`spearman         ${r.spearman_mean == null ? "-" : r.spearman_mean.toFixed(3)}  (measured counts against the intended ranking, mean over layers)`);
console.log(`layer   12.5 %    25 %    50 %   spearman  experts/step`);
for (const l of r.layers)
  console.log(`${String(l.block).padStart(5)}  ${f.map((k) => pct(l.coverage[k])).join(" ")}   ${l.spearman == null ? "   -  " : l.spearman.toFixed(3).padStart(6)}    ${l.mean_experts_per_step.toFixed(3)}`);
console.log(`report           ${process.argv[2]}`);
JS
