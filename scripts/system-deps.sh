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
#   containerd, runc, ctr        <- apt `containerd runc` (the container runtime of the real node,
#   CNI bridge/host-local/loopback  devtools/weightroll_dev/realnode; no service is started)
#                                <- apt `containernetworking-plugins` (/usr/lib/cni)
#   ip, gcc                      <- apt `iproute2 gcc libc6-dev` (its network namespace; its
#                                   static pause image)
#
# Needs root (or passwordless sudo). Without either it prints what is missing and exits 0, so
# tests that need the tools skip with a reason instead of CI failing here.
#
# apt's own output goes to a log (scripts/quietly.sh): one line says what is installed and
# `… done`, or `… failed` followed by the log's tail (exit status non-zero, so CI fails here).
# WEIGHTROLL_VERBOSE=1 shows apt's output.
# Details and measured costs: ../shared/design/tooling.md §1, §5.
set -euo pipefail
# shellcheck source=scripts/quietly.sh
source "$(dirname "$0")/quietly.sh"

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
need_tools=()
# need TOOL PACKAGE: install PACKAGE (apt) unless TOOL is on PATH.
need() {
  command -v "$1" >/dev/null 2>&1 && return
  need_tools+=("$1")
  need_pkgs+=("$2")
}
need promtool prometheus
need go golang-go
if [ ! -d /usr/share/gocode/src/github.com/modern-go/reflect2 ]; then
  need_tools+=(reflect2)
  need_pkgs+=(golang-github-modern-go-reflect2-dev)
fi
need etcd etcd-server
need etcdctl etcd-client
need openssl openssl
need make make
need kubectl kubernetes-client
need curl curl
need containerd containerd
need runc runc
need ip iproute2
need gcc gcc
if [ ! -x /usr/lib/cni/bridge ]; then
  need_tools+=(cni-plugins)
  need_pkgs+=(containernetworking-plugins)
fi
if [ ! -f /usr/include/stdio.h ]; then
  need_tools+=(libc-headers)
  need_pkgs+=(libc6-dev)
fi

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

# Each step returns on failure itself: quietly runs it behind `||`, where `set -e` is off.
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update -qq || return
  if [ ${#need_pkgs[@]} -gt 0 ]; then
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" || return
  fi
}

what=("${need_tools[@]}")
if [ "$src_added" = 1 ]; then
  what+=("deb-src entries")
fi
summary=$(printf '%s, ' "${what[@]}")
quietly "system-deps: installing system packages (${summary%, })" apt_install
