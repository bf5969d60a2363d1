#!/usr/bin/env bash
# The units of systemd/ as systemd judges them: `systemd-analyze verify` says nothing about
# moecached.service, moecached.socket, moecache.slice or the example drop-ins, and
# `systemd-analyze security` rates moecached.service at an exposure of MAX (default 2.5) or less.
# Verify resolves ExecStart= and the units ordered against inside --root: the root gets this
# machine's units and stand-ins for the executables.
# Usage: systemd_units_test.sh SOURCE_DIR [MAX]     exit 77: skipped (no systemd-analyze)
set -euo pipefail
src=${1:?usage: systemd_units_test.sh SOURCE_DIR [MAX]}
max=${2:-2.5}

command -v systemd-analyze >/dev/null || { echo "SKIP: systemd-analyze is missing (Debian package systemd)"; exit 77; }
host_units=/usr/lib/systemd/system
[ -d "$host_units" ] || host_units=/lib/systemd/system

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
units=$root/usr/lib/systemd/system
mkdir -p "$units" "$root/etc/systemd/system" "$root/usr/sbin" "$root/usr/bin" "$root/bin"
cp -a "$host_units/." "$units/"
cp "$src"/systemd/moecached.service "$src"/systemd/moecached.socket "$src"/systemd/moecache.slice "$units/"
for exe in /usr/sbin/moecached /bin/sh /usr/bin/llama-server /usr/bin/ollama; do
  printf '#!/bin/sh\n' > "$root$exe"
  chmod 755 "$root$exe"
done
# The example drop-ins, on stand-ins for the units they are written for.
for unit in llama-server ollama; do
  printf '[Service]\nExecStart=/usr/bin/%s\n' "$unit" > "$units/$unit.service"
  mkdir -p "$root/etc/systemd/system/$unit.service.d"
  cp "$src/config/$unit.service.d/moecache.conf" "$root/etc/systemd/system/$unit.service.d/"
done

status=0
if ! out=$(systemd-analyze verify --man=no --root="$root" \
             moecached.service moecached.socket moecache.slice llama-server.service ollama.service 2>&1); then
  echo "FAIL: systemd-analyze verify failed"; status=1
fi
if [ -n "$out" ]; then
  echo "FAIL: systemd-analyze verify is not clean:"; echo "$out"; status=1
else
  echo "systemd-analyze verify: clean"
fi

report=$(systemd-analyze security --offline=true --root="$root" moecached.service 2>&1) || true
exposure=$(sed -n 's/.*Overall exposure level for moecached\.service: \([0-9][0-9.]*\).*/\1/p' <<<"$report")
if [ -z "$exposure" ]; then
  echo "FAIL: no exposure level in the output of systemd-analyze security:"; echo "$report"; exit 1
fi
echo "systemd-analyze security: exposure $exposure (at most $max)"
if ! awk -v e="$exposure" -v m="$max" 'BEGIN { exit !(e + 0 <= m + 0) }'; then
  echo "FAIL: exposure $exposure is above $max; what it counts:"
  grep '✗' <<<"$report" || true
  status=1
fi
# The README quotes the figure: it must be the one measured here.
src_readme=$(cd "$(dirname "$0")/../.." && pwd)/README.md
quoted=$(sed -n 's/.*`systemd-analyze security` exposure \([0-9][0-9.]*\).*/\1/p' "$src_readme")
if [ "$quoted" != "$exposure" ]; then
  echo "FAIL: README.md quotes an exposure of ${quoted:-nothing}; systemd-analyze security says $exposure"
  status=1
fi
exit $status
