#!/usr/bin/env bash
# Everything `make demo` needs before it starts, on a fresh machine as fast as 2 cores allow:
# the system packages (go, etcd, kubectl; as root), then the local kube-apiserver build (once,
# cached in ~/.cache/weightroll/kube) *in the background* while scripts/bootstrap.sh installs
# .venv/ (vLLM), then waits for both. Measured on a fresh 2-core machine: ≈4 min for both in
# parallel instead of ≈6 one after the other. A second run finds both done and returns at once.
#
# Without root the apt step is skipped with a message; the demo then names what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# Idempotent and quick when everything is present; one line for apt (its log only on failure).
bash scripts/system-deps.sh
build_pid=
if ! bash scripts/kube-apiserver.sh path >/dev/null 2>&1; then
  if command -v go >/dev/null 2>&1; then
    step "Building kube-apiserver 1.20.2 in the background (once, with the real node's binaries; ≈9–17 min on 2 cores, cached)"
    # Its progress lines are prefixed; pip's output goes on in between.
    (bash scripts/kube-apiserver.sh build 2>&1 | sed -u 's/^/    [kube-apiserver build] /') &
    build_pid=$!
  fi
fi

bash scripts/bootstrap.sh

if [ -n "$build_pid" ]; then
  step "Waiting for the kube-apiserver build"
  if ! wait "$build_pid"; then
    echo "demo: the kube-apiserver build failed (its output is above); rerun: bash scripts/kube-apiserver.sh build" >&2
    exit 1
  fi
fi
