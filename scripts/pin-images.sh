#!/usr/bin/env bash
# Pin the Dockerfile's base images by digest, or check that they are pinned.
#
# Each base image is an ARG preceded by a comment naming the tag it follows:
#     # pin: python:3.11-slim-bookworm
#     ARG BASE=python:3.11-slim-bookworm@sha256:<64 hex>
# `scripts/pin-images.sh` resolves every such tag to its current digest and rewrites the ARG
# line (`IMAGE:TAG@DIGEST`; the tag stays readable, the digest decides what is pulled).
# `scripts/pin-images.sh --check` rewrites nothing and fails (exit 1), naming each ARG that is
# not pinned to a digest of the tag in its comment.
#
# Resolving needs a registry: skopeo (`skopeo inspect`), crane or `docker buildx imagetools`,
# whichever is installed; PIN_RESOLVER=CMD replaces them (CMD IMAGE:TAG prints the digest; the
# tests use a fake one, since no registry is reachable there).
# Usage: scripts/pin-images.sh [--check] [DOCKERFILE]   (default: the repository's Dockerfile)
set -euo pipefail
check=0
if [[ "${1:-}" == "--check" ]]; then check=1; shift; fi
file=${1:-"$(dirname "$0")/../Dockerfile"}

resolve() {
  if [[ -n "${PIN_RESOLVER:-}" ]]; then
    $PIN_RESOLVER "$1"
  elif command -v skopeo >/dev/null; then
    skopeo inspect --format '{{.Digest}}' "docker://$1"
  elif command -v crane >/dev/null; then
    crane digest "$1"
  elif command -v docker >/dev/null; then
    docker buildx imagetools inspect --format '{{json .Manifest.Digest}}' "$1" | tr -d '"'
  else
    echo "pin-images: no resolver (install skopeo or crane, or set PIN_RESOLVER)" >&2
    return 1
  fi
}

out=$(mktemp)
trap 'rm -f "$out"' EXIT
pending="" bad=0
while IFS= read -r line || [[ -n "$line" ]]; do
  if [[ "$line" =~ ^#\ pin:\ ([^[:space:]]+)[[:space:]]*$ ]]; then
    pending=${BASH_REMATCH[1]}
  elif [[ -n "$pending" ]]; then
    if [[ ! "$line" =~ ^ARG\ ([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
      echo "pin-images: '# pin: $pending' is not followed by an ARG line" >&2
      exit 2
    fi
    name=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    if (( check )); then
      if [[ ! "$value" =~ ^${pending//./\\.}@sha256:[0-9a-f]{64}$ ]]; then
        echo "pin-images: ARG $name=$value is not $pending pinned by digest" >&2
        bad=1
      fi
    else
      digest=$(resolve "$pending")
      if [[ ! "$digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
        echo "pin-images: $pending resolved to '$digest', not a sha256 digest" >&2
        exit 1
      fi
      line="ARG $name=$pending@$digest"
      echo "pin-images: $name -> $pending@$digest" >&2
    fi
    pending=""
  fi
  printf '%s\n' "$line" >> "$out"
done < "$file"
if (( check )); then exit "$bad"; fi
cat "$out" > "$file"
