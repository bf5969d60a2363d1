#!/usr/bin/env bash
# Installs everything moecache needs to build, test and run its demo, from Debian's packages and
# the npm registry. Idempotent: a second run on a ready machine installs nothing and asks no registry.
set -euo pipefail

top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

debs=(
  build-essential cmake ninja-build pkg-config git
  clang llvm libclang-rt-14-dev clang-format
  libbpf-dev bpftool linux-libc-dev
  liburing-dev libnuma-dev
  libsdbus-c++-dev libsdbus-c++-bin libsystemd-dev
  libfmt-dev libexpected-dev nlohmann-json3-dev libtomlplusplus-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev
  nodejs npm
  fio vmtouch bc curl dbus jq zsh fish
  prometheus
  systemd
  systemd-container debootstrap patchelf groff-base
  podman buildah runc busybox-static file
)

# kubectl (for `kubectl kustomize`): Debian's kubernetes-client, unless one is installed already.
command -v kubectl >/dev/null || debs+=(kubernetes-client)

missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# nodejs/npm may come from outside Debian's packages (a newer Node is fine): accept the binaries.
if command -v node >/dev/null && command -v npm >/dev/null; then
  filtered=()
  for p in "${missing[@]}"; do [[ $p == nodejs || $p == npm ]] || filtered+=("$p"); done
  missing=("${filtered[@]}")
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "moecache setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# node-llama-cpp, the reference GGUF runtime for machines without a GPU. Pinned; CPU build only.
node_dir="$top/tools/node"
want=$(node -p "require('$node_dir/package.json').dependencies['node-llama-cpp']")
have=$(node -p "try { require('$node_dir/node_modules/node-llama-cpp/package.json').version } catch (e) { '' }")
if [ "$have" != "$want" ] || [ ! -d "$node_dir/node_modules/@node-llama-cpp/linux-x64" ]; then
  echo "moecache setup: installing node-llama-cpp $want"
  (cd "$node_dir" && NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --omit=optional --no-package-lock \
      --no-audit --no-fund --ignore-scripts --loglevel=error)
fi

# The Kubernetes API schemas that check deploy/kubernetes (tests/k8s/validate.mjs). Pinned.
k8s_dir="$top/tests/k8s"
want=$(node -p "require('$k8s_dir/package.json').dependencies['kubernetes-models']")
have=$(node -p "try { require('$k8s_dir/node_modules/kubernetes-models/package.json').version } catch (e) { '' }")
if [ "$have" != "$want" ] || [ ! -d "$k8s_dir/node_modules/@kubernetes-models/prometheus-operator" ]; then
  echo "moecache setup: installing the Kubernetes schemas (kubernetes-models $want)"
  (cd "$k8s_dir" && npm install --no-package-lock --no-audit --no-fund --ignore-scripts --loglevel=error)
fi
