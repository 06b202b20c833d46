#!/usr/bin/env bash
# Install the system packages the cluster and chart test tiers need on a fresh Debian (bookworm)
# machine. Idempotent: when everything is already present it returns at once without touching apt.
#
#   promtool                     <- apt `prometheus` (alert rule checks and unit tests)
#   go, reflect2 1.0.2           <- apt `golang-go golang-github-modern-go-reflect2-dev`
#                                   (building kube-apiserver 1.20.2, see scripts/kube-apiserver.sh)
#   etcd                         <- apt `etcd-server etcd-client`
#   deb-src entries              <- so `apt-get source kubernetes` can fetch the apiserver source
#   openssl                      <- service-account signing key of the test apiserver
#   kubectl                      <- apt `kubernetes-client` (1.20, matching the apiserver) when no
#                                   kubectl is on PATH (the demo and the cluster tests call it)
#
# Needs root (or passwordless sudo). Without either it prints what is missing and exits 0, so
# tests that need the tools skip with a reason instead of CI failing here.
# Details and measured costs: ../shared/design/tooling.md §1, §5.
set -euo pipefail

SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "system-deps: not root and no passwordless sudo; skipping apt installs" >&2
    exit 0
  fi
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: no apt-get (not Debian?); install promtool, go, etcd yourself" >&2
  exit 0
fi

need_pkgs=()
command -v promtool >/dev/null 2>&1 || need_pkgs+=(prometheus)
command -v go >/dev/null 2>&1 || need_pkgs+=(golang-go)
[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] ||
  need_pkgs+=(golang-github-modern-go-reflect2-dev)
command -v etcd >/dev/null 2>&1 || need_pkgs+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_pkgs+=(etcd-client)
command -v openssl >/dev/null 2>&1 || need_pkgs+=(openssl)
command -v make >/dev/null 2>&1 || need_pkgs+=(make)
command -v kubectl >/dev/null 2>&1 || need_pkgs+=(kubernetes-client)
command -v curl >/dev/null 2>&1 || need_pkgs+=(curl)

# deb-src: derive a deb-src sources file from the deb822 one (tooling.md §1 step 1).
src_added=0
src_file=/etc/apt/sources.list.d/debian-src.sources
if [ ! -f "$src_file" ] && ! grep -rqsE '^(Types:.*deb-src|deb-src )' \
  /etc/apt/sources.list /etc/apt/sources.list.d/; then
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources |
      "${SUDO[@]}" tee "$src_file" >/dev/null
  elif [ -f /etc/apt/sources.list ]; then
    grep -E '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' |
      "${SUDO[@]}" tee /etc/apt/sources.list.d/debian-src.list >/dev/null
  fi
  src_added=1
fi

if [ ${#need_pkgs[@]} -eq 0 ] && [ "$src_added" = 0 ]; then
  echo "system-deps: everything present"
  exit 0
fi

echo "system-deps: installing ${need_pkgs[*]:-(none)}; deb-src added: $src_added"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
if [ ${#need_pkgs[@]} -gt 0 ]; then
  "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}"
fi
echo "system-deps: done"
