#!/usr/bin/env bash
# Builds the OCI image of moecached from the relocatable bundle (scripts/bundle.sh), from scratch:
# no base image is pulled. The image holds the bundle under /opt/moecache, the C library and
# compiler runtime its programs load (copied from this machine, at their paths), and a
# configuration for containers (deploy/container/moecached.toml: no D-Bus, /metrics on loopback
# unless a drop-in opts in, models under /models), the daemon's user (moecached, 65532: the
# default command switches to it) and a static busybox (/bin/sh, cp, chown: for an init container
# that prepares the node). Needs buildah (and busybox-static); run as root.
#   scripts/image.sh [TAG] [BUILD_DIR]      TAG: localhost/moecache:VERSION
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${2:-$top/build}
version=$("$build/daemon/moecached" --version | awk '{print $2}')
tag=${1:-localhost/moecache:$version}
command -v buildah >/dev/null || { echo "image: buildah is missing (apt-get install buildah)" >&2; exit 1; }

work=$(mktemp -d)
ctr=
cleanup() {
  [ -n "$ctr" ] && buildah rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
"$top/scripts/bundle.sh" "$work/moecache" "$build" >/dev/null

ctr=$(buildah from scratch)
root=$(buildah mount "$ctr")
mkdir -p "$root/opt" "$root/etc/moecache/moecached.toml.d" "$root/var/lib/moecache" "$root/run/moecache" "$root/models" "$root/tmp"
chmod 1777 "$root/tmp"
cp -a "$work/moecache" "$root/opt/moecache"
# No D-Bus in a container (the configuration sets none): the D-Bus module, moecachectl and the
# libraries only they load (sdbus-c++, and libsystemd with its own) stay out.
rm -rf "$root/opt/moecache/lib/moecache" "$root/opt/moecache/bin/moecachectl" "$root"/opt/moecache/lib/libsdbus-c++.so*
install -m 0644 "$top/deploy/container/moecached.toml" "$root/etc/moecache/moecached.toml"
# The seccomp profile the DaemonSet's init container installs on each node (deploy/kubernetes).
install -D -m 0644 "$top/deploy/kubernetes/seccomp/moecached.json" "$root/opt/moecache/share/seccomp/moecached.json"
# What the bundle leaves to the system (glibc, libstdc++, libgcc_s and the dynamic loader), at the
# paths this machine has them: the bundle's programs were linked against exactly these.
declare -A system=()
for f in "$root"/opt/moecache/bin/* "$root"/opt/moecache/lib/*.so*; do
  while read -r path; do system[$path]=1; done < <(ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
done
for path in "${!system[@]}"; do
  [[ $path == "$root"* ]] && continue
  mkdir -p "$root$(dirname "$path")"
  cp -L "$path" "$root$path"
done
# The loader is also found by its canonical name, wherever the programs' interpreter points.
interp=$(readelf -l "$root/opt/moecache/bin/moecached" | sed -n 's/.*interpreter: \(.*\)]/\1/p')
mkdir -p "$root$(dirname "$interp")"
[ -e "$root$interp" ] || cp -L "$interp" "$root$interp"

# A static busybox, for the one thing a shell is needed for on a node: an init container that
# gives the daemon's host directories to its user and copies the preload libraries onto the host
# for inference pods (deploy/kubernetes).
if [ -x /bin/busybox ] && [[ $(file -L /bin/busybox) == *"statically linked"* ]]; then
  mkdir -p "$root/bin"
  cp /bin/busybox "$root/bin/busybox"
  for tool in sh cp mv mkdir ls cat chown chmod; do ln -s busybox "$root/bin/$tool"; done
else
  echo "image: no static busybox (apt-get install busybox-static): the image has no shell" >&2
fi
# The daemon's own user (--user moecached, the default command): it owns the state and socket
# directories; anonymous volumes are created with that ownership.
printf 'root:x:0:0:root:/root:/sbin/nologin\nmoecached:x:65532:65532:moecached:/var/lib/moecache:/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\nmoecached:x:65532:\n' > "$root/etc/group"
chown 65532:65532 "$root/var/lib/moecache" "$root/run/moecache"
chmod 0700 "$root/var/lib/moecache"
buildah umount "$ctr" >/dev/null

buildah config --entrypoint '["/opt/moecache/bin/moecached"]' --cmd '["--config", "/etc/moecache/moecached.toml", "--user", "moecached"]' \
  --port 8474 --volume /models --volume /var/lib/moecache --volume /run/moecache \
  --label org.opencontainers.image.title=moecache \
  --label org.opencontainers.image.description="moecached: keeps the hot experts of MoE models in RAM and VRAM" \
  --label org.opencontainers.image.version="$version" "$ctr"
buildah commit --quiet "$ctr" "$tag" >/dev/null
echo "$tag"
