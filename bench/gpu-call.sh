#!/bin/bash
# One call on the GPU machine (the device tool): the GPU benchmarks over what the call carries, the
# results (every file of the work directories but the models) back in $OUT/gpu-STEPS.tgz.
#   bench/gpu-call.sh [CARRIED]     (CARRIED: third_party_local/gpu)
# CARRIED holds bundle/ (scripts/bundle.sh), dbus/dbus-daemon (with its libraries, an $ORIGIN rpath:
# the GPU machine has none) and llama.tar.xz (bench/build-llama-cuda.sh with PORTABLE=1 PACK=...),
# or instead llama-src.tar.xz (a llama.cpp source subset, llama-src/ inside): then llama-server,
# llama-bench and llama-completion are built there first (~4 min on 16 cores) and packed into
# $OUT/llama.tar.xz.part-* (15 MiB pieces: `cat` them into CARRIED/llama.tar.xz for the next calls);
# LLAMA_TARGETS names others (llama-server llama-bench llama-completion llama-perplexity).
# A machine kept warm between calls keeps the build and the models (/var/tmp).
# Environment: STEPS (squeeze): what to run, in order, each a benchmark of bench/ with its own
# environment: squeeze (gpu-squeeze.sh), serve (gpu-serve.sh), soak (gpu-soak.sh), probe
# (gpu-backend-probe.sh, the backend and mkmodel from CARRIED's bundle), each also with a
# suffix (soak-old: another soak, its own work directory); a step's variables may be given as
# STEP_VAR (SERVE_CONFIGS=..., SOAK_OLD_HOOK=...), which override VAR for it.
# CALL_SECONDS (540, counted from the call's start, the build included): the step under way is
# stopped then, and the results still come back.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
g=$(realpath "${1:-$top/third_party_local/gpu}")
cd "$top"
echo "== machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, kernel $(uname -r)"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
df -h /var/tmp | tail -1
chmod +x "$g"/bundle/bin/* "$g"/dbus/dbus-daemon 2>/dev/null
llama=/var/tmp/llama
if [ ! -x "$llama/bin/llama-bench" ] && [ ! -f "$g/llama.tar.xz" ] && [ -f "$g/llama-src.tar.xz" ]; then
  t=$SECONDS
  [ -d /var/tmp/llama-src ] || xz -dc "$g/llama-src.tar.xz" | tar -x -C /var/tmp
  # shellcheck disable=SC2086
  PACK=/var/tmp/llama.tar.xz bench/build-llama-cuda.sh /var/tmp/llama-src /var/tmp/llama-build ${LLAMA_TARGETS:-} || exit 2
  split -b 15M /var/tmp/llama.tar.xz "$OUT/llama.tar.xz.part-"
  echo "== llama.cpp built in $((SECONDS - t)) s"
  mkdir -p "$llama" && xz -dc /var/tmp/llama.tar.xz | tar -x -C "$llama"
fi
[ -x "$llama/bin/llama-bench" ] || { mkdir -p "$llama" && xz -dc "$g/llama.tar.xz" | tar -x -C "$llama"; }
if [ ! -x "$llama/bin/llama-server" ]; then echo "no llama.cpp tools in $llama/bin"; exit 2; fi
# llama.cpp built elsewhere: its own libraries beside it, CUDA's from the machine's toolkit.
export LD_LIBRARY_PATH=$llama/bin:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
"$llama/bin/llama-server" --version 2>&1 | tail -2
export BUNDLE=$g/bundle DBUS_DAEMON=$g/dbus/dbus-daemon
steps=(${STEPS:-squeeze})
dirs=()
for step in "${steps[@]}"; do
  left=$(( ${CALL_SECONDS:-540} - SECONDS ))
  [ "$left" -gt 20 ] || { echo "== $step: not run, the call's time is spent"; continue; }
  # STEP_VAR overrides VAR for this step.
  prefix=$(echo "$step" | tr '[:lower:]-' '[:upper:]_')_
  overrides=()
  while IFS='=' read -r k v; do overrides+=("${k#"$prefix"}=$v"); done < <(env | grep "^$prefix" || true)
  t0=$SECONDS
  case $step in
    squeeze*) w=/var/tmp/gsq; cmd=(bench/gpu-squeeze.sh "$llama/bin" "$w") ;;
    serve*) w=/var/tmp/gsv-$step; cmd=(bench/gpu-serve.sh "$llama/bin" "$w") ;;
    soak*) w=/var/tmp/gsk-$step; cmd=(bench/gpu-soak.sh "$llama/bin" "$w") ;;
    probe*) w=/var/tmp/gpr-$step
      cmd=(env WORKDIR="$w" BACKEND="$g/bundle/lib/libmoecache-ggml.so" MKMODEL="$g/bundle/bin/moecache-mkmodel"
        bench/gpu-backend-probe.sh "$llama/bin") ;;
    *) echo "== $step: unknown step"; continue ;;
  esac
  dirs+=("$w")
  echo "== $step (${overrides[*]})"
  env "${overrides[@]}" timeout -s INT "$left" "${cmd[@]}" 2>&1
  echo "== $step took $((SECONDS - t0)) s"
done
name=$(IFS=-; echo "${steps[*]}")
tar czf "$OUT/gpu-$name.tgz" --exclude='*.gguf' --exclude=bundle --exclude='*.sock' "${dirs[@]}" 2>/dev/null
ls -la "$OUT"
