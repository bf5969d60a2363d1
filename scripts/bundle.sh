#!/usr/bin/env bash
# A relocatable moecache: bin/ and lib/ that run from any directory on a Linux machine with glibc
# 2.36 or later and a C++ runtime of GCC 12 or later, without libbpf, liburing, libnuma,
# sdbus-c++, fmt or toml++ installed (Ubuntu 24.04, Fedora, Arch, a container). Every shared
# library the programs need, but glibc's own, libstdc++, libgcc_s and the base system's libsystemd
# and compression libraries, is copied into lib/; the programs find them through an $ORIGIN rpath
# (no LD_LIBRARY_PATH).
#
#   scripts/bundle.sh OUT_DIR [BUILD_DIR]     (BUILD_DIR: build, made by scripts/test.sh or cmake)
#   scripts/bundle.sh FILE.tar.gz [BUILD_DIR] the release tarball: moecache-VERSION-ARCH/ inside
#
#   OUT_DIR/bin/      moecached moecachectl moecache-mkmodel moecache-client-demo
#   OUT_DIR/lib/      libmoecache-client.so libmoecache-cuda.so libmoecache-rearm.so + dependencies
#   OUT_DIR/lib/moecache/libmoecache-dbus.so  the daemon's D-Bus API (loaded when a bus is set)
#   OUT_DIR/share/moecache/moecached.toml   the configuration reference
#   OUT_DIR/MANIFEST  what is where, and what each program links
set -euo pipefail
out=${1:?usage: scripts/bundle.sh OUT_DIR|FILE.tar.gz [BUILD_DIR]}
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ $out == *.tar.gz ]]; then
  version=$(sed -n 's/^project(moecache VERSION \([0-9.]*\).*/\1/p' "$top/CMakeLists.txt")
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  dir=moecache-$version-$(uname -m)
  "$0" "$stage/$dir" "${2:-$top/build}" >/dev/null
  tar -C "$stage" --owner=0 --group=0 --numeric-owner -czf "$out" "$dir"
  echo "bundle: $out ($(du -h "$out" | cut -f1)): unpack anywhere, run $dir/bin/moecached"
  exit 0
fi
build=${2:-$top/build}
command -v patchelf >/dev/null || { echo "bundle: patchelf is missing (scripts/setup/install-deps.sh installs it)" >&2; exit 1; }

programs=(daemon/moecached ctl/moecachectl tools/mkmodel/moecache-mkmodel tools/client-demo/moecache-client-demo)
libraries=(client/libmoecache-client.so cuda-hooks/libmoecache-cuda.so client/libmoecache-rearm.so)
# A build configured with -DMOECACHE_CUDA_HOOK=OFF has no hook: the bundle goes without it.
if [ ! -f "$build/cuda-hooks/libmoecache-cuda.so" ] && grep -q '^MOECACHE_CUDA_HOOK:BOOL=OFF' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "bundle: a build without the CUDA hook (MOECACHE_CUDA_HOOK=OFF): none in the bundle" >&2
  libraries=(client/libmoecache-client.so client/libmoecache-rearm.so)
fi
for f in "${programs[@]}" "${libraries[@]}"; do
  [ -f "$build/$f" ] || { echo "bundle: $build/$f is missing: build first (cmake --build $build)" >&2; exit 1; }
done

# The C library and the compiler's runtime stay the system's: they are on every machine, and a
# copy of glibc's pieces would not match the system's dynamic loader. So do libsystemd (for the
# D-Bus module and moecachectl) and the compression and crypto libraries it and libelf load: every
# distribution's base system has them, and the system's copies get its security updates, where a
# frozen copy found through $ORIGIN would not. A machine without libsystemd runs the daemon
# without its D-Bus API, which it says.
base='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s)\.so'
system='^(libsystemd|libz|libzstd|liblzma|liblz4|libgcrypt|libgpg-error|libcap)\.so'

