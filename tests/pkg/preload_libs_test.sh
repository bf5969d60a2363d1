#!/usr/bin/env bash
# The libraries moecache puts into other programs (the CUDA hook, lazy load, the route probe, by
# LD_PRELOAD) and libmoecache-client.so carry what they need: their NEEDED entries name only the C
# library and the compiler's runtime, they export nothing of fmt, and each loads into a minimal
# process in a mount namespace where every system copy of moecache's dependencies (fmt, liburing,
# libbpf, libnuma, sdbus-c++, toml++) is hidden. What ollama's runner or an Ubuntu CUDA image is.
# Usage: preload_libs_test.sh BUILD_DIR      exit 77: skipped (not root, no unshare)
set -euo pipefail
build=${1:?usage: preload_libs_test.sh BUILD_DIR}
fail() { echo "FAIL: $*"; exit 1; }

libs=()
for f in cuda-hooks/libmoecache-cuda.so client/libmoecache-rearm.so tools/routeprobe/libmoecache-routeprobe.so \
         client/libmoecache-client.so; do
  [ -e "$build/$f" ] && libs+=("$(readlink -f "$build/$f")")
done
[ ${#libs[@]} -ge 2 ] || fail "no preload libraries in $build"
allowed='^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64|ld-linux-aarch64)\.so'
for lib in "${libs[@]}"; do
  while read -r needed; do
    [[ $needed =~ $allowed ]] || fail "$(basename "$lib") needs $needed"
  done < <(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  exported=$(nm -D --defined-only "$lib" | c++filt | grep -c 'fmt::' || true)
  [ "$exported" -eq 0 ] || fail "$(basename "$lib") exports $exported fmt symbols"
done
soname=$(readelf -d "$build/client/libmoecache-client.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libmoecache-client.so.1 ] || fail "libmoecache-client.so has SONAME '$soname', not libmoecache-client.so.1"
echo "NEEDED: the C library and the compiler's runtime only, no fmt symbol exported, in ${#libs[@]} libraries"

[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (a mount namespace to hide the system's libraries)"; exit 77; }
command -v unshare >/dev/null || { echo "SKIP: unshare is missing"; exit 77; }
cat > "${TMPDIR:-/tmp}/moecache-preload-inside.$$" <<'INSIDE'
set -euo pipefail
hidden=0
for lib in libfmt.so.9 liburing.so.2 libbpf.so.1 libnuma.so.1 libsdbus-c++.so.1 libtomlplusplus.so.3; do
  for path in $(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF }'); do
    mount --bind /dev/null "$(readlink -f "$path")"
    hidden=$((hidden + 1))
  done
done
[ "$hidden" -gt 0 ] || { echo "nothing to hide: is libfmt installed?"; exit 1; }
unset LD_LIBRARY_PATH
# The daemon of the build tree needs them: it cannot start here, which shows they are hidden.
if "$BUILD_DAEMON" --version >/dev/null 2>&1; then echo "the build's daemon still starts: nothing was hidden"; exit 1; fi
for lib in "$@"; do
  err=$(LD_PRELOAD="$lib" /bin/true 2>&1) || { echo "$(basename "$lib"): /bin/true failed: $err"; exit 1; }
  [ -z "$err" ] || { echo "$(basename "$lib"): $err"; exit 1; }
done
echo "hidden $hidden system copies; ${#} libraries loaded"
INSIDE
trap 'rm -f "${TMPDIR:-/tmp}/moecache-preload-inside.$$"' EXIT
BUILD_DAEMON="$build/daemon/moecached" unshare -m --propagation private bash "${TMPDIR:-/tmp}/moecache-preload-inside.$$" "${libs[@]}" ||
  fail "a library did not load with moecache's dependencies hidden"
echo PASS
