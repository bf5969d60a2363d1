#!/usr/bin/env bash
# The Kubernetes manifests (deploy/kubernetes, kustomize layout) render with `kubectl kustomize`
# and pass tests/k8s/validate.mjs: every object against the Kubernetes API schemas, and the fields
# that make the deployment work. The checker is shown to catch a broken manifest too.
# Usage: kubernetes_test.sh SOURCE_DIR      exit 77: skipped (no kubectl, no node modules)
set -euo pipefail
src=${1:?usage: kubernetes_test.sh SOURCE_DIR}
command -v kubectl >/dev/null || { echo "SKIP: kubectl is missing (Debian package kubernetes-client)"; exit 77; }
# kustomize v4 or later (kubectl 1.21+): Debian 12's kubernetes-client 1.20 has v2, which takes no
# folder among resources.
kustomize=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\).*/\1/p')
[ "${kustomize:-0}" -ge 4 ] || { echo "SKIP: kubectl's kustomize is ${kustomize:-unknown}, v4 or later is needed (kubectl 1.21+)"; exit 77; }
[ -d "$src/tests/k8s/node_modules/kubernetes-models" ] ||
  { echo "SKIP: tests/k8s's node modules are missing (scripts/setup/install-deps.sh installs them)"; exit 77; }
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
kubectl kustomize "$src/deploy/kubernetes" > "$t/rendered.yaml" 2> "$t/kustomize.err" ||
  { cat "$t/kustomize.err"; echo "FAIL: kubectl kustomize"; exit 1; }
node "$src/tests/k8s/validate.mjs" "$t/rendered.yaml" "$src/deploy/kubernetes/examples/llama-server.yaml" --source "$src"
# A manifest without IPC_LOCK, and one with a field of the wrong type: both refused.
sed 's/"IPC_LOCK", //; s/- IPC_LOCK$//' "$t/rendered.yaml" > "$t/no-ipc-lock.yaml"
if node "$src/tests/k8s/validate.mjs" "$t/no-ipc-lock.yaml" "$src/deploy/kubernetes/examples/llama-server.yaml" --source "$src" > "$t/out" 2>&1; then
  echo "FAIL: a DaemonSet without IPC_LOCK passed"; exit 1
fi
grep -q 'IPC_LOCK' "$t/out" || { cat "$t/out"; echo "FAIL: the missing IPC_LOCK was not named"; exit 1; }
# One that runs the daemon as root (no --user): refused.
sed 's/, *"--user", *"[0-9:]*"//; /- --user$/{N;d}' "$t/rendered.yaml" > "$t/root.yaml"
! grep -q -- '--user' "$t/root.yaml" || { echo "FAIL: the test could not take --user out"; exit 1; }
if node "$src/tests/k8s/validate.mjs" "$t/root.yaml" "$src/deploy/kubernetes/examples/llama-server.yaml" --source "$src" > "$t/out" 2>&1; then
  echo "FAIL: a DaemonSet running moecached as root passed"; exit 1
fi
grep -q 'its own user' "$t/out" || { cat "$t/out"; echo "FAIL: running as root was not named"; exit 1; }
sed 's/hostPID: true/hostPID: "yes"/' "$t/rendered.yaml" > "$t/bad-type.yaml"
if node "$src/tests/k8s/validate.mjs" "$t/bad-type.yaml" "$src/deploy/kubernetes/examples/llama-server.yaml" --source "$src" > "$t/out" 2>&1; then
  echo "FAIL: hostPID: \"yes\" passed the schema"; exit 1
fi
grep -q 'hostPID must be boolean' "$t/out" || { cat "$t/out"; echo "FAIL: the wrong type was not what was refused"; exit 1; }
# Pod Security: a namespace that enforces baseline refuses the DaemonSet, and says why.
sed 's/pod-security.kubernetes.io\/enforce: privileged/pod-security.kubernetes.io\/enforce: baseline/' "$t/rendered.yaml" > "$t/baseline.yaml"
if node "$src/tests/k8s/validate.mjs" "$t/baseline.yaml" "$src/deploy/kubernetes/examples/llama-server.yaml" --source "$src" > "$t/out" 2>&1; then
  echo "FAIL: the DaemonSet passed a namespace that enforces baseline"; exit 1
fi
grep -q 'Pod Security admission at baseline refuses it (hostPID' "$t/out" || { cat "$t/out"; echo "FAIL: the baseline refusal was not named"; exit 1; }
# With kube-prometheus-stack (deploy/kube-prometheus-stack: the component that labels the
# ServiceMonitor for its selector), and the base without that label checked for it.
kubectl kustomize "$src/deploy/kube-prometheus-stack" > "$t/kps.yaml" 2> "$t/kustomize.err" ||
  { cat "$t/kustomize.err"; echo "FAIL: kubectl kustomize deploy/kube-prometheus-stack"; exit 1; }
node "$src/tests/k8s/validate.mjs" "$t/kps.yaml" "$src/deploy/kubernetes/examples/llama-server.yaml" --source "$src" --release kube-prometheus-stack
if node "$src/tests/k8s/validate.mjs" "$t/rendered.yaml" "$src/deploy/kubernetes/examples/llama-server.yaml" --source "$src" --release kube-prometheus-stack > "$t/out" 2>&1; then
  echo "FAIL: the base's ServiceMonitor passed as labelled for kube-prometheus-stack"; exit 1
fi
echo "PASS: rendered, valid, Pod Security admission at the namespace's level, and a broken manifest is refused"
