#!/usr/bin/env bash
# Regenerate the hash-locked Python requirements of the two images and their SBOMs.
#
#   requirements/build.lock     setuptools + wheel, to build weightroll's wheel without isolation
#   requirements/operator.lock  weightroll's base + `operator` extra, for the operator image's
#                               Python (3.11, linux x86_64)
#   requirements/agent.lock     weightroll's base + `agent` and `signing` extras at the versions
#                               vLLM itself resolves to (the agent installs into the vLLM image's
#                               Python, 3.12), so installing it never moves a package vLLM pinned
#   sbom/{operator,agent}.cdx.json  CycloneDX 1.5 from each lock (scripts/sbom.py)
#
# The Dockerfile installs each lock with `pip install --require-hashes --no-deps`, then the
# weightroll wheel with `--no-deps`. Needs uv (pip install uv) and the package index.
# Usage: scripts/lock.sh [VLLM_VERSION]   (default: the VLLM_VERSION in the Dockerfile)
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}
VLLM_VERSION=${1:-$(sed -n 's/^ARG VLLM_VERSION=//p' Dockerfile)}
PLATFORM=x86_64-manylinux_2_28
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$UV" pip compile requirements/build.in --generate-hashes --no-header \
  --python-version 3.11 --python-platform "$PLATFORM" -o requirements/build.lock
"$UV" pip compile pyproject.toml --extra operator --generate-hashes --no-header \
  --python-version 3.11 --python-platform "$PLATFORM" -o requirements/operator.lock

# vLLM's whole environment (not installed: resolved only), then the agent's closure inside it.
echo "vllm==${VLLM_VERSION}" > "$tmp/vllm.in"
"$UV" pip compile pyproject.toml "$tmp/vllm.in" --extra agent --extra signing --no-header --no-annotate \
  --python-version 3.12 --python-platform "$PLATFORM" -o "$tmp/vllm-env.txt"
"$UV" pip compile pyproject.toml --extra agent --extra signing --generate-hashes --no-header \
  --python-version 3.12 --python-platform "$PLATFORM" -c "$tmp/vllm-env.txt" \
  -o requirements/agent.lock
sed -i "s|$tmp/vllm-env.txt|vllm==${VLLM_VERSION} (its environment, resolved, not installed)|" \
  requirements/agent.lock

mkdir -p sbom
python3 scripts/sbom.py operator requirements/operator.lock > sbom/operator.cdx.json
python3 scripts/sbom.py agent requirements/agent.lock > sbom/agent.cdx.json
