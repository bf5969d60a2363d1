#!/usr/bin/env bash
# The Debian package under a real systemd: a minimal Debian 12 root (debootstrap from Debian's
# packages, cached in $MOECACHE_NSPAWN_CACHE between runs, keyed by the package's dependencies)
# boots under systemd-nspawn -b; the .deb is installed inside with dpkg, and with systemd as PID 1:
#   - the socket unit listens and a client's connect starts the service (socket activation);
#   - the service is Type=notify: active (running) only once it said READY=1;
#   - the hardened unit, with only its capabilities, locks a pinned model's experts (VmLck),
#     prefetches them, and loads its BPF programs (page-cache telemetry on);
#   - `systemctl reload` re-reads the configuration (a new lock budget in the journal);
#   - a stopped daemon (SIGSTOP) misses its watchdog pings and systemd restarts it;
#   - `systemd-analyze security` of the running unit: exposure at most 2.5.
# Usage: nspawn_boot_test.sh BUILD_DIR SOURCE_DIR      exit 77: skipped (not root, no nspawn)
set -euo pipefail
build=${1:?usage: nspawn_boot_test.sh BUILD_DIR SOURCE_DIR}
src=${2:?usage: nspawn_boot_test.sh BUILD_DIR SOURCE_DIR}
cache=${MOECACHE_NSPAWN_CACHE:-/var/cache/moecache-test}
limit=2.5

