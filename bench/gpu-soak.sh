#!/usr/bin/env bash
# A soak of the CUDA hook on the GPU machine: RUNS consecutive runs of stock CUDA llama.cpp with the
# hook preloaded, mixing llama-bench (prompt and generation tests in separate contexts), llama-completion
# and llama-server (one request through its HTTP API), every pinning mode (MOECACHE_CUDA_PIN), with
# and without moecached, as a user would start them one after another on one machine. Counted:
# runs, aborts (an exit other than 0, a signal, "CUDA error" on stderr), and the greedy text of each
# completion and server run against the recipe's (the same computation without the hook: it must be
# byte-identical). Each run's output stays in WORKDIR (RUN.out, RUN.err).
#
#   bench/gpu-soak.sh LLAMA_BIN [WORKDIR]
# LLAMA_BIN: a folder with llama-bench, llama-completion and llama-server of a CUDA build.
# Environment: BUNDLE (a scripts/bundle.sh directory: moecached, moecache-mkmodel, the hook), HOOK
#   (another build of the hook to soak; default the bundle's), RUNS (20), WORKLOADS (bench
#   completion server), DAEMON (both: alternate; alone; with),
#   MODES (default all register staging off: "default" leaves MOECACHE_CUDA_PIN unset),
#   POOL (25), MODEL (a model to use), else a model of bench/gpu-squeeze.sh's shape with LAYERS (16)
#   layers, TYPE (q5_K) and SEED (29), N_PREDICT (32), RUN_TIMEOUT (240 s), DEADLINE (seconds: no
#   run starts after it; the table is still printed).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/.." && pwd)
bin=$(realpath "${1:?usage: bench/gpu-soak.sh LLAMA_BIN [WORKDIR]}")
work=${2:-/var/tmp/moecache-gpu-soak}
mkdir -p "$work"
work=$(realpath "$work")
bundle=$(realpath "${BUNDLE:?BUNDLE: a scripts/bundle.sh directory}")
hook=$(realpath "${HOOK:-$bundle/lib/libmoecache-cuda.so}")
runs=${RUNS:-20}
modes=(${MODES:-default all register staging off})
pool=${POOL:-25}
n_predict=${N_PREDICT:-32}
timeout_s=${RUN_TIMEOUT:-240}
for f in "$bin/llama-bench" "$bin/llama-completion" "$bin/llama-server" "$hook" "$bundle/bin/moecached"; do
  [ -e "$f" ] || { echo "gpu-soak: $f is missing" >&2; exit 2; }
done
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

model=${MODEL:-$work/soak-${LAYERS:-16}-${TYPE:-q5_K}-s${SEED:-29}.gguf}
if [ ! -f "$model" ]; then
  "$bundle/bin/moecache-mkmodel" --output "$model" --layers "${LAYERS:-16}" --experts 128 --experts-used 8 --embd 2048 \
    --ff 1792 --preset deepseek-v4-flash --expert-type "${TYPE:-q5_K}" --seed "${SEED:-29}" >/dev/null || exit 2
fi
cat "$model" >/dev/null
prompt="the of and to in is was for on that with as by at from his her they this which or an be are the of and to"
echo "[\"$prompt\"]" > "$work/prompts.json"

dpid=
cleanup() { [ -n "$dpid" ] && kill "$dpid" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
# moecached as the service runs it beside runtimes that come and go: started once, kept. Its lock
# budget holds the model (the common GPU box): no one place, the hook's pool directed by it.
start_daemon() {
  [ -n "$dpid" ] && return 0
  model_bytes=$(stat -c %s "$model")
  cat > "$work/moecached.toml" <<TOML
[daemon]
state_dir = "$work/state"
socket = "$work/moecached.sock"
[budget]
lock = "$(( model_bytes * 5 / 4 ))"
reserve = "2GiB"
[pressure]
enabled = false
[metrics]
listen = "127.0.0.1:18476"
[dbus]
bus = "off"
[[model]]
path = "$model"
TOML
  "$bundle/bin/moecached" --config "$work/moecached.toml" > "$work/daemon.log" 2>&1 &
  dpid=$!
  for _ in $(seq 100); do grep -q 'moecached running' "$work/daemon.log" && return 0; sleep 0.1; done
  echo "gpu-soak: moecached did not start: $(tail -3 "$work/daemon.log")" >&2
}

# one NAME WORKLOAD ENV...: a run; its text (completion, server) in NAME.text, its status in NAME.rc.
one() {
  local name=$1 w=$2
  shift 2
  local rc=0
  case $w in
    bench)
      timeout "$timeout_s" env "$@" "$bin/llama-bench" -m "$model" -ngl 99 -ot exps=CPU -fa 0 -p 64 -n 16 -r 1 -o jsonl \
        > "$work/$name.out" 2> "$work/$name.err" || rc=$? ;;
    completion)
      timeout "$timeout_s" env "$@" "$bin/llama-completion" -m "$model" -ngl 99 -ot exps=CPU -fa off -c 1024 -p "$prompt" \
        -n "$n_predict" --temp 0 --ignore-eos -no-cnv --no-display-prompt --seed 1 < /dev/null \
        > "$work/$name.out" 2> "$work/$name.err" || rc=$?
      cp "$work/$name.out" "$work/$name.text" ;;
    server)
      env "$@" "$bin/llama-server" -m "$model" -ngl 99 -ot exps=CPU -fa off -c 1024 -np 1 --port 18081 --no-webui --seed 1 \
        > "$work/$name.out" 2> "$work/$name.err" &
      local spid=$! ok=0
      for _ in $(seq $(( timeout_s * 5 ))); do
        kill -0 "$spid" 2>/dev/null || break
        python3 -c 'import urllib.request,sys; urllib.request.urlopen("http://127.0.0.1:18081/health", timeout=2)' 2>/dev/null && { ok=1; break; }
        sleep 0.2
      done
      if [ $ok = 1 ] && timeout "$timeout_s" python3 "$here/serve_requests.py" http://127.0.0.1:18081 "$work/prompts.json" \
           "$work/$name.json" --n-predict "$n_predict" --raw --ban 3-258 >> "$work/$name.err" 2>&1; then
        python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0].get("text", ""), end="")' "$work/$name.json" > "$work/$name.text"
      fi
      if kill -0 "$spid" 2>/dev/null; then
        kill "$spid"
        wait "$spid" 2>/dev/null
        [ $ok = 1 ] || rc=124
      else
        wait "$spid" 2>/dev/null
        rc=$?
        [ $rc = 0 ] && rc=1  # it exited by itself: it died
      fi ;;
  esac
  echo "$rc" > "$work/$name.rc"
}

