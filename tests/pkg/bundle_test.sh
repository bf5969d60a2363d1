#!/usr/bin/env bash
# The relocatable bundle (scripts/bundle.sh), as its release tarball unpacked outside the build tree, run
# in a mount namespace where every system copy of a library it carries is hidden (/dev/null bound
# over it) and LD_LIBRARY_PATH is unset: the daemon starts, loads a model made by the bundled
# generator, serves a bundled client over its socket, and stops on SIGTERM; moecachectl and the
# CUDA hook's library load too. What users of other distributions (Ubuntu 24.04, the GPU machine)
# get.
# Usage: bundle_test.sh BUILD_DIR SOURCE_DIR      exit 77: skipped (not root, no unshare/patchelf)
set -euo pipefail
build=${1:?usage: bundle_test.sh BUILD_DIR SOURCE_DIR}
src=$(realpath "${2:?usage: bundle_test.sh BUILD_DIR SOURCE_DIR}")

[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (a mount namespace to hide the system's libraries)"; exit 77; }
for tool in unshare patchelf ldconfig; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is missing"; exit 77; }
done

t=$(mktemp -d /var/tmp/moecache-bundle.XXXXXX)
trap 'rm -rf "$t"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# The release tarball, unpacked elsewhere: what a user of another distribution downloads.
"$src/scripts/bundle.sh" "$t/moecache.tar.gz" "$build" || fail "scripts/bundle.sh (tarball)"
mkdir -p "$t/unpacked"
tar -C "$t/unpacked" -xzf "$t/moecache.tar.gz" || fail "the tarball does not unpack"
b=$(echo "$t"/unpacked/moecache-*)
[ -x "$b/bin/moecached" ] || fail "the tarball holds no bin/moecached"
carried=$(sed -n 's/^carried in lib\/: //p' "$b/MANIFEST")
[ -n "$carried" ] || fail "the MANIFEST names no carried library"
for lib in libbpf.so.1 liburing.so.2 libnuma.so.1 libsdbus-c++.so.1 libfmt.so.9 libtomlplusplus.so.3; do
  [[ " $carried " == *" $lib "* ]] || fail "$lib is not carried: $carried"
done
for f in "$b"/bin/*; do
  [ "$(patchelf --print-rpath "$f")" = '$ORIGIN/../lib' ] || fail "$f: rpath $(patchelf --print-rpath "$f")"
done
# The base system's libsystemd and compression libraries are the system's, not frozen copies.
for lib in libsystemd.so.0 libz.so.1 libzstd.so.1 liblzma.so.5 libgcrypt.so.20 libssl.so.3 libcrypto.so.3; do
  [[ " $carried " != *" $lib "* ]] || fail "$lib is carried: a frozen copy of the system's ($carried)"
done
# Each carried library has its reason in the MANIFEST.
for lib in $carried; do
  grep -q "^  $lib: ." "$b/MANIFEST" || fail "the MANIFEST does not say why $lib is carried"
done
[ -f "$b/lib/moecache/libmoecache-dbus.so" ] || fail "no D-Bus module in lib/moecache/"
sed -e "s|@SOCKET@|$t/bus|" -e "s|@POLICY@|$src/dbus/org.moecache1.conf|" "$src/dbus/private-bus.conf.in" > "$t/bus.conf"

# Inside: the system copies of what the bundle carries are gone.
cat > "$t/inside.sh" <<'EOF'
set -euo pipefail
b=$1; t=$2; carried=$3
hidden=0
for lib in $carried; do
  for path in $(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF }'); do
    real=$(readlink -f "$path")
    mount --bind /dev/null "$real"
    hidden=$((hidden + 1))
  done
done
echo "hidden: $hidden system copies"
unset LD_LIBRARY_PATH LD_PRELOAD
# A program of the build tree cannot start here any more; the bundle's can.
if "$BUILD_DAEMON" --version >/dev/null 2>&1; then echo "the build's own daemon still starts: nothing was hidden"; exit 1; fi
"$b/bin/moecached" --version
"$b/bin/moecachectl" --help >/dev/null
LD_PRELOAD="$b/lib/libmoecache-cuda.so" /bin/true
"$b/bin/moecache-mkmodel" --output "$t/m.gguf" --layers 4 --experts 16 --embd 256 --ff 256 >/dev/null
cat > "$t/moecached.toml" <<CONF
[daemon]
state_dir = "$t/state"
socket = "$t/moecached.sock"
tick_seconds = 0.2
[budget]
lock = "64MiB"
reserve = "256MiB"
[metrics]
listen = ""
[dbus]
bus = "unix:path=$t/bus"
[[model]]
path = "$t/m.gguf"
pin = ["0"]
CONF
# A private bus: the bundled moecachectl reaches the bundled daemon through its D-Bus module.
dbus-daemon --config-file="$t/bus.conf" --nofork > "$t/bus.log" 2>&1 &
bus=$!
for _ in $(seq 100); do [ -S "$t/bus" ] && break; sleep 0.1; done
[ -S "$t/bus" ] || { cat "$t/bus.log"; echo "no private bus"; exit 1; }
"$b/bin/moecached" --config "$t/moecached.toml" > "$t/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do grep -q 'moecached running' "$t/daemon.log" && break; sleep 0.1; done
grep -q 'moecached running' "$t/daemon.log" || { cat "$t/daemon.log"; exit 1; }
grep -q 'D-Bus: org.moecache1 on the' "$t/daemon.log" || { cat "$t/daemon.log"; echo "the D-Bus module did not load"; exit 1; }
"$b/bin/moecachectl" --bus "unix:path=$t/bus" models > "$t/ctl.log" 2>&1 || { cat "$t/ctl.log" "$t/daemon.log"; exit 1; }
grep -q "m.gguf" "$t/ctl.log" || { cat "$t/ctl.log"; echo "moecachectl models does not list the model"; exit 1; }
"$b/bin/moecache-client-demo" "$t/m.gguf" --socket "$t/moecached.sock" --seconds 1 --wait-ready 10 > "$t/client.log" 2>&1 ||
  { cat "$t/client.log" "$t/daemon.log"; exit 1; }
kill -TERM $daemon
wait $daemon
kill $bus
grep -q 'telemetry: [1-9][0-9]* events' "$t/daemon.log" || { cat "$t/daemon.log"; exit 1; }
echo "the bundled daemon ran, loaded its D-Bus module, answered the bundled moecachectl, served the bundled client and stopped"
EOF
BUILD_DAEMON="$build/daemon/moecached" unshare -m --propagation private bash "$t/inside.sh" "$b" "$t" "$carried" ||
  fail "the bundle did not run with the system's copies hidden"
echo "PASS: $(head -1 "$b/MANIFEST"), $(du -sh "$b" | cut -f1)"
