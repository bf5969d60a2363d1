#!/usr/bin/env bash
# The CUDA hook under real serving (GPU machine): stock CUDA llama.cpp on a generated MoE model of
# the bench/cuda-pool.sh shape (19.3 GiB q8_0, DeepSeek-V4-Flash routing skew), as users run it:
#   pg     llama-bench -pg 512,128: a prompt and then decode, in one context
#   sep    llama-bench -p 512 -n 128: the prompt test and the generation test in separate contexts
#   compl  llama-completion: a prompt of PROMPT_TOKENS (3072) tokens, then 128 greedy tokens
#   tg     llama-bench -p 0 -n 64 -r 1: decoding alone (with GPU_TRACE, each run's GPU timeline:
#          libmoecache-gputrace.so loaded by the driver, summarized by bench/gpu-timeline.py)
# against what users have today, in the same run:
#   limit       every expert in VRAM (-ngl 99, nothing on the CPU): the ceiling
#   cpu         -ot exps=CPU at llama.cpp's default offload threshold: the anchor (ratios are to it)
#   cpu-none    the same with --load-mode none: llama.cpp reads the experts into its own pinned
#               host buffers (what its loader advises), where RAM holds the model
#   staticP     the same VRAM bytes as a pool of P % spent statically: the last P % of the layers'
#               experts on the GPU that runs those layers, the rest as cpu (static: P = 25);
#               staticP-none with --load-mode none; static-mb1 static25 with
#               GGML_OP_OFFLOAD_MIN_BATCH=1 (the recipe's form)
#   recipe      the unified-memory recipe of DESIGN.md: GGML_OP_OFFLOAD_MIN_BATCH=1, experts in
#               pageable host memory, every token's expert math on the GPU
#   hookP-MODE  the recipe with libmoecache-cuda.so preloaded: a pool of P % of the experts of the
#               layers each GPU serves, misses copied with MOECACHE_CUDA_PIN=MODE (off, auto, register,
#               all, staging; default: the hook's default); hookP-MODE-b the same with HOOK_B, another
#               build of the hook (an A/B). Each run starts without a hot profile (a first run);
#               hookP-MODE-warm keeps the profile its previous runs saved (a restart), after one run
#               of `llama-bench -p 0 -n 128` that is not counted; hookP-MODE-noahead without copies
#               ahead (MOECACHE_CUDA_AHEAD=off: each pool hit its own launch, as before them)
#   mcP         the ggml backend route: libmoecache-ggml.so loaded (GGML_BACKEND_PATH) and given the
#               experts (-ot exps=MOECACHE), a pool of P % of them on the GPU; pooled experts are
#               computed there, the rest on the CPU at once (BACKEND: the library; it must be built
#               against this llama.cpp's source)
# Rounds interleaved; medians; greedy text of every hook configuration compared with the recipe's
# (the same computation without the hook: it must be byte-identical).
#
#   bench/gpu-serve.sh LLAMA_BIN [WORKDIR]
# LLAMA_BIN: a folder with llama-bench and llama-completion of a CUDA build (and its libraries).
# Environment: CONFIGS, WORKLOADS (pg sep compl), ROUNDS (2), THREADS (all cores), PROMPT_TOKENS,
# MOECACHE_BUILD (build: the hook and moecache-mkmodel) or BUNDLE (scripts/bundle.sh's), HOOK (the hook's path), HOOK_B, MKMODEL,
# BACKEND (libmoecache-ggml.so, for mcP),
# MODEL (a model to use as it is), else LAYERS EXPERTS USED EMBD FF TYPE SEED (the shape generated),
# DEADLINE (seconds: no run starts after it; the table is still printed), GPU_TRACE
# (libmoecache-gputrace.so: the tg runs' timelines, RUN.trace, and their summary after the table).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=$(realpath "${1:?usage: bench/gpu-serve.sh LLAMA_BIN [WORKDIR]}")
work=${2:-/tmp/moecache-gpu-serve}
build=${MOECACHE_BUILD:-build}
if [ -n "${BUNDLE:-}" ]; then  # a scripts/bundle.sh directory (bench/gpu-call.sh sets it)
  hook=$(realpath "${HOOK:-$BUNDLE/lib/libmoecache-cuda.so}")
  backend=${BACKEND:-$BUNDLE/lib/libmoecache-ggml.so}
  mkmodel=${MKMODEL:-$BUNDLE/bin/moecache-mkmodel}
else
  hook=$(realpath "${HOOK:-$build/cuda-hooks/libmoecache-cuda.so}")
  backend=${BACKEND:-$build/backend/libmoecache-ggml.so}
  mkmodel=${MKMODEL:-$build/tools/mkmodel/moecache-mkmodel}
