#!/usr/bin/env bash
# A quick look at the backend route on the GPU machine, one configuration after another in one
# call, with the backend's own figures (where its computes' time went) beside llama-bench's:
#   cpu            -ot exps=CPU (mmap), llama.cpp's default offload threshold: the anchor
#   staticP-none   the last P % of the layers' experts on CUDA0, the rest as cpu, --load-mode none
#   staticP        the same with mmap
#   mcP            libmoecache-ggml.so (GGML_BACKEND_PATH, -ot exps=MOECACHE), a pool of P % of the
#                  experts; suffixes: -none (--load-mode none), -nopin (MOECACHE_GGML_PIN=off),
#                  -xN (MOECACHE_GGML_CROSS=N%), -thrN (MOECACHE_GGML_THREADS=N), -warm (a hot
#                  profile of its own, kept between calls on a warm machine: llama-bench's runs
#                  after the first start warm), e.g. mc60-none-x0, mc60-thr8
#   diag-mcP...    the same configuration through llama-completion, 24 greedy tokens with ggml's log
#                  shown (llama-bench hides it) and CUDA_LAUNCH_BLOCKING=1: what a CUDA error says
#                  and where; PROMPT_WORDS (10) words of prompt: 32 or more make its batches large
# The model is generated once (moecache-mkmodel: q5_K, 128 experts top-8, embd 2048, ff 1792, the
# deepseek-v4-flash routing preset, seed 29; LAYERS of them: 8 are 7.3 GiB, 32 are 29 GiB). PRESET,
# EXPERTS, USED, EMBD, FF and SEED change it; the real-like presets (mixtral-like, qwen3-next-like,
# deepseek-like: docs/routing.md) bring their own expert counts unless EXPERTS and USED are given.
#
#   bench/gpu-backend-probe.sh LLAMA_BIN          (ends with a summary: per configuration and test,
#                                                 the median of its runs and its ratio to cpu's)
# LLAMA_BIN: a CUDA llama.cpp build (bench/build-llama-cuda.sh) with llama-bench and
# llama-completion. Environment: CONFIGS ("cpu mc60 static60-none"), ARGS ("-p 512 -n 32": what
# llama-bench runs), REPS (2), LAYERS (8), PRESET, EXPERTS, USED, EMBD, FF, SEED (the model, above),
# TIMEOUT (seconds a configuration, 120), BACKEND (the library, built against LLAMA_BIN's source),
# MKMODEL, WORKDIR (/var/tmp/moecache-probe).
set -uo pipefail
bin=$(realpath "${1:?usage: bench/gpu-backend-probe.sh LLAMA_BIN}")
build=${MOECACHE_BUILD:-build}
backend=$(realpath "${BACKEND:-$build/backend/libmoecache-ggml.so}")
mkmodel=${MKMODEL:-$build/tools/mkmodel/moecache-mkmodel}
work=${WORKDIR:-/var/tmp/moecache-probe}
layers=${LAYERS:-8}
mkdir -p "$work"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
source "$(dirname "$0")/common.sh"
model_shape "$layers" "${SEED:-29}"
# The default shape keeps its old name (a warm machine's model is reused); any other is named by it.
tag=
[ "${shape[*]}" = "--layers $layers --embd 2048 --ff 1792 --preset deepseek-v4-flash --seed 29 --experts 128 --experts-used 8" ] ||
  tag=-$(echo "${shape[*]}" | tr -d ' -' | tr -c 'A-Za-z0-9.\n' _)
model=$work/probe-$layers$tag.gguf
if [ ! -f "$model" ]; then
  "$mkmodel" --output "$model" "${shape[@]}" --expert-type q5_K | tail -n 1
fi
echo "== model $(basename "$model"): $(( $(stat -c %s "$model") >> 20 )) MiB (${shape[*]})"
cat "$model" >/dev/null  # every configuration starts from the same warm page cache

