#!/usr/bin/env bash
# moecachectl's completion for bash, zsh and fish (`moecachectl completion SHELL`): each parses in
# its shell and offers the verbs; bash and fish complete a verb, a verb's options and the shells
# of `completion` as a user's shell would. Usage: completion_test.sh MOECACHECTL
set -uo pipefail
ctl=${1:?usage: completion_test.sh MOECACHECTL}
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
verbs=$("$ctl" help | sed -n 's/^  \([a-z]*\) .*/\1/p' | sort -u)
[ -n "$verbs" ] || fail "moecachectl help lists no verbs"
for sh in bash zsh fish; do
  "$ctl" completion "$sh" > "$t/$sh" || fail "moecachectl completion $sh"
  for v in $verbs; do grep -qw "$v" "$t/$sh" || fail "$sh: the verb $v is not offered"; done
done
bash -n "$t/bash" || fail "bash: the script does not parse"
# bash: complete "moecachectl sta" and "moecachectl wait MODEL --t".
got=$(bash -c 'source "$1"; COMP_WORDS=(moecachectl sta); COMP_CWORD=1; _moecachectl; echo "${COMPREPLY[*]}"
  COMP_WORDS=(moecachectl wait m.gguf --t); COMP_CWORD=3; _moecachectl; echo "${COMPREPLY[*]}"' _ "$t/bash")
[ "$(sed -n 1p <<<"$got")" = status ] || fail "bash: 'moecachectl sta' completes to '$(sed -n 1p <<<"$got")'"
[ "$(sed -n 2p <<<"$got")" = --timeout ] || fail "bash: 'moecachectl wait m.gguf --t' completes to '$(sed -n 2p <<<"$got")'"
if command -v zsh >/dev/null; then
  zsh -n "$t/zsh" || fail "zsh: the script does not parse"
  head -1 "$t/zsh" | grep -q '^#compdef moecachectl$' || fail "zsh: no #compdef line"
else
  echo "SKIP: zsh is not installed (scripts/setup/install-deps.sh installs it)"; exit 77
fi
if command -v fish >/dev/null; then
  fish -n "$t/fish" || fail "fish: the script does not parse"
  got=$(fish -c "source $t/fish; complete -C 'moecachectl sta'; complete -C 'moecachectl wait m.gguf --s'; complete -C 'moecachectl completion z'" 2>/dev/null)
  grep -q '^status	the daemon at a glance' <<<"$got" || fail "fish: 'moecachectl sta' does not complete to status: $got"
  grep -q '^--settle$' <<<"$got" || fail "fish: wait's --settle is not offered: $got"
  grep -q '^zsh$' <<<"$got" || fail "fish: completion's zsh is not offered: $got"
else
  echo "SKIP: fish is not installed (scripts/setup/install-deps.sh installs it)"; exit 77
fi
echo "PASS: bash, zsh and fish completion parse, offer every verb, and complete as the shells do"
