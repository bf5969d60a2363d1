#!/usr/bin/env bash
# The house style (.clang-format) on every line changed since the rule began: `git clang-format
# --diff` against BASE, which formats only the lines a change touched (the tree is not
# mass-reformatted). Prints what clang-format would change and exits 1 if anything; says so and
# exits 0 where it cannot look (no git history, as in a source tarball, or no clang-format).
#   scripts/check-format.sh [BASE]      (BASE: the commit the rule began at)
set -uo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"
base=${1:-dae1fba43fd10193fe659add74e22cfd92a2063d}
if ! command -v git-clang-format >/dev/null || ! command -v clang-format >/dev/null; then
  echo "format check: not run (git-clang-format or clang-format is not installed)"
  exit 0
fi
if ! git rev-parse --git-dir >/dev/null 2>&1 || ! git cat-file -e "$base^{commit}" 2>/dev/null; then
  echo "format check: not run (no git history holding $base here)"
  exit 0
fi
out=$(git clang-format --diff "$base" -- '*.c' '*.cc' '*.cpp' '*.h' '*.hpp' '*.cu' 2>&1)
case $out in
  *"did not modify any files"* | *"no modified files to format"* | "")
    echo "format check: every line changed since ${base:0:12} follows .clang-format"
    exit 0 ;;
esac
echo "$out"
echo "format check: the lines above do not follow .clang-format (fix: git clang-format ${base:0:12})"
exit 1