[ -f "$build/lib/moecache/libmoecache-dbus.so" ] ||
  { echo "bundle: $build/lib/moecache/libmoecache-dbus.so is missing: build first (cmake --build $build)" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib/moecache" "$out/share/moecache"
for f in "${programs[@]}"; do install -m 0755 "$build/$f" "$out/bin/"; done
# The daemon's D-Bus API, loaded from lib/moecache/ beside bin/ when a bus is configured.
install -m 0755 "$build/lib/moecache/libmoecache-dbus.so" "$out/lib/moecache/"
for f in "${libraries[@]}"; do
  # A library with a SONAME (libmoecache-client.so.1) goes in under it, with the plain name beside.
  name=$(basename "$f")
  soname=$(patchelf --print-soname "$build/$f" 2>/dev/null || true)
  if [ -n "$soname" ] && [ "$soname" != "$name" ]; then
    install -m 0755 "$build/$f" "$out/lib/$soname"
    ln -s "$soname" "$out/lib/$name"
  else
    install -m 0755 "$build/$f" "$out/lib/"
  fi
done

# Every library the programs and libraries load, transitively (ldd resolves the whole closure).
declare -A carried=() from_system=()
for f in "$out"/bin/* "$out"/lib/libmoecache-*.so "$out"/lib/moecache/*.so; do
  while read -r name _ path _; do
    [[ $name =~ $base ]] && continue
    [[ $name =~ $system ]] && { from_system[$name]=1; continue; }
    [ -n "${path:-}" ] && [ -f "$path" ] || continue
    [[ $name == libmoecache-* ]] && continue
    carried[$name]=$path
  done < <(ldd "$f" | grep '=>')
done
for name in "${!carried[@]}"; do cp -L "${carried[$name]}" "$out/lib/$name"; chmod 0644 "$out/lib/$name"; done

strip --strip-unneeded "$out"/bin/* "$out"/lib/*.so* "$out"/lib/moecache/*.so 2>/dev/null || true
for f in "$out"/bin/*; do patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
for f in "$out"/lib/*.so*; do patchelf --set-rpath '$ORIGIN' "$f"; done
for f in "$out"/lib/moecache/*.so; do patchelf --set-rpath '$ORIGIN/..' "$f"; done
install -m 0644 "$top/config/moecached.toml" "$out/share/moecache/moecached.toml"

{
  echo "moecache $(sed -n 's/^project(moecache VERSION \([0-9.]*\).*/\1/p' "$top/CMakeLists.txt"), bundled $(date -u +%Y-%m-%d)"
  echo "needs: Linux, glibc >= $(ldd --version | head -1 | awk '{print $NF}'), libstdc++ of GCC >= $(gcc -dumpversion)"
  echo
  for f in "$out"/bin/* "$out"/lib/libmoecache-*.so "$out"/lib/moecache/*.so; do
    echo "${f#$out/}: $(patchelf --print-needed "$f" | paste -sd' ' -)"
  done
  echo
  echo "carried in lib/: $(ls "$out/lib" | grep -v -e '^libmoecache-' -e '^moecache$' | paste -sd' ' -)"
  echo "from the system: $(printf '%s\n' "${!from_system[@]}" | sort | paste -sd' ' -)"
  echo
  # Why each carried library is carried, and what input it reads: none parses data from a network,
  # so none waits for a distribution's security updates the way libssl or libsystemd would.
  echo "why each is carried (Debian 12's build; update the bundle with moecache's releases):"
  for name in $(ls "$out/lib" | grep -v -e '^libmoecache-' -e '^moecache$'); do
    case $name in
      libbpf.so*) why="loads the daemon's own eBPF programs (page-cache telemetry): input is built into moecached" ;;
      libelf.so*) why="libbpf's ELF reader, for those programs only" ;;
      liburing.so*) why="io_uring for prefetch reads: no parsing" ;;
      libnuma.so*) why="NUMA placement of prefetch reads: reads sysfs" ;;
      libfmt.so*) why="text formatting: no input" ;;
      libtomlplusplus.so*) why="parses moecached.toml, a root-owned file" ;;
      libsdbus-c++.so*) why="D-Bus bindings (the daemon's module, moecachectl) over the system's libsystemd, which reads the bus: a fix in it needs a new bundle" ;;
      *) why="needed by the programs above" ;;
    esac
    echo "  $name: $why"
  done
} > "$out/MANIFEST"
echo "bundle: $out ($(du -sh "$out" | cut -f1)): $(ls "$out/bin" | paste -sd' ' -); $(ls "$out/lib" | grep -vc "^moecache$") libraries"