[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (debootstrap, systemd-nspawn)"; exit 77; }
for tool in cpack dpkg-deb debootstrap systemd-nspawn nsenter; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is missing (scripts/setup/install-deps.sh installs it)"; exit 77; }
done

t=$(mktemp -d /var/tmp/moecache-nspawn.XXXXXX)
leader=
nspawn_pid=
cleanup() {
  if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
    kill -TERM "$nspawn_pid" 2>/dev/null || true  # nspawn powers the container off on SIGTERM
    for _ in $(seq 50); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$nspawn_pid" 2>/dev/null || true
  fi
  rm -rf "$t"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  if [ -n "$leader" ]; then
    echo "--- the daemon's journal:"; inside journalctl -b --no-pager -u moecached.service -u moecached.socket | tail -60 || true
  fi
  exit 1
}
inside() { nsenter -t "$leader" -a -- "$@"; }
# Waits up to $1 seconds for the command after it to succeed.
until_ok() {
  local s=$1; shift
  for _ in $(seq $((s * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}
prop() { inside systemctl show -P "$1" moecached.service; }

# The package, away from the build directory's own output.
cpack --config "$build/CPackConfig.cmake" -G DEB -B "$t/cpack" > "$t/cpack.log" 2>&1 || { cat "$t/cpack.log"; fail "cpack"; }
deb=$(ls "$t"/cpack/*.deb)

# The root: Debian 12 with systemd, dbus and what the package depends on; built once per set.
deps=$(dpkg-deb --field "$deb" Depends | tr ',' '\n' | sed 's/(.*)//; s/|.*//; s/ //g' | grep -v '^$' | sort -u)
include=$(echo systemd systemd-sysv dbus $deps | tr ' ' '\n' | sort -u | paste -sd, -)
key=$(echo "$include" | sha256sum | cut -c1-12)
base=$cache/bookworm-$key
if [ ! -f "$base/.complete" ]; then
  mkdir -p "$cache"
  rm -rf "$base.new"
  echo "debootstrap: Debian 12 with $include"
  debootstrap --variant=minbase --include="$include" bookworm "$base.new" http://deb.debian.org/debian \
    > "$t/debootstrap.log" 2>&1 || { tail -30 "$t/debootstrap.log"; fail "debootstrap"; }
  touch "$base.new/.complete"
  rm -rf "$base"
  mv "$base.new" "$base"
fi
root=$t/root
cp -a "$base" "$root"
cp "$deb" "$root/root/moecache.deb"
echo mctest > "$root/etc/hostname"

# Boot. --keep-unit --register=no: no systemd or machined is needed on the host. The container
# gets the capabilities the unit asks for where the host has them (a host may lack one: the unit
# then runs without it, see below), and the RLIMIT_MEMLOCK a booted machine's PID 1 has (the unit's
# LimitMEMLOCK=infinity can only lower what PID 1 got without CAP_SYS_RESOURCE).
caps=CAP_BPF,CAP_PERFMON,CAP_IPC_LOCK
SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 systemd-nspawn -q -D "$root" -b --register=no --keep-unit \
  --rlimit=RLIMIT_MEMLOCK=infinity --console=pipe --capability=$caps --system-call-filter='bpf perf_event_open' > "$t/boot.log" 2>&1 < /dev/null &
nspawn_pid=$!
for _ in $(seq 100); do
  leader=$(pgrep -P "$nspawn_pid" -x systemd || true)
  [ -n "$leader" ] && break
  sleep 0.1
done
[ -n "$leader" ] || { cat "$t/boot.log"; fail "the container did not start systemd"; }
booted() { case "$(inside systemctl is-system-running 2>/dev/null)" in running|degraded) return 0 ;; esac; return 1; }
until_ok 60 booted || fail "the container did not boot"
echo "booted: systemd $(inside systemctl --version | head -1 | cut -d' ' -f2) as PID 1 of the container"

# Install inside, with systemd running.
inside dpkg -i /root/moecache.deb > "$t/dpkg.log" 2>&1 || { cat "$t/dpkg.log"; fail "dpkg -i inside the container"; }
# A capability the host cannot give (a sandbox's bounding set) is dropped from the unit, said here.
missing=
if inside sh -c 'grep -q "^CapBnd" /proc/1/status'; then
  bnd=$(inside sh -c 'grep ^CapBnd /proc/1/status | cut -f2')
  for cap in CAP_BPF:39 CAP_PERFMON:38 CAP_SYS_RESOURCE:24 CAP_FOWNER:3; do
    n=${cap#*:}
    if [ $(( 0x$bnd >> n & 1 )) -eq 0 ]; then missing="$missing ${cap%:*}"; fi
  done
fi
missing=$(echo $missing | tr ' ' '\n' | sort -u | paste -sd' ' -)
if [ -n "$missing" ]; then
  keep=$(for c in CAP_BPF CAP_PERFMON CAP_SYS_RESOURCE CAP_FOWNER; do [[ " $missing " == *" $c "* ]] || echo $c; done | paste -sd' ' -)
  note="this host cannot grant $missing: the test's drop-in takes it out of the unit"
  if [[ " $missing " == *" CAP_SYS_RESOURCE "* ]]; then
    # Without it no PID 1 here can raise RLIMIT_MEMLOCK past the host's (LimitMEMLOCK=infinity
    # fails): CAP_IPC_LOCK stands in, so that locking is bounded by the daemon's budgets as the
    # unit means it to be.
    keep="$keep CAP_IPC_LOCK"
    note="$note and gives CAP_IPC_LOCK for the RLIMIT_MEMLOCK it cannot raise"
  fi
  echo "note: $note"
fi

# A model, configured with every layer pinned: the daemon must lock and prefetch all of it.
inside mkdir -p /var/lib/moecache-models
inside moecache-mkmodel --output /var/lib/moecache-models/m.gguf --layers 4 --experts 16 --embd 256 --ff 256 \
  > "$t/mkmodel.log" 2>&1 || { cat "$t/mkmodel.log"; fail "moecache-mkmodel inside"; }
inside chmod -R a+rX /var/lib/moecache-models
conf() {
  cat > "$root/etc/moecache/moecached.toml" <<EOF
[daemon]
tick_seconds = 0.5
[budget]
lock = "$1"
reserve = "256MiB"
[[model]]
path = "/var/lib/moecache-models/m.gguf"
pin = ["0", "1", "2", "3"]
EOF
}
conf 96MiB
mkdir -p "$root/etc/systemd/system/moecached.service.d"
{
  echo "[Service]"
  echo "# The test's: a watchdog that fires in seconds, not 30."
  echo "WatchdogSec=4s"
  if [ -n "$missing" ]; then
    echo "AmbientCapabilities="
    echo "AmbientCapabilities=$keep"
    echo "CapabilityBoundingSet="
    echo "CapabilityBoundingSet=$keep"
  fi
} > "$root/etc/systemd/system/moecached.service.d/test.conf"
inside systemctl daemon-reload

# Socket activation: the socket listens, the service waits for a client.
inside systemctl enable --now moecached.socket > /dev/null 2>&1 || fail "systemctl enable --now moecached.socket"
[ "$(inside systemctl is-active moecached.socket)" = active ] || fail "moecached.socket is not active"
[ "$(inside systemctl is-active moecached.service)" = inactive ] || fail "the service started before any client"
inside timeout 20 moecache-client-demo /var/lib/moecache-models/m.gguf --seconds 1 --wait-ready 10 > "$t/client.log" 2>&1 ||
  { cat "$t/client.log"; fail "a client could not connect through the socket unit"; }
started() { [ "$(prop ActiveState)" = active ]; }
until_ok 20 started || fail "the client's connect did not start the service"
echo "socket activation: a client's connect started moecached ($(prop Type), $(prop ActiveState)/$(prop SubState))"
[ "$(prop Type)" = notify ] || fail "Type=$(prop Type)"
inside journalctl -b --no-pager -u moecached.service | grep -q 'moecached running' || fail "no 'moecached running' in the journal"

# The hardened unit locks, prefetches, loads its BPF programs.
pid=$(prop MainPID)
vmlck() { inside awk '/^VmLck:/ { print $2 }' /proc/$pid/status; }
locked() { [ "$(vmlck)" -ge $((12 * 1024)) ]; }  # the pinned experts: 13 MiB
until_ok 30 locked || fail "the daemon locked $(vmlck) KiB"
vmlck=$(vmlck)
status=$(inside moecachectl status 2>&1) || { echo "$status"; fail "moecachectl status"; }
echo "$status" | grep -Eiq 'prefetch' || { echo "$status"; fail "moecachectl status shows no prefetch"; }
journal=$(inside journalctl -b --no-pager -u moecached.service)
if grep -q 'page-cache telemetry on' <<<"$journal"; then bpf=on
elif [[ " $missing " == *" CAP_BPF "* || " $missing " == *" CAP_PERFMON "* ]]; then bpf="off (this host cannot grant CAP_BPF/CAP_PERFMON)"
else echo "$journal" | grep -i telemetry; fail "the BPF programs did not load under the unit's capabilities"
fi
echo "hardened unit: VmLck $((vmlck / 1024)) MiB, BPF page-cache telemetry $bpf, caps: $(inside grep CapEff /proc/$pid/status | cut -f2)"

# systemctl reload re-reads the configuration.
conf 48MiB
inside systemctl reload moecached.service || fail "systemctl reload"
reloaded() { inside journalctl -b --no-pager -u moecached.service | grep -q 'lock budget now 48 MiB'; }
until_ok 20 reloaded || fail "the reload did not take the new budget"
[ "$(prop MainPID)" = "$pid" ] || fail "the reload restarted the daemon"
echo "reload: the new lock budget (48 MiB) taken, same PID $pid"

# The watchdog: a stopped daemon sends no pings; systemd kills it and starts another.
restarts=$(prop NRestarts)
inside sh -c "kill -STOP $pid"
restarted() { [ "$(prop MainPID)" != "$pid" ] && [ "$(prop MainPID)" != 0 ] && [ "$(prop ActiveState)" = active ]; }
until_ok 30 restarted || fail "a stopped daemon was not restarted by the watchdog"
inside journalctl -b --no-pager -u moecached.service | grep -qi 'watchdog timeout' || fail "no watchdog timeout in the journal"
echo "watchdog: the stopped daemon (PID $pid) was restarted as PID $(prop MainPID), NRestarts $restarts -> $(prop NRestarts)"

# The exposure of the live unit.
score=$(inside systemd-analyze security --no-pager moecached.service | sed -n 's/.*Overall exposure level for moecached.service: \([0-9.]*\).*/\1/p')
[ -n "$score" ] || fail "systemd-analyze security gave no score"
awk -v s="$score" -v l="$limit" 'BEGIN { exit !(s <= l) }' || fail "exposure $score is above $limit"
echo "systemd-analyze security (live): exposure $score (at most $limit)"
echo "PASS"
