#!/usr/bin/env bash
# Builds the llama.cpp tools the GPU benchmarks run (llama-server, llama-bench, llama-completion)
# from a llama.cpp source tree, for CUDA (sm_90 by default: the H200), without the flash-attention
# kernels (the benchmarks run -fa off), into OUT/bin. Nothing of llama.cpp is kept in this
# repository: fetch a snapshot (e.g. unslothai/llama.cpp) and copy ggml, src, include, common,
# vendor, cmake, scripts, tools and CMakeLists.txt somewhere ignored. The server is built without
# its web UI (its assets come from npm or a download).
#
#   bench/build-llama-cuda.sh LLAMA_SRC OUT [TARGET...]
# Environment: CUDA_ARCH (90), JOBS (all cores). An OUT/bin that has the targets already is kept.
# PORTABLE=1 builds on another machine (this Debian one, no GPU: ~1.5 h on 2 cores, no device time)
# for the GPU machine: the CUDA and CPU backends as loadable libraries, the CPU one in every x86
# variant (the loader picks the best the machine has), an $ORIGIN rpath; PACK=FILE.tar.xz then packs
# the stripped bin/ (~30 MB with five CPU variants) for bench/gpu-call.sh to carry and unpack there.
set -euo pipefail
src=$(realpath "${1:?usage: bench/build-llama-cuda.sh LLAMA_SRC OUT [TARGET...]}")
out=${2:?usage: bench/build-llama-cuda.sh LLAMA_SRC OUT [TARGET...]}
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(llama-server llama-bench llama-completion)
have=1
for t in "${targets[@]}"; do [ -x "$out/bin/$t" ] || have=0; done
[ $have = 1 ] && { echo "build-llama-cuda: $out/bin has ${targets[*]}"; exit 0; }
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
portable=()
variants=()
if [ "${PORTABLE:-0}" = 1 ]; then
  portable=(-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON "-DCMAKE_BUILD_RPATH=\$ORIGIN")
  variants=(ggml-cuda)
fi
cmake -S "$src" -B "$out" "${gen[@]}" "${portable[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DCMAKE_CUDA_COMPILER="$nvcc" -DGGML_CUDA_FA=OFF \
  -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  > "$out.configure.log" 2>&1 ||
  { tail -20 "$out.configure.log"; exit 1; }
cmake --build "$out" -j "${JOBS:-$(nproc)}" --target "${targets[@]}" "${variants[@]}" > "$out.build.log" 2>&1 ||
  { grep -m5 -i error "$out.build.log"; tail -5 "$out.build.log"; exit 1; }
echo "build-llama-cuda: built ${targets[*]} in $out/bin"
if [ -n "${PACK:-}" ]; then
  stage=$(mktemp -d)
  mkdir "$stage/bin"
  for t in "${targets[@]}"; do cp "$out/bin/$t" "$stage/bin/"; done
  # Each library under the name the others ask for (its soname), not its versioned file name.
  for f in "$out"/bin/*.so "$out"/bin/*.so.0; do
    [ -e "$f" ] || continue
    n=$(basename "$f")
    { [ -L "$f" ] && [[ $n != *.so.0 ]]; } && continue
    cp -L "$f" "$stage/bin/$n"
  done
  gomp=$(ldconfig -p | awk '/libgomp.so.1 / {print $NF; exit}')
  [ -n "$gomp" ] && cp -L "$gomp" "$stage/bin/"  # the CPU backends' OpenMP, where the target lacks it
  strip --strip-unneeded "$stage"/bin/* 2>/dev/null || true
  tar -C "$stage" -cf - bin | xz -T0 -6 > "$PACK"
  rm -rf "$stage"
  echo "build-llama-cuda: packed into $PACK ($(du -h "$PACK" | cut -f1))"
fi