t0=$SECONDS
workloads=(${WORKLOADS:-bench completion server})
# The recipe's greedy text: the same computation without the hook.
for w in completion server; do
  [[ " ${workloads[*]} " == *" $w "* ]] && one "recipe-$w" "$w" GGML_OP_OFFLOAD_MIN_BATCH=1
done
for i in $(seq 0 $(( runs - 1 ))); do
  if [ -n "${DEADLINE:-}" ] && [ $(( SECONDS - t0 )) -ge "$DEADLINE" ]; then
    echo "gpu-soak: deadline: runs $i.. not started" >&2
    break
  fi
  w=${workloads[$(( i % ${#workloads[@]} ))]}
  mode=${modes[$(( i % ${#modes[@]} ))]}
  case ${DAEMON:-both} in
    alone) with=0 ;;
    with) with=1 ;;
    *) with=$(( (i / ${#modes[@]}) % 2 )) ;;
  esac
  # The hook's hot profile carried from run to run, as a user's restarts carry it.
  env_=(LD_PRELOAD="$hook" GGML_OP_OFFLOAD_MIN_BATCH=1 MOECACHE_CUDA_POOL="$pool%" MOECACHE_CUDA_LOG=1
        MOECACHE_CUDA_PROFILE="$work/profiles")
  [ "$mode" = default ] || env_+=(MOECACHE_CUDA_PIN="$mode")
  if [ $with = 1 ]; then
    start_daemon
    env_+=(MOECACHE_SOCKET="$work/moecached.sock")
  else
    env_+=(MOECACHE_CUDA_CLIENT=off)
  fi
  name=$(printf 'run%02d-%s-%s-%s' "$i" "$w" "$mode" "$([ $with = 1 ] && echo daemon || echo alone)")
  one "$name" "$w" "${env_[@]}"
  echo "$name rc $(cat "$work/$name.rc") $(( SECONDS - t0 )) s" >&2
done

python3 - "$work" <<'EOF'
import glob, json, os, re, sys
work = sys.argv[1]
def read(p):
    try: return open(p, errors="replace").read()
    except OSError: return None
ref = {w: read(f"{work}/recipe-{w}.text") for w in ("completion", "server")}
print("| run | rc | abort | CUDA errors | greedy text = recipe | tok/s (tg or decode) | hook's miss path said |")
print("|---|---|---|---|---|---|---|")
aborts = same = compared = n = 0
for rc_file in sorted(glob.glob(f"{work}/run*.rc")):
    name = os.path.basename(rc_file)[:-3]
    w = name.split("-")[1]
    rc = int(read(rc_file).strip() or 1)
    err = read(f"{work}/{name}.err") or ""
    cuda_errors = len(re.findall(r"CUDA error", err))
    abort = rc != 0 or cuda_errors > 0
    n += 1
    aborts += abort
    text = read(f"{work}/{name}.text")
    cell = "-"
    if w in ref and ref[w]:
        compared += 1
        ok = text == ref[w]
        same += ok
        cell = "yes" if ok else ("NO (none)" if not text else "NO")
    tps = "-"
    if w == "bench":
        for line in (read(f"{work}/{name}.out") or "").splitlines():
            try: j = json.loads(line)
            except ValueError: continue
            if j.get("n_gen"): tps = f"{j['avg_ts']:.1f}"
    else:
        m = re.findall(r"\n[^\n]*\beval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)", err)
        if m: tps = f"{int(m[-1][1]) / float(m[-1][0]) * 1000:.1f}"
    said = "; ".join(sorted(set(re.findall(r"moecache-cuda: device \d+: ([^.]*(?:slower|pageable|staging|budget)[^.]*)", err))))[:90] or "-"
    print(f"| {name} | {rc} | {'ABORT' if abort else 'no'} | {cuda_errors} | {cell} | {tps} | {said} |")
print(f"\nruns {n}, aborts {aborts}, greedy text identical to the recipe's in {same} of {compared}"
      f" (recipe texts: {', '.join(w for w in ref if ref[w]) or 'none'})")
EOF
