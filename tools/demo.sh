#!/usr/bin/env bash
# The demo: builds moecache, generates a Mixture-of-Experts model with DeepSeek-V4-Flash routing
# skew, shows what moecache sees in it, and runs real llama.cpp on it.
# Environment: MOECACHE_DEMO_DIR (build/demo), MOECACHE_DEMO_TOKENS (512).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"

tools/setup/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build -j "$(nproc)" moecachectl moecache-mkmodel $(ninja -C build -t targets all 2>/dev/null | grep -q '^moecache-routeprobe:' && echo moecache-routeprobe)

demo=${MOECACHE_DEMO_DIR:-$top/build/demo}
tokens=${MOECACHE_DEMO_TOKENS:-512}
mkdir -p "$demo"
model="$demo/deepseek-skew.gguf"

echo
echo "== 1. generate a model: 8 MoE layers x 64 experts, 4 used per token, DeepSeek-V4-Flash skew =="
build/tools/mkmodel/moecache-mkmodel -o "$model" --preset deepseek-v4-flash --seed 42

echo
echo "== 2. moecachectl inspect =="
build/ctl/moecachectl inspect "$model"

echo
echo "== 3. real llama.cpp (node-llama-cpp, 1 thread) generates $tokens tokens =="
probe=build/tools/routeprobe/libmoecache-routeprobe.so
if [ -x tools/routeprobe/measure-coverage.sh ] && [ -f "$probe" ]; then
  tools/routeprobe/measure-coverage.sh "$model" "$tokens"
else
  node tools/node/generate.mjs --model "$model" --tokens "$tokens" --threads 1 |
    node -e 'const j = JSON.parse(require("fs").readFileSync(0)); console.log(`${j.tokens} tokens at ${j.decode_tokens_per_second.toFixed(1)} tokens/s: ${j.text.slice(0, 160)}...`)'
fi
echo
echo "The model stays in $demo; nothing is left running."
