#!/usr/bin/env bash
# The sizes the README and docs/mkmodel.md quote for moecache-mkmodel's examples, and the demo's
# model size in the README, are what moecache-mkmodel says those commands write today (--dry-run:
# nothing is written). (The README's systemd-analyze exposure is checked by systemd_units_test.sh.)
# Usage: readme_figures_test.sh SOURCE_DIR MKMODEL
set -uo pipefail
src=${1:?usage: readme_figures_test.sh SOURCE_DIR MKMODEL}
mk=${2:?usage: readme_figures_test.sh SOURCE_DIR MKMODEL}
fail=0
checked=0
# check "WHERE" "QUOTED" "ARGS...": the quoted size ("~5.2 GiB", "216 MiB") within 5 % of --dry-run's.
check() {
  local where=$1 quoted=$2
  shift 2
  local bytes
  bytes=$("$mk" "$@" -o /nonexistent/x.gguf --dry-run --json | sed -n 's/^ *"bytes": \([0-9]*\),*$/\1/p')
  [ -n "$bytes" ] || { echo "FAIL: $where: moecache-mkmodel $* --dry-run said nothing"; fail=1; return; }
  local ok
  ok=$(awk -v q="$quoted" -v b="$bytes" 'BEGIN {
    n = q; sub(/^~/, "", n); split(n, p, " "); f = p[2] == "GiB" ? 2^30 : (p[2] == "MiB" ? 2^20 : 0);
    if (f == 0) { print "unit"; exit } d = (p[1] * f - b) / b; print (d < 0.05 && d > -0.05) ? "yes" : "no" }')
  if [ "$ok" != yes ]; then
    echo "FAIL: $where quotes $quoted; moecache-mkmodel $* writes $bytes bytes ($(awk -v b="$bytes" 'BEGIN {printf "%.2f GiB", b / 2^30}'))"
    fail=1
  fi
  checked=$((checked + 1))
}
# Each moecache-mkmodel example (continuation lines joined) with a "# ~N GiB|MiB" comment.
for doc in README.md docs/mkmodel.md; do
  while IFS= read -r line; do
    quoted=$(sed -n 's/^[^#]*#[^~]*\(~[0-9.]* [GM]iB\).*/\1/p' <<<"$line")
    [ -n "$quoted" ] || continue
    args=$(sed -e 's/#.*//' -e 's/.*moecache-mkmodel//' <<<"$line")
    # -o/--output is replaced by check's own.
    read -r -a argv <<<"$(sed -E 's/(-o|--output) +[^ ]+//' <<<"$args")"
    check "$doc" "$quoted" "${argv[@]}"
  done < <(awk '/moecache-mkmodel/ { line = $0; while (line ~ /\\ *(#.*)?$/ && (getline nxt) > 0) { c = ""; if (match(line, /#.*/)) c = substr(line, RSTART); sub(/\\ *(#.*)?$/, "", line); line = line " " nxt " " c } print line }' "$src/$doc")
done
# The demo's model, as README's "Two commands" describes it.
quoted=$(sed -n 's/.*generate a \([0-9.]* [GM]iB\) MoE model.*/\1/p' "$src/README.md")
demo=$(awk '/moecache-mkmodel -o "\$model"/ { line = $0; while (line ~ /\\ *$/ && (getline nxt) > 0) { sub(/\\ *$/, "", line); line = line " " nxt } print line }' "$src/scripts/demo.sh" | sed -e 's/.*moecache-mkmodel -o "$model"//' -e 's/--drop-cache//')
[ -n "$quoted" ] && [ -n "$demo" ] || { echo "FAIL: the README's demo size or the demo's mkmodel command not found"; exit 1; }
read -r -a argv <<<"$demo"
check "README.md (the demo)" "$quoted" "${argv[@]}"
[ "$checked" -ge 3 ] || { echo "FAIL: only $checked figures found to check"; exit 1; }
[ $fail = 0 ] && echo "PASS: $checked quoted sizes are what moecache-mkmodel writes"
exit $fail
