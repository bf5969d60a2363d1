#!/usr/bin/env bash
# The OCI image (scripts/image.sh, built from scratch from the bundle) run under podman as a
# container runs under Docker's or containerd's default seccomp profile, which denies io_uring:
# moecached starts, says so and reads with threads, loads a model from a mounted directory and
# locks it, serves /metrics without D-Bus, and stops on SIGTERM (podman stop) as PID 1. Then under
# the seccomp profile the Kubernetes manifests ship, which allows io_uring: io_uring reads.
# Usage: container_test.sh BUILD_DIR SOURCE_DIR      exit 77: skipped (not root, no podman/buildah)
set -euo pipefail
build=${1:?usage: container_test.sh BUILD_DIR SOURCE_DIR}
src=${2:?}
[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (podman and buildah as root)"; exit 77; }
for tool in podman buildah curl; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is missing (scripts/setup/install-deps.sh installs it)"; exit 77; }
done

t=$(mktemp -d /var/tmp/moecache-container.XXXXXX)
tag=localhost/moecache-test:$$
name=moecache-test-$$
fail() {
  echo "FAIL: $*"
  podman logs "$name" 2>&1 | sed 's/^/  container: /' || true
  exit 1
}
cleanup() {
  podman rm -f "$name" "$name-files" >/dev/null 2>&1 || true
  podman rmi -f "$tag" >/dev/null 2>&1 || true
  rm -rf "$t"
}
trap cleanup EXIT

# This machine's limits as they are: podman's defaults raise RLIMIT_NOFILE and RLIMIT_NPROC, which
# root without CAP_SYS_RESOURCE (a sandbox) may not. crun refuses hybrid cgroup hierarchies
# (a v1 memory controller beside v2): runc runs there.
printf '[containers]\ndefault_ulimits = []\n' > "$t/containers.conf"
export CONTAINERS_CONF=$t/containers.conf
runtime=()
if [ -d /sys/fs/cgroup/unified ] || [ -d /sys/fs/cgroup/memory ]; then
  command -v runc >/dev/null || { echo "SKIP: hybrid cgroups need runc (crun refuses them)"; exit 77; }
  runtime=(--runtime runc)
fi

"$src/scripts/image.sh" "$tag" "$build" >/dev/null || fail "scripts/image.sh"
size=$(podman image inspect "$tag" --format '{{.Size}}')
# Only the libraries its programs load: no D-Bus in a container, so neither sdbus-c++ nor
# libsystemd (with its crypto and compression libraries), and no TLS.
podman create --name "$name-files" "$tag" >/dev/null || fail "podman create"
files=$(podman export "$name-files" | tar -t)
podman rm "$name-files" >/dev/null
for lib in libsystemd libsdbus-c++ libssl libcrypto libgcrypt libgpg-error liblz4 libcap; do
  ! grep -q "/$lib\.so" <<<"$files" || fail "the image carries $lib, which nothing in it loads: $(grep "/$lib\.so" <<<"$files" | head -3)"
done
grep -q 'opt/moecache/bin/moecached$' <<<"$files" || fail "the image has no moecached (the file list is wrong)"
mkdir -p "$t/models" "$t/conf"
"$build/tools/mkmodel/moecache-mkmodel" --output "$t/models/m.gguf" --layers 4 --experts 16 --embd 256 --ff 256 --drop-cache >/dev/null
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
       echo $(( 20000 + $$ % 20000 )))
