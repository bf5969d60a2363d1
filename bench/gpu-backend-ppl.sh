#!/usr/bin/env bash
# Does the backend route change what llama.cpp computes? (GPU machine) Over a 4k-token text of the
# generated model's words: llama-perplexity with -ot exps=CPU (every expert on the CPU at this
# micro-batch) saves its logits; the same with libmoecache-ggml.so (-ot exps=MOECACHE, a pool of
# POOL, pooled experts on the GPU and the rest on the CPU) is compared with them: perplexity, and
# the share of positions whose top-1 token is the same (llama-perplexity --kl-divergence). Beside
# it, what llama.cpp's own GPU kernels change against its CPU ones on the same model (REFS):
#   static  the same VRAM bytes as the pool, statically: the last layers' experts on CUDA0
#   gpu     every expert on the GPU
#   vs-gpu  the backend again, compared with every expert on the GPU instead of the CPU (its logits
#           the base): how far the backend moves llama.cpp's own GPU result
# (a generated model's logits are near uniform: how far a GPU's rounding moves its top-1 tokens is
# the model's, and these rows say how far).
# The micro-batch (UBATCH, 16) stays under the large-batch mark (32) on both sides: no offload in
# llama.cpp, the split path in the backend.
#
#   bench/gpu-backend-ppl.sh LLAMA_BIN MODEL [WORKDIR]
# LLAMA_BIN: a CUDA llama.cpp build with llama-perplexity. Environment: BACKEND (the library,
# built against LLAMA_BIN's source), POOL (60%), UBATCH (16), TOKENS (4096), THREADS (all cores),
# REFS ("static gpu vs-gpu"), LAYERS (the model's: 8).
set -euo pipefail
bin=$(realpath "${1:?usage: bench/gpu-backend-ppl.sh LLAMA_BIN MODEL [WORKDIR]}")
model=$(realpath "${2:?the model}")
work=${3:-/tmp/moecache-gpu-ppl}
backend=$(realpath "${BACKEND:?BACKEND: libmoecache-ggml.so}")
mkdir -p "$work"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python3 - "$work/text.txt" "${TOKENS:-4096}" <<'PY'
import random, sys
random.seed(11)
words = "the of and to in is was for on that with as by at from his her they this which or an be are".split()
open(sys.argv[1], "w").write(" ".join(random.choice(words) for _ in range(int(sys.argv[2]) * 2 // 5)))
PY
common=(-m "$model" -f "$work/text.txt" -ngl 99 -fa 0 -c 512 -b 512 -ub "${UBATCH:-16}" -t "${THREADS:-$(nproc)}")
"$bin/llama-perplexity" "${common[@]}" -ot exps=CPU --kl-divergence-base "$work/base.kld" >"$work/cpu.out" 2>"$work/cpu.err"
GGML_BACKEND_PATH="$backend" MOECACHE_GGML_POOL="${POOL:-60%}" MOECACHE_GGML_LOG=1 MOECACHE_GGML_PROFILE=off \
  "$bin/llama-perplexity" "${common[@]}" -ot exps=MOECACHE --kl-divergence-base "$work/base.kld" --kl-divergence \
  >"$work/mc.out" 2>"$work/mc.err"
pool=${POOL:-60%}
layers=${LAYERS:-8}
for ref in ${REFS:-static gpu vs-gpu}; do
  case $ref in
    static) k=$(( (layers * ${pool%\%} + 50) / 100 ))
      ot=(-ot "blk\.($(seq -s '|' $((layers - k)) $((layers - 1))))\.ffn_.*_exps=CUDA0,exps=CPU") ;;
    gpu) ot=() ;;
    vs-gpu)  # the backend against llama.cpp's own GPU kernels: every expert on the GPU saves the base
      "$bin/llama-perplexity" "${common[@]}" --kl-divergence-base "$work/gpu.kld" >"$work/gpu-base.out" 2>"$work/gpu-base.err" ||
        { echo "gpu-backend-ppl: the GPU base failed" >&2; continue; }
      GGML_BACKEND_PATH="$backend" MOECACHE_GGML_POOL="$pool" MOECACHE_GGML_PROFILE=off \
        "$bin/llama-perplexity" "${common[@]}" -ot exps=MOECACHE --kl-divergence-base "$work/gpu.kld" --kl-divergence \
        >"$work/ref-$ref.out" 2>"$work/ref-$ref.err" || echo "gpu-backend-ppl: $ref failed" >&2
      continue ;;
    *) echo "gpu-backend-ppl: unknown reference $ref" >&2; continue ;;
  esac
  "$bin/llama-perplexity" "${common[@]}" "${ot[@]}" --kl-divergence-base "$work/base.kld" --kl-divergence \
    >"$work/ref-$ref.out" 2>"$work/ref-$ref.err" || echo "gpu-backend-ppl: $ref failed" >&2
done
python3 - "$work" "${REFS:-static gpu vs-gpu}" <<'PY'
import re, sys
work = sys.argv[1]
def read(p): return open(f"{work}/{p}", errors="replace").read()
cpu, mc = read("cpu.out") + read("cpu.err"), read("mc.out") + read("mc.err")
p_cpu = re.search(r"Final estimate: PPL = ([\d.]+)", cpu)
p_mc = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", mc) or re.search(r"Final estimate: PPL = ([\d.]+)", mc)
top = re.search(r"Same top p\s*:\s*([\d.]+)", mc)
kld = re.search(r"Mean\s+KLD:\s*([\d.e+-]+)", mc)
rows = re.search(r"expert rows computed: ([\d.]+) % from the pool", mc)
print("| run | PPL | same top-1 % | mean KLD | rows from the pool % |\n|---|---|---|---|---|")
print(f"| -ot exps=CPU | {p_cpu.group(1) if p_cpu else '?'} | - | - | - |")
print(f"| -ot exps=MOECACHE | {p_mc.group(1) if p_mc else '?'} | {top.group(1) if top else '?'} | {kld.group(1) if kld else '?'} | {rows.group(1) if rows else '?'} |")
for ref in sys.argv[2].split():
    try: r = read(f"ref-{ref}.out") + read(f"ref-{ref}.err")
    except OSError: continue
    p = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", r)
    t = re.search(r"Same top p\s*:\s*([\d.]+)", r)
    k = re.search(r"Mean\s+KLD:\s*([\d.e+-]+)", r)
    name = {"static": "static split (the pool's bytes, last layers on CUDA0)", "gpu": "every expert on the GPU",
            "vs-gpu": "-ot exps=MOECACHE against every expert on the GPU (its base)"}.get(ref, ref)
    print(f"| {name} | {p.group(1) if p else '?'} | {t.group(1) if t else '?'} | {k.group(1) if k else '?'} | - |")
if p_cpu and p_mc:
    print(f"PPL ratio {float(p_mc.group(1)) / float(p_cpu.group(1)):.5f}")
PY
