#!/usr/bin/env bash
# The manual pages the build writes (docs/man/make-man.sh) render without a groff warning, and say
# everything their sources do: every key of the annotated configuration, every moecachectl command.
# Usage: man_pages_test.sh BUILD_DIR SOURCE_DIR      exit 77: skipped (no groff)
set -euo pipefail
build=${1:?usage: man_pages_test.sh BUILD_DIR SOURCE_DIR}
src=${2:?}
man=$build/docs/man
fail() { echo "FAIL: $*"; exit 1; }
command -v groff >/dev/null || { echo "SKIP: groff is missing (Debian package groff-base)"; exit 77; }
for page in moecached.8 moecachectl.1 moecached.toml.5; do
  [ -s "$man/$page" ] || fail "$man/$page was not written"
  warnings=$(LC_ALL=C.UTF-8 groff -man -Tutf8 -ww -z "$man/$page" 2>&1)
  [ -z "$warnings" ] || fail "$page: $warnings"
done
text=$(LC_ALL=C.UTF-8 groff -man -Tutf8 -P-cbou "$man/moecached.toml.5" 2>/dev/null)
keys=0
while read -r key; do
  grep -q "^ *$key = " <<<"$text" || fail "moecached.toml(5) does not show the key $key"
  keys=$((keys + 1))
done < <(sed -n 's/^#\([a-z_]*\) = .*/\1/p' "$src/config/moecached.toml" | sort -u)
[ "$keys" -gt 30 ] || fail "only $keys keys found in the annotated configuration"
ctl_text=$(LC_ALL=C.UTF-8 groff -man -Tutf8 -P-cbou "$man/moecachectl.1" 2>/dev/null)
for cmd in status models inspect experts budget pin unpin prefetch wait evict profile trace register unregister; do
  grep -q "usage: moecachectl $cmd" <<<"$ctl_text" || fail "moecachectl(1) has no usage of $cmd"
done
echo "PASS: 3 pages render cleanly; $keys configuration keys and every command shown"