# setup NAME: env_ (the environment), args_ (llama.cpp's arguments beyond the model's)
setup() {
  local c=${1#diag-} p
  env_=(MOECACHE_UNUSED=1)
  args_=(-ngl 99)
  case $c in
    cpu) args_+=(-ot exps=CPU) ;;
    static*) p=${c#static}; p=${p%%-*}
      local k=$(( (layers * p + 50) / 100 ))
      args_+=(-ot "blk\.($(seq -s '|' $((layers - k)) $((layers - 1))))\.ffn_.*_exps=CUDA0;exps=CPU")
      [[ $c == *-none* ]] && args_+=(--load-mode none) ;;
    mc*) p=${c#mc}; p=${p%%-*}
      # No hot profile (one configuration's would warm the next's pool), unless -warm: one of its own
      # that its first run leaves for the next.
      env_=(GGML_BACKEND_PATH="$backend" MOECACHE_GGML_POOL="$p%" MOECACHE_GGML_LOG=2 MOECACHE_GGML_CLIENT=off
            MOECACHE_GGML_PROFILE=off)
      [[ $c == *-warm* ]] && env_+=(MOECACHE_GGML_PROFILE="$work/profiles-$c")
      [[ $c == *-nopin* ]] && env_+=(MOECACHE_GGML_PIN=off)
      [[ $c =~ -x([0-9]+) ]] && env_+=(MOECACHE_GGML_CROSS="${BASH_REMATCH[1]}%")
      [[ $c =~ -thr([0-9]+) ]] && env_+=(MOECACHE_GGML_THREADS="${BASH_REMATCH[1]}")
      args_+=(-ot exps=MOECACHE)
      [[ $c == *-none* ]] && args_+=(--load-mode none) ;;
    *) echo "gpu-backend-probe: unknown configuration $1" >&2; return 1 ;;
  esac
  return 0
}
rows=$(mktemp /tmp/moecache-probe-rows.XXXXXX)
words=(the of and to in is was for on that)
prompt=
for ((i = 0; i < ${PROMPT_WORDS:-10}; ++i)); do prompt+="${words[i % 10]} "; done
for c in ${CONFIGS:-cpu mc60 static60-none}; do
  setup "$c" || continue
  echo "== $c"
  t0=$SECONDS
  if [[ $c == diag-* ]]; then
    # llama-completion takes one -ot whose overrides ',' joins.
    args=("${args_[@]}")
    for i in "${!args[@]}"; do args[$i]=${args[$i]//;/,}; done
    timeout "${TIMEOUT:-120}" env "${env_[@]}" CUDA_LAUNCH_BLOCKING=1 "$bin/llama-completion" -m "$model" "${args[@]}" \
      -fa off -p "$prompt" -n 24 --temp 0 --ignore-eos -no-cnv </dev/null 2>&1 |
      grep -E -i "error|abort|in function|moecache|eval time" | head -n 40
  else
    # ';' joins overrides in llama-bench's -ot (',' would make another test).
    timeout "${TIMEOUT:-120}" env "${env_[@]}" "$bin/llama-bench" -m "$model" "${args_[@]}" -fa 0 -r "${REPS:-2}" \
      ${ARGS:--p 512 -n 32} 2>&1 | grep -E "^\| [a-z]|moecache-ggml|error|abort" | grep -v "^| model\|no daemon" |
      tee >(awk -F'|' -v c="$c" '/^\| [a-z]/ { t = $(NF - 2); v = $(NF - 1); gsub(/ /, "", t); split(v, a, " ");
                                                 print c "\t" t "\t" a[1] }' >>"$rows")
  fi
  echo "   ($((SECONDS - t0)) s)"
done
# The runs' figures in one table (the tail of a long log keeps it): per configuration and test, the
# median of its runs (a configuration named more than once: each a run) and its ratio to cpu's.
sleep 1  # the last tee's reader
echo "== summary: tokens/s, medians over the runs of each configuration (x cpu: against cpu's median)"
sort -k1,1 -k2,2 "$rows" | awk -F'\t' '
  { key = $1 "\t" $2; n[key]++; v[key, n[key]] = $3; if (!(key in seen)) { seen[key] = 1; order[++k] = key } }
  END {
    for (i = 1; i <= k; i++) {
      key = order[i]; m = n[key]
      for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (v[key, b] < v[key, a]) { t = v[key, a]; v[key, a] = v[key, b]; v[key, b] = t }
      med[key] = m % 2 ? v[key, (m + 1) / 2] : (v[key, m / 2] + v[key, m / 2 + 1]) / 2
      runs[key] = ""; for (a = 1; a <= m; a++) runs[key] = runs[key] (a > 1 ? " / " : "") v[key, a]
    }
    for (i = 1; i <= k; i++) {
      key = order[i]; split(key, p, "\t"); c = "cpu\t" p[2]
      ratio = (c in med && med[c] > 0) ? sprintf("%.2fx", med[key] / med[c]) : "-"
      printf "  %-22s %-8s %9.1f  %6s   (%s)\n", p[1], p[2], med[key], ratio, runs[key]
    }
  }'
rm -f "$rows"
