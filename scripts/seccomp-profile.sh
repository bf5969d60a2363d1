#!/usr/bin/env bash
# Writes the seccomp profile of moecached's container (OCI/Kubernetes JSON, an allowlist): the
# system calls its systemd unit allows (SystemCallFilter=@system-service @memlock bpf mincore),
# expanded by this machine's systemd, plus io_uring, which container runtimes' default profiles
# deny and the daemon's prefetcher wants. Everything else fails with EPERM, as under the unit.
#   scripts/seccomp-profile.sh > deploy/kubernetes/seccomp/moecached.json
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
filter=$(sed -n 's/^SystemCallFilter=//p' "$top/systemd/moecached.service")
list=$(mktemp)
trap 'rm -f "$list"' EXIT
command -v systemd-analyze >/dev/null || { echo "seccomp-profile: systemd-analyze is missing" >&2; exit 1; }
[ -n "$filter" ] || { echo "seccomp-profile: no SystemCallFilter= in the unit" >&2; exit 1; }
systemd-analyze syscall-filter --no-pager 2>/dev/null | awk -v want="$filter io_uring_setup io_uring_enter io_uring_register" '
  /^@/ { group = $1; next }
  /^    [@a-z0-9_]/ { members[group] = members[group] " " $1 }
  function expand(item,    n, parts, i) {
    if (item in seen) return
    seen[item] = 1
    if (item ~ /^@/) { n = split(members[item], parts, " "); for (i = 1; i <= n; i++) expand(parts[i]) }
    else calls[item] = 1
  }
  END {
    n = split(want, w, " ")
    for (i = 1; i <= n; i++) expand(w[i])
    for (c in calls) print c
  }' | sort -u > "$list"
count=$(wc -l < "$list")
[ "$count" -gt 200 ] || { echo "seccomp-profile: only $count system calls: systemd-analyze gave too little" >&2; exit 1; }
{
  echo '{'
  echo '  "comment": "moecached: its unit'"'"'s SystemCallFilter (@system-service @memlock bpf mincore) and io_uring. Written by scripts/seccomp-profile.sh.",'
  echo '  "defaultAction": "SCMP_ACT_ERRNO",'
  echo '  "defaultErrnoRet": 1,'
  echo '  "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],'
  echo '  "syscalls": [{"action": "SCMP_ACT_ALLOW", "names": ['
  sed 's/.*/    "&"/' "$list" | paste -sd, - | sed 's/,/,\n/g'
  echo '  ]}]'
  echo '}'
} 