fi
rounds=${ROUNDS:-2}
threads=${THREADS:-$(nproc)}
prompt_tokens=${PROMPT_TOKENS:-3072}
layers=${LAYERS:-32}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then  # the GPUs llama.cpp sees
  IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
  gpus=$(( ${#visible[@]} < gpus ? ${#visible[@]} : gpus ))
fi
[ "$gpus" -ge 1 ] || { echo "gpu-serve: no GPU (nvidia-smi -L lists none)" >&2; exit 2; }
configs=(${CONFIGS:-limit cpu cpu-none static25 static25-none recipe hook10-auto hook25-off hook25-auto hook25-all hook50-auto})
workloads=(${WORKLOADS:-pg sep compl})
mkdir -p "$work"
model=${MODEL:-$work/serve-${layers}${TYPE:+-$TYPE}${SEED:+-s$SEED}.gguf}
if [ ! -f "$model" ]; then
  "$mkmodel" --output "$model" --layers "$layers" --experts "${EXPERTS:-128}" --experts-used "${USED:-8}" \
    --embd "${EMBD:-2048}" --ff "${FF:-768}" --preset deepseek-v4-flash ${TYPE:+--expert-type "$TYPE"} ${SEED:+--seed "$SEED"} >/dev/null
fi
# Its layers (a MODEL given may have another shape): the static splits count them.
layers=$(python3 "$here/gguf_blocks.py" "$model")
cat "$model" >/dev/null  # in the page cache: every configuration starts from the same warm cache
# A prompt of ordinary words: the generated model's tokenizer makes about 2.5 tokens of each.
python3 - "$work/prompt.txt" "$prompt_tokens" <<'EOF'
import random, sys
random.seed(7)
words = "the of and to in is was for on that with as by at from his her they this which or an be are".split()
open(sys.argv[1], "w").write(" ".join(random.choice(words) for _ in range(int(sys.argv[2]) * 2 // 5)))
EOF

# The last P % of the layers' experts on the GPU that runs those layers: as many bytes as a pool of P %.
static_ot() {
  local n=$(( (layers * $1 + 50) / 100 )) last=$((layers - 1))
  echo "blk\.($(seq -s '|' $((layers - n)) "$last"))\.ffn_.*_exps\.=CUDA$((gpus - 1))"
}
# setup NAME: the environment (env_), tensor overrides (ot_) and load mode (lm_) of a configuration.
setup() {
  env_=(MOECACHE_UNUSED=1)
  ot_=(exps=CPU)
  lm_=()
  local c=$1
  warm_=0
  if [[ $c == *-warm ]]; then warm_=1; c=${c%-warm}; fi
  if [[ $c == *-none ]]; then lm_=(none); c=${c%-none}; fi
  local ahead=on
  if [[ $c == *-noahead ]]; then ahead=off; c=${c%-noahead}; fi
  case $c in
    limit) ot_=() ;;
    cpu) ;;
    static) ot_=("$(static_ot 25)" exps=CPU) ;;
    static[0-9]*) ot_=("$(static_ot "${c#static}")" exps=CPU) ;;
    static-mb1) ot_=("$(static_ot 25)" exps=CPU); env_=(GGML_OP_OFFLOAD_MIN_BATCH=1) ;;
    recipe) env_=(GGML_OP_OFFLOAD_MIN_BATCH=1) ;;
    hook*-*) local p=${c#hook} lib=$hook mode
      [[ $p == *-b ]] && { lib=$(realpath "${HOOK_B:?hook B: HOOK_B=PATH}"); p=${p%-b}; }
      mode=${p#*-}; p=${p%%-*}
      env_=(LD_PRELOAD="$lib" GGML_OP_OFFLOAD_MIN_BATCH=1 MOECACHE_CUDA_POOL="$p%" MOECACHE_CUDA_LOG=1 MOECACHE_CUDA_CLIENT=off
            MOECACHE_CUDA_PROFILE="$work/profiles/$1")
      [ "$mode" = default ] || env_+=(MOECACHE_CUDA_PIN="$mode")
      [ "$ahead" = on ] || env_+=(MOECACHE_CUDA_AHEAD=off) ;;
    mc[0-9]*) ot_=(exps=MOECACHE)
      env_=(GGML_BACKEND_PATH="$(realpath "$backend")" MOECACHE_GGML_POOL="${c#mc}%" MOECACHE_GGML_LOG=1
            MOECACHE_GGML_PROFILE="$work/profiles/$1") ;;
    *) echo "gpu-serve: unknown configuration $1" >&2; exit 2 ;;
  esac
}
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
run() {  # run CONFIG WORKLOAD ROUND
  local c=$1 w=$2 r=$3 out=$work/$1.$2.$3
  setup "$c"
  # llama-bench takes one -ot whose ';' joins overrides (',' makes another test); llama-completion ','.
  local bench_ot=() compl_ot=()
  if [ ${#ot_[@]} -gt 0 ]; then
    bench_ot=(-ot "$(IFS=';'; echo "${ot_[*]}")")
    compl_ot=(-ot "$(IFS=','; echo "${ot_[*]}")")
  fi
  local lm=()
  [ ${#lm_[@]} -gt 0 ] && lm=(--load-mode "${lm_[0]}")
  if [[ $c == hook* ]]; then
    if [ "$warm_" = 0 ]; then
      rm -rf "$work/profiles/$c"
    elif [ ! -d "$work/profiles/$c" ]; then  # the run before the restart
      env "${env_[@]}" "$bin/llama-bench" -m "$model" -ngl 99 "${bench_ot[@]}" "${lm[@]}" -fa 0 -t "$threads" -p 0 -n 128 -r 1 \
        >"$out.prime.out" 2>"$out.prime.err" || echo "gpu-serve: $c: the run before the restart failed" >&2
    fi
  fi
  local trace=()
  [ "$w" = tg ] && [ -n "${GPU_TRACE:-}" ] && trace=(CUDA_INJECTION64_PATH="$(realpath "$GPU_TRACE")" MOECACHE_GPU_TRACE="$out.trace")
  case $w in
    tg) env "${env_[@]}" "${trace[@]}" "$bin/llama-bench" -m "$model" -ngl 99 "${bench_ot[@]}" "${lm[@]}" -fa 0 -t "$threads" -p 0 -n 64 -r 1 -o jsonl ;;
    pg) env "${env_[@]}" "$bin/llama-bench" -m "$model" -ngl 99 "${bench_ot[@]}" "${lm[@]}" -fa 0 -t "$threads" -p 0 -n 0 -pg 512,128 -r 2 -o jsonl ;;
    sep) env "${env_[@]}" "$bin/llama-bench" -m "$model" -ngl 99 "${bench_ot[@]}" "${lm[@]}" -fa 0 -t "$threads" -p 512 -n 128 -r 2 -o jsonl ;;
    compl) env "${env_[@]}" "$bin/llama-completion" -m "$model" -ngl 99 "${compl_ot[@]}" "${lm[@]}" -fa off -t "$threads" -c $((prompt_tokens * 2 + 512)) \
             -f "$work/prompt.txt" -n 128 --temp 0 --ignore-eos -no-cnv --no-display-prompt --seed 1 </dev/null ;;
  esac >"$out.out" 2>"$out.err" || echo "gpu-serve: $c $w round $r failed: $(grep -m1 -i 'error' "$out.err" || tail -n 3 "$out.err")" >&2
}
start=$SECONDS
for r in $(seq "$rounds"); do
  for w in "${workloads[@]}"; do
    for c in "${configs[@]}"; do
      if [ -n "${DEADLINE:-}" ] && [ $(( SECONDS - start )) -ge "$DEADLINE" ]; then
        echo "gpu-serve: deadline: $c $w round $r not run" >&2
        continue
      fi
      run "$c" "$w" "$r"
    done
  done
done

python3 - "$work" "$rounds" "$gpus" "${configs[*]}" "${workloads[*]}" <<'EOF'
import json, os, re, statistics, sys
work, rounds, gpus, configs, workloads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(), sys.argv[5].split()
def med(xs): return statistics.median(xs) if xs else float("nan")
def read(path):
    try: return open(path, errors="replace").read()
    except OSError: return ""
rows = {}
for c in configs:
    for w in workloads:
        for r in range(1, rounds + 1):
            out, err = read(f"{work}/{c}.{w}.{r}.out"), read(f"{work}/{c}.{w}.{r}.err")
            got = rows.setdefault((c, w), {})
            if w in ("pg", "sep", "tg"):
                for line in out.splitlines():
                    try: j = json.loads(line)
                    except ValueError: continue
                    key = "pg" if j["n_prompt"] and j["n_gen"] else ("pp" if j["n_prompt"] else "tg")
                    got.setdefault(key, []).append(j["avg_ts"])
            else:
                m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", err)
                e = re.search(r"\n[^\n]*\beval time =\s*([\d.]+) ms /\s*(\d+) runs", err)
                if m: got.setdefault("pp", []).append(int(m.group(2)) / float(m.group(1)) * 1000); got["prompt_tokens"] = int(m.group(2))
                if e: got.setdefault("tg", []).append(int(e.group(2)) / float(e.group(1)) * 1000)
                got.setdefault("text", []).append(out)
            h = re.search(r"slices (\d+) hit / (\d+) missed; ([\d.]+) GiB from the pool, ([\d.]+) GiB from the host", err)
            if h:
                hits, miss = int(h.group(1)), int(h.group(2))
                got.setdefault("hit", []).append(100.0 * hits / max(hits + miss, 1))
                got.setdefault("host_gib", []).append(float(h.group(4)))
            b = re.findall(r"expert rows computed: ([\d.]+) % from the pool", err)
            if b: got.setdefault("hit", []).append(float(b[-1]))
            u = re.search(r"in the hook for expert copies \(([\d.]+) us each\)", err)
            if u: got.setdefault("us", []).append(float(u.group(1)))
            a = re.search(r"copies ahead: (\d+) slices queued [^,]*, (\d+) of them not asked for", err)
            if a:
                got.setdefault("ahead", []).append(int(a.group(1)))
                got.setdefault("unclaimed", []).append(int(a.group(2)))
            d = re.findall(r"in decode steps (\d+) / (\d+)", err)
            if d:
                dh, dm = sum(int(a) for a, _ in d), sum(int(b) for _, b in d)
                got.setdefault("dhit", []).append(100.0 * dh / max(dh + dm, 1))
def val(c, w, k):
    return med(rows.get((c, w), {}).get(k, []))
print(f"\n{gpus} GPU(s); medians of {rounds} round(s); tok/s, and the ratio to cpu (-ot exps=CPU, default threshold)")
cols = [("pg", "pg"), ("sep", "pp"), ("sep", "tg"), ("tg", "tg"), ("compl", "pp"), ("compl", "tg")]
cols = [x for x in cols if x[0] in workloads]
head = "| config | " + " | ".join(f"{w} {k}" for w, k in cols) + " | hit % sep | hit % compl | decode hit % sep / compl | host MiB/token compl | greedy text = recipe |"
print(head); print("|" + "---|" * (head.count("|") - 1))
for c in configs:
    cells = []
    for w, k in cols:
        v, a = val(c, w, k), val("cpu", w, k)
        cells.append(f"{v:.1f} ({v / a:.2f}x)" if a == a and a > 0 and v == v else f"{v:.1f}")
    text = rows.get((c, "compl"), {}).get("text", [])
    # The recipe's text, from this run or an earlier one into the same folder (CONFIGS=recipe WORKLOADS=compl).
    ref = [read(f"{work}/recipe.compl.{r}.out") for r in range(1, 10) if read(f"{work}/recipe.compl.{r}.out")]
    same = "-" if not c.startswith("hook") or not text or not ref else ("yes" if all(t == ref[0] and t for t in text) else "NO")
    g = rows.get((c, "compl"), {})
    tokens = g.get("prompt_tokens", 0) + 128
    host = med(g.get("host_gib", []))
    hit = lambda w: f"{val(c, w, 'hit'):.1f}" if val(c, w, 'hit') == val(c, w, 'hit') else "-"
    dhit = lambda w: f"{val(c, w, 'dhit'):.1f}" if val(c, w, 'dhit') == val(c, w, 'dhit') else "-"
    print(f"| {c} | " + " | ".join(cells) + f" | {hit('sep')} | {hit('compl')} | {dhit('sep')} / {dhit('compl')} | " +
          (f"{host * 1024 / tokens:.1f}" if host == host and tokens else "-") + f" | {same} |")
if "compl" in workloads:
    print(f"(compl: prompt of {rows.get(('cpu', 'compl'), {}).get('prompt_tokens', '?')} tokens)")
hooks = [c for c in configs if c.startswith("hook")]
if hooks:
    print("\nThe hook's own time (its exit summary, MOECACHE_CUDA_LOG=1), medians over its runs:")
    print("| config | workload | hook us per expert copy | slices copied ahead | of them not asked for |")
    print("|---|---|---|---|---|")
    for c in hooks:
        for w in workloads:
            g = rows.get((c, w), {})
            f = lambda k, fmt: fmt.format(med(g[k])) if g.get(k) else "-"
            print(f"| {c} | {w} | {f('us', '{:.2f}')} | {f('ahead', '{:.0f}')} | {f('unclaimed', '{:.0f}')} |")
EOF
if [ -n "${GPU_TRACE:-}" ] && compgen -G "$work/*.tg.*.trace" >/dev/null; then
  echo
  echo "Decoding on the GPU, a token (bench/gpu-timeline.py over the tg runs' timelines; $layers MoE layers):"
  python3 "$here/gpu-timeline.py" --layers "$layers" "$work"/*.tg.*.trace || true
fi
