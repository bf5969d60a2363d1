#!/usr/bin/env bash
# A dbus-daemon for a machine that has none (the GPU machine): the binary and the libraries it
# links but glibc, with an $ORIGIN rpath, in OUT (OUT/dbus-daemon, OUT/lib/). bench/gpu-squeeze.sh
# runs it for a private bus (DBUS_DAEMON=OUT/dbus-daemon) so that moecachectl can sample the daemon.
#   bench/bundle-dbus.sh OUT
set -euo pipefail
out=${1:?usage: bench/bundle-dbus.sh OUT}
bin=$(command -v dbus-daemon) || { echo "bundle-dbus: no dbus-daemon here (apt-get install dbus-daemon)" >&2; exit 2; }
command -v patchelf >/dev/null || { echo "bundle-dbus: needs patchelf (apt-get install patchelf)" >&2; exit 2; }
rm -rf "$out"
mkdir -p "$out/lib"
cp "$bin" "$out/dbus-daemon"
ldd "$bin" | awk '/=> \// {print $3}' | grep -v -e '/libc\.so' -e '/libm\.so' -e '/ld-linux' | while read -r l; do cp -L "$l" "$out/lib/"; done
patchelf --set-rpath '$ORIGIN/lib' "$out/dbus-daemon"
for f in "$out"/lib/*; do patchelf --set-rpath '$ORIGIN' "$f"; done
echo "bundle-dbus: $out ($(du -sh "$out" | cut -f1))"
