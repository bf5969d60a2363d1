#!/bin/bash
# One call on the GPU machine (the device tool): bench/gpu-squeeze.sh over what the call carries, the
# results (every file of the work directory but the models) back in $OUT/gsq-ROUND.tgz.
#   bench/gpu-call.sh [CARRIED]     (CARRIED: third_party_local/gpu)
# CARRIED holds bundle/ (scripts/bundle.sh), dbus/dbus-daemon (with its libraries, an $ORIGIN rpath:
# the GPU machine has none) and llama.tar.xz (bench/build-llama-cuda.sh with PORTABLE=1 PACK=...),
# or instead llama-src.tar.xz (a llama.cpp source subset, llama-src/ inside): then llama-server is
# built there first (~4 min on 16 cores) and packed into $OUT/llama.tar.xz.part-* (15 MiB pieces:
# `cat` them into CARRIED/llama.tar.xz for the next calls).
# Environment: gpu-squeeze's; CALL_SECONDS (540, counted from the call's start, the build included):
# gpu-squeeze is stopped then, and the results still come back.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
g=$(realpath "${1:-$top/third_party_local/gpu}")
cd "$top"
w=/var/tmp/gsq
mkdir -p "$w"
echo "== machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, kernel $(uname -r)"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
df -h /var/tmp | tail -1
for d in /sys/block/*/queue/read_ahead_kb; do echo "$d $(cat "$d")"; done 2>/dev/null | head -4
chmod +x "$g"/bundle/bin/* "$g"/dbus/dbus-daemon 2>/dev/null
llama=/var/tmp/llama
if [ ! -x "$llama/bin/llama-server" ] && [ ! -f "$g/llama.tar.xz" ] && [ -f "$g/llama-src.tar.xz" ]; then
  t=$SECONDS
  xz -dc "$g/llama-src.tar.xz" | tar -x -C /var/tmp
  PACK=/var/tmp/llama.tar.xz bench/build-llama-cuda.sh /var/tmp/llama-src /var/tmp/llama-build llama-server || exit 2
  split -b 15M /var/tmp/llama.tar.xz "$OUT/llama.tar.xz.part-"
  echo "== llama-server built in $((SECONDS - t)) s"
  mkdir -p "$llama" && xz -dc /var/tmp/llama.tar.xz | tar -x -C "$llama"
fi
[ -x "$llama/bin/llama-server" ] || { mkdir -p "$llama" && xz -dc "$g/llama.tar.xz" | tar -x -C "$llama"; }
if [ ! -x "$llama/bin/llama-server" ]; then echo "no llama-server in $llama/bin"; exit 2; fi
# llama.cpp built elsewhere: its own libraries beside it, CUDA's from the machine's toolkit.
export LD_LIBRARY_PATH=$llama/bin:/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
"$llama/bin/llama-server" --version 2>&1 | tail -3
export BUNDLE=$g/bundle DBUS_DAEMON=$g/dbus/dbus-daemon
t0=$SECONDS
timeout -s INT "$(( ${CALL_SECONDS:-540} - SECONDS ))" bench/gpu-squeeze.sh "$llama/bin" "$w" 2>&1
echo "== gpu-squeeze took $((SECONDS - t0)) s"
tar czf "$OUT/gsq-${ROUND_FROM:-1}.tgz" -C "$w" --exclude='*.gguf' --exclude=bundle --exclude='*.sock' . 2>/dev/null
ls -la "$OUT"