# No pressure back-off: PSI is the whole machine's, and a busy one (image builds, other tests) would
# hold the locks back for a while (seen: cap 0 for the whole wait).
printf '[metrics]\nlisten = "127.0.0.1:%s"\n[budget]\nlock = "64MiB"\nreserve = "256MiB"\n[pressure]\nenabled = false\n' "$port" > "$t/conf/10-test.toml"
# Docker's default profile allows what it lists and io_uring is not among it: the same answer, EPERM.
cat > "$t/seccomp.json" <<'JSON'
{"defaultAction": "SCMP_ACT_ALLOW",
 "syscalls": [{"names": ["io_uring_setup", "io_uring_enter", "io_uring_register"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}
JSON
podman "${runtime[@]}" run -d --name "$name" --network host --cap-add IPC_LOCK \
  --security-opt seccomp="$t/seccomp.json" -v "$t/models:/models:ro" -v "$t/conf:/etc/moecache/moecached.toml.d:ro" \
  "$tag" >/dev/null || fail "podman run"
# Logs captured before they are searched: under pipefail, grep -q leaving early could fail podman.
logs() { podman logs "$name" 2>&1 || true; }
for _ in $(seq 100); do [[ $(logs) == *'moecached running'* ]] && break; sleep 0.2; done
[[ $(logs) == *'moecached running'* ]] || fail "the daemon did not start"
[[ $(logs) == *'io_uring is denied here'* ]] || fail "no word of io_uring being denied"
metrics=
# until_locked: polls /metrics (into $metrics) until part of /models/m.gguf is locked, 20 s at most.
until_locked() {
  for _ in $(seq 100); do
    metrics=$(curl -sf "http://127.0.0.1:$port/metrics" || true)
    grep -q '^moecache_locked_bytes{.*file="/models/m.gguf"} [1-9]' <<<"$metrics" && return 0
    sleep 0.2
  done
  return 1
}
until_locked || fail "nothing of /models/m.gguf locked: $metrics"
grep -q '^moecache_prefetch_engine{engine="threads"} 1' <<<"$metrics" || fail "the prefetcher does not say threads"
grep -q '^moecache_prefetched_bytes_total [1-9]' <<<"$metrics" || fail "the threads read nothing"
podman stop -t 20 "$name" >/dev/null
[ "$(podman inspect "$name" --format '{{.State.ExitCode}}')" = 0 ] || fail "exit code $(podman inspect "$name" --format '{{.State.ExitCode}}')"
[[ $(logs) == *'signal 15: stopping'* ]] || fail "SIGTERM was not taken as PID 1"
podman rm -f "$name" >/dev/null

# As the DaemonSet runs it: root only to switch (--user 65532:65532), every capability dropped but
# the daemon's and the three the switch needs, no new privileges, a read-only root, its host
# directories given to its user; under the profile the Kubernetes manifests ship
# (deploy/kubernetes/seccomp/moecached.json, an allowlist from the systemd unit's filter, with
# io_uring): it runs as 65532 with only the capabilities it uses, and io_uring reads.
want=(SETUID SETGID SETPCAP IPC_LOCK BPF PERFMON SYS_RESOURCE FOWNER)
bits=(7 6 8 14 39 38 24 3)
bounding=$(( 16#$(awk '/^CapBnd:/ {print $2}' /proc/self/status) ))
caps=()
kept=0
for i in "${!want[@]}"; do  # this machine's root may lack some (a sandbox without SYS_RESOURCE)
  (( bounding >> ${bits[$i]} & 1 )) || continue
  caps+=(--cap-add "${want[$i]}")
  [ "$i" -ge 3 ] && kept=$(( kept | 1 << ${bits[$i]} ))
done
mkdir -p "$t/state" "$t/run"
chown 65532:65532 "$t/state" "$t/run"
podman "${runtime[@]}" run -d --name "$name" --network host --user 0 --cap-drop ALL "${caps[@]}" \
  --security-opt no-new-privileges --read-only \
  --security-opt seccomp="$src/deploy/kubernetes/seccomp/moecached.json" -v "$t/models:/models:ro" \
  -v "$t/conf:/etc/moecache/moecached.toml.d:ro" -v "$t/state:/var/lib/moecache" -v "$t/run:/run/moecache" \
  "$tag" --config /etc/moecache/moecached.toml --user 65532:65532 >/dev/null || fail "podman run as the DaemonSet does"
until_locked || fail "as the DaemonSet runs it, nothing was locked"
grep -q '^moecache_prefetch_engine{engine="io_uring"} 1' <<<"$metrics" || fail "the shipped profile does not let io_uring read"
pid=$(podman inspect "$name" --format '{{.State.Pid}}')
status=$(cat "/proc/$pid/status")
grep -q $'^Uid:\t65532\t65532\t65532\t65532$' <<<"$status" || fail "the daemon does not run as 65532: $(grep Uid <<<"$status")"
eff=$(( 16#$(awk '/^CapEff:/ {print $2}' <<<"$status") ))
prm=$(( 16#$(awk '/^CapPrm:/ {print $2}' <<<"$status") ))
[ "$eff" = "$kept" ] && [ "$prm" = "$kept" ] ||
  fail "capabilities: effective $(printf %x $eff), permitted $(printf %x $prm), want $(printf %x $kept) (no SETUID, SETGID, SETPCAP)"
[ -S "$t/run/moecached.sock" ] && [ "$(stat -c %u "$t/run/moecached.sock")" = 65532 ] || fail "the client socket is not the daemon user's"
podman stop -t 20 "$name" >/dev/null
[ "$(podman inspect "$name" --format '{{.State.ExitCode}}')" = 0 ] || fail "as the DaemonSet runs it: exit code $(podman inspect "$name" --format '{{.State.ExitCode}}')"
ls "$t/state/profiles/"*.json >/dev/null 2>&1 || fail "no heat profile saved in the state directory"
echo "PASS: image $tag ($((size / 1048576)) MiB): with io_uring denied it reads with threads, locks a model, serves /metrics and stops cleanly; as the DaemonSet runs it (uid 65532, capabilities $(printf %x $kept), the shipped profile) io_uring reads"
