#!/usr/bin/env bash
# The Debian package: built with cpack into a temporary directory, its control fields sane, then
# installed with dpkg --root into an empty root (maintainer scripts run chrootless with DPKG_ROOT,
# as for a system being bootstrapped). Every file `cmake --install` puts in place must be there,
# the same bytes (binaries aside: the package strips them); the units, the D-Bus policy, tmpfiles,
# sysusers and the conffile among them; postinst made the user, the group and the directories;
# the installed units verify against the installed daemon; a purge takes it all away again.
# Usage: deb_package_test.sh BUILD_DIR SOURCE_DIR      exit 77: skipped (not root, no dpkg/cpack)
set -euo pipefail
build=${1:?usage: deb_package_test.sh BUILD_DIR SOURCE_DIR}
src=${2:?usage: deb_package_test.sh BUILD_DIR SOURCE_DIR}

[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (dpkg --root installs files owned by root and chowns)"; exit 77; }
for tool in cpack dpkg dpkg-deb; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is missing"; exit 77; }
done

t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
check() { "$@" || fail "$(printf '%q ' "$@")"; }

# The package, away from the build directory's own output.
cpack --config "$build/CPackConfig.cmake" -G DEB -B "$t/cpack" > "$t/cpack.log" 2>&1 || { cat "$t/cpack.log"; fail "cpack"; }
deb=$(ls "$t"/cpack/*.deb)
[ "$(echo "$deb" | wc -l)" -eq 1 ] || fail "cpack made: $deb"

# What an install puts where, as `cmake --install --prefix /usr` does it.
DESTDIR="$t/stage" cmake --install "$build" --prefix /usr > "$t/install.log" 2>&1 || { cat "$t/install.log"; fail "cmake --install"; }
mapfile -t manifest < "$build/install_manifest.txt"
[ ${#manifest[@]} -gt 10 ] || fail "install manifest has ${#manifest[@]} entries"

field() { dpkg-deb --field "$deb" "$1"; }
version=$(sed -n 's/^project(moecache VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")
check test "$(field Package)" = moecache
check test "$(field Version)" = "$version"
check test "$(field Architecture)" = "$(dpkg --print-architecture)"
check test "$(field Section)" = admin
[[ "$(field Maintainer)" =~ ^[^\<]+\ \<[^@\>]+@[^\>]+\>$ ]] || fail "Maintainer: $(field Maintainer)"
[ -n "$(field Description)" ] || fail "no Description"
depends=$(field Depends)
for dep in dbus libc6 libstdc++6; do
  [[ ", $depends," == *", $dep"[\ ,]* ]] || fail "Depends lacks $dep: $depends"
done
info=$(dpkg-deb --info "$deb")
grep -q ' conffiles' <<<"$info" || fail "no conffiles in the control archive"
for script in postinst prerm postrm; do
  grep -q " $script " <<<"$info" || fail "no $script"
done
echo "package: $(basename "$deb"), $(stat -c %s "$deb") bytes, $(dpkg-deb -c "$deb" | grep -vc '/$') files"

# An empty root with just what dpkg needs to keep its books.
root=$t/root
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates" "$root/var/lib/dpkg/triggers" "$root/etc"
touch "$root/var/lib/dpkg/status" "$root/var/lib/dpkg/available"
for db in passwd group shadow gshadow; do : > "$root/etc/$db"; done
dpkg_root() { dpkg --root="$root" --force-script-chrootless --force-depends "$@"; }
dpkg_root -i "$deb" > "$t/dpkg.log" 2>&1 || { cat "$t/dpkg.log"; fail "dpkg -i"; }
status=$(dpkg --root="$root" -s moecache)
grep -q '^Status: install ok installed' <<<"$status" || fail "not installed: $status"

for f in "${manifest[@]}"; do
  [ -e "$root$f" ] || [ -L "$root$f" ] || fail "$f is in the install manifest but not in the installed package"
  if [ -f "$t/stage$f" ] && ! head -c 4 "$t/stage$f" | grep -q $'\x7fELF'; then
    cmp -s "$t/stage$f" "$root$f" || fail "$f differs from what cmake --install puts there"
  fi
  if [ -x "$t/stage$f" ] && [ ! -x "$root$f" ]; then fail "$f is not executable"; fi
done
echo "installed: all ${#manifest[@]} files of the install manifest"
for f in /usr/sbin/moecached /usr/bin/moecachectl /usr/bin/moecache-mkmodel /usr/lib/libmoecache-client.so \
         /usr/include/moecache/client.h /usr/lib/pkgconfig/moecache-client.pc \
         /usr/lib/systemd/system/moecached.service /usr/lib/systemd/system/moecached.socket \
         /usr/lib/systemd/system/moecache.slice /usr/lib/tmpfiles.d/moecache.conf /usr/lib/sysusers.d/moecache.conf \
         /usr/share/dbus-1/system.d/org.moecache1.conf /etc/moecache/moecached.toml \
         /usr/share/moecache/grafana-dashboard.json \
         /usr/share/doc/moecache/examples/llama-server.service.d/moecache.conf \
         /usr/share/doc/moecache/examples/ollama.service.d/moecache.conf; do
  [ -e "$root$f" ] || fail "$f is not installed"
done
grep -q '^ /etc/moecache/moecached.toml [0-9a-f]\{32\}$' <<<"$status" ||
  fail "/etc/moecache/moecached.toml is not a conffile: $status"
check grep -q '^ExecStart=/usr/sbin/moecached ' "$root/usr/lib/systemd/system/moecached.service"

# postinst: the user and groups (sysusers), the state directory owned by the user (tmpfiles).
uid=$(awk -F: '$1 == "moecached" { print $3 }' "$root/etc/passwd")
gid=$(awk -F: '$1 == "moecached" { print $3 }' "$root/etc/group")
if [ -z "$uid" ] || [ -z "$gid" ]; then fail "no user moecached: $(cat "$root/etc/passwd")"; fi
grep -q '^moecache:' "$root/etc/group" || fail "no group moecache: $(cat "$root/etc/group")"
for d in /var/lib/moecache /var/lib/moecache/profiles; do
  check test "$(stat -c '%u:%g %a' "$root$d")" = "$uid:$gid 700"
done
for entry in "$root"/run/*; do
  [ ! -e "$entry" ] || [ "$entry" = "$root/run/moecache" ] || fail "postinst made $entry"
done

# The units as installed, against the installed daemon (and this machine's targets).
if command -v systemd-analyze >/dev/null; then
  host_units=/usr/lib/systemd/system
  [ -d "$host_units" ] || host_units=/lib/systemd/system
  cp -an "$host_units/." "$root/usr/lib/systemd/system/"
  mkdir -p "$root/bin" && cp /bin/sh "$root/bin/sh"  # ExecReload runs the shell (a real system has one)
  out=$(systemd-analyze verify --man=no --root="$root" moecached.service moecached.socket moecache.slice 2>&1) ||
    fail "systemd-analyze verify of the installed units: $out"
  [ -z "$out" ] || fail "systemd-analyze verify of the installed units: $out"
  rm -f "$root/bin/sh"
fi

# Reinstalling over itself (an upgrade), then a purge.
dpkg_root -i "$deb" > "$t/dpkg.log" 2>&1 || { cat "$t/dpkg.log"; fail "dpkg -i over the installed package"; }
dpkg_root -P moecache > "$t/dpkg.log" 2>&1 || { cat "$t/dpkg.log"; fail "dpkg -P"; }
for f in "${manifest[@]}"; do
  [ ! -e "$root$f" ] || [ -d "$root$f" ] || fail "$f is still there after a purge"
done
[ ! -e "$root/var/lib/moecache" ] || fail "/var/lib/moecache is still there after a purge"
echo "reinstalled and purged cleanly"
