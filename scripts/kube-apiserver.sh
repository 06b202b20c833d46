#!/usr/bin/env bash
# A real Kubernetes API server on loopback for the cluster test tier: kube-apiserver 1.20.2 built
# from Debian's `kubernetes` source package, plus etcd, with RBAC authorization and static tokens.
#
# Usage:
#   scripts/kube-apiserver.sh build     # build once into the cache (≈9–17 min on 2 cores), then no-op;
#                                       # kubelet, controller-manager and scheduler are built beside it
#   scripts/kube-apiserver.sh start     # start etcd + apiserver; prints the kubeconfig path
#   scripts/kube-apiserver.sh stop      # stop both (by the PIDs recorded at start)
#   scripts/kube-apiserver.sh status    # exit 0 when the apiserver answers /readyz
#   scripts/kube-apiserver.sh path      # print the kube-apiserver binary path (exit 1 if not built)
#
# Environment (all optional):
#   WEIGHTROLL_KUBE_CACHE   cache dir       default ${XDG_CACHE_HOME:-$HOME/.cache}/weightroll/kube
#   WEIGHTROLL_KUBE_RUN     run/state dir   default $WEIGHTROLL_KUBE_CACHE/run
#   ETCD_PORT (23790), ETCD_PEER_PORT (23800), ETCD_METRICS_PORT (23810), APISERVER_PORT (16443)
#   OPERATOR_NAMESPACE (weightroll-system), OPERATOR_SERVICEACCOUNT (weightroll-operator):
#       identity of the operator's static token; it matches the chart's ServiceAccount for the
#       release name `weightroll`, so RBAC bindings from the chart apply to it.
#   KEEP_BUILD=1            keep the 1.4 GB build tree (gopath + go cache) for fast relinks
#   APISERVER_EXTRA_ARGS    appended to the kube-apiserver command line (word-split)
#   NODE_NAME               also a static token for the kubelet of node NODE_NAME
#                           (system:node:NODE_NAME in system:nodes), written to kubeconfig-node
#
# `start` writes into the run dir: kubeconfig (admin, system:masters), kubeconfig-operator (the
# operator ServiceAccount identity), tokens.env (ADMIN_TOKEN, OPERATOR_TOKEN, OPERATOR_USER),
# logs and PIDs. Everything binds to 127.0.0.1.
#
# The build follows ../shared/design/tooling.md §1: GOPATH mode (module mode fails with vendor/),
# reflect2 swapped for Debian's 1.0.2 (1.0.1 crashes on Go >= 1.18 at the first CR create), and
# the OpenAPI definitions generated before building. A fourth fix, found here: with Go >= 1.19 the
# vendored go-openapi type validator rejects every "", 0 and false in a custom resource as null
# (`status.conditions.message in body must be of type string: "null"`); it is patched back to
# upstream's meaning (only a real null). System packages: scripts/system-deps.sh.
#
# Limitations: `start` runs no controller-manager, scheduler or kubelet — pods stay Pending unless
# a test plays kubelet, and the `default` ServiceAccount is not created (the real node of
# devtools/weightroll_dev/realnode runs the built ones); Kubernetes 1.20 has no CEL.
set -euo pipefail

K8S_VERSION=v1.20.2
# Bump when the build recipe changes: a cached binary from another recipe is rebuilt. The node
# binaries (kubelet, controller-manager, scheduler) are built in the same run as the apiserver:
# the run deletes its Go cache afterwards, and Go's cache only helps a build in the same tree.
RECIPE="v1.20.2 reflect2-1.0.2 gopath openapi-gen openapi-zero-values-2 node-binaries-1"
BINARIES="kube-apiserver kubelet kube-controller-manager kube-scheduler"
CACHE=${WEIGHTROLL_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightroll/kube}
RUN=${WEIGHTROLL_KUBE_RUN:-$CACHE/run}
BIN=$CACHE/bin/kube-apiserver
ETCD_PORT=${ETCD_PORT:-23790}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-23800}
ETCD_METRICS_PORT=${ETCD_METRICS_PORT:-23810}
APISERVER_PORT=${APISERVER_PORT:-16443}
OPERATOR_NAMESPACE=${OPERATOR_NAMESPACE:-weightroll-system}
OPERATOR_SERVICEACCOUNT=${OPERATOR_SERVICEACCOUNT:-weightroll-operator}

log() { printf 'kube-apiserver.sh: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

binary_built() { # path
  [ -x "$1" ] && [ "$(cat "$1.recipe" 2>/dev/null)" = "$RECIPE" ] &&
    "$1" --version 2>/dev/null | grep -qx "Kubernetes $K8S_VERSION"
}

is_built() {
  local b
  for b in $BINARIES; do
    binary_built "$CACHE/bin/$b" || return 1
  done
}

cmd_build() {
  if is_built; then
    log "already built: $BIN"
    return 0
  fi
  command -v go >/dev/null || die "go not found (run scripts/system-deps.sh)"
  [ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] ||
    die "Debian reflect2 missing (apt golang-github-modern-go-reflect2-dev)"
  mkdir -p "$CACHE"
  exec 9>"$CACHE/build.lock"
  flock 9 # another build in progress: wait for it, then re-check
  if is_built; then
    log "built by a concurrent run: $BIN"
    return 0
  fi
  local t0 W src
  t0=$(date +%s)
  W=$CACHE/build
  rm -rf "$W/gopath"
  mkdir -p "$W/src" "$CACHE/bin"
  (
    cd "$W/src"
    if ! ls kubernetes_*.orig.tar.gz >/dev/null 2>&1; then
      log "fetching Debian source package kubernetes (needs deb-src entries)"
      apt-get source --download-only kubernetes >/dev/null
    fi
    tar xzf kubernetes_*.orig.tar.gz
  )
  src=$(find "$W/src" -maxdepth 1 -type d -name 'kubernetes-1.20*' | head -1)
  [ -n "$src" ] || die "unpacked source not found under $W/src"
  mkdir -p "$W/gopath/src/k8s.io"
  mv "$src" "$W/gopath/src/k8s.io/kubernetes"
  cd "$W/gopath/src/k8s.io/kubernetes"

  # Fix 1: reflect2 1.0.1 is incompatible with Go >= 1.18.
  rm -rf vendor/github.com/modern-go/reflect2
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2

  # Fix 4: go-openapi/validate compares reflect.Value structs to spot zero values; since Go 1.19
  # reflect.Zero and a zero value boxed in an interface share runtime.zeroVal, so "", 0 and false
  # compared equal to "zero" and were rejected as null (real 1.20 builds, Go 1.15, never did).
  # apiextensions uses kube-openapi's fork of the validator; patch both copies.
  local tv zero='reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data))'
  for tv in vendor/k8s.io/kube-openapi/pkg/validation/validate/type.go \
    vendor/github.com/go-openapi/validate/type.go; do
    grep -qF "$zero" "$tv" || die "unexpected $tv: zero-value check not found"
    sed -i "s/if data == nil || $zero {/if data == nil {/" "$tv"
    ! grep -qF "$zero" "$tv" || die "could not patch $tv"
  done

  # Fix 2: GOPATH mode, offline.
  export GO111MODULE=off GOPATH="$W/gopath" GOPROXY=off GOFLAGS="" CGO_ENABLED=0 GOCACHE="$W/gocache"

  # Fix 3: generate pkg/generated/openapi (upstream does it in Makefile.generated_files).
  log "generating OpenAPI definitions"
  go build -o "$W/openapi-gen" k8s.io/kubernetes/vendor/k8s.io/kube-openapi/cmd/openapi-gen
  find -L pkg cmd plugin vendor third_party -name '*.go' -type f -print0 2>/dev/null |
    xargs -0 grep -l '^// *+k8s:' 2>/dev/null |
    xargs grep -l '+k8s:openapi-gen=' |
    grep -vE '^vendor/k8s.io/(code-generator|sample-apiserver)/' |
    xargs -n1 dirname | LC_ALL=C sort -u | sed 's#^#k8s.io/kubernetes/#' |
    paste -sd, - >"$W/openapi_inputs" || true
  [ "$(tr , '\n' <"$W/openapi_inputs" | wc -l)" -ge 70 ] || die "too few openapi-gen inputs"
  "$W/openapi-gen" -i "$(cat "$W/openapi_inputs")" -p k8s.io/kubernetes/pkg/generated/openapi \
    -O zz_generated.openapi -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt \
    -r "$W/violations.report"

  local ldf="-s -w" v total
  for v in k8s.io/kubernetes/vendor/k8s.io/component-base/version \
    k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=20 -X $v.gitTreeState=clean"
  done
  local pkgs="" b
  for b in $BINARIES; do
    pkgs="$pkgs k8s.io/kubernetes/cmd/$b"
  done
  # shellcheck disable=SC2086
  total=$(go list -deps $pkgs 2>/dev/null | LC_ALL=C sort -u | wc -l) || total=0
  log "building $BINARIES: $total packages (several minutes; progress every 10 %)"
  # One `go build` for all four: shared packages compile once. `-v` names each package as it is
  # compiled: count them for a progress line, and pass every other line (compiler errors) through.
  rm -rf "$CACHE/bin.tmp"
  mkdir -p "$CACHE/bin.tmp"
  # shellcheck disable=SC2086
  go build -v -ldflags "$ldf" -o "$CACHE/bin.tmp/" $pkgs 2>&1 |
    awk -v total="$total" -v t0="$(date +%s)" '
      /^[A-Za-z0-9._~\/-]+$/ {
        n++
        if (total > 0 && n * 10 >= (step + 1) * total && step < 9) {
          step = int(n * 10 / total)
          printf "kube-apiserver.sh: compiled %d/%d packages (%d %%), %d s\n", n, total, \
            100 * n / total, systime() - t0 > "/dev/stderr"
          fflush("/dev/stderr")
        }
        next
      }
      { print > "/dev/stderr" }'
  log "linking done"
  for b in $BINARIES; do
    [ -x "$CACHE/bin.tmp/$b" ] || die "go build left no $b"
  done
  for b in $BINARIES; do
    mv "$CACHE/bin.tmp/$b" "$CACHE/bin/$b"
    echo "$RECIPE" >"$CACHE/bin/$b.recipe"
  done
  rmdir "$CACHE/bin.tmp"
  cd "$CACHE"
  is_built || die "a built binary does not report $K8S_VERSION"
  if [ "${KEEP_BUILD:-0}" != 1 ]; then
    rm -rf "$W/gopath" "$W/gocache" # ≈1.4 GB; the orig tarball stays for a rebuild
  fi
  log "built $BINARIES in $(($(date +%s) - t0)) s"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_kubeconfig() { # file user token
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: weightroll-test
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    insecure-skip-tls-verify: true
users:
- name: $2
  user:
    token: $3
contexts:
- name: weightroll-test
  context:
    cluster: weightroll-test
    user: $2
current-context: weightroll-test
EOF
  chmod 600 "$1"
}

cmd_status() {
  [ -f "$RUN/tokens.env" ] || return 1
  # shellcheck disable=SC1091
  . "$RUN/tokens.env"
  curl -skf -m 2 -H "Authorization: Bearer $ADMIN_TOKEN" \
    "https://127.0.0.1:$APISERVER_PORT/readyz" >/dev/null 2>&1
}

cmd_start() {
  is_built || die "kube-apiserver not built; run: $0 build"
  command -v etcd >/dev/null || die "etcd not found (run scripts/system-deps.sh)"
  mkdir -p "$RUN"
  if pid_alive "$RUN/apiserver.pid" && cmd_status; then
    log "already running"
    echo "$RUN/kubeconfig"
    return 0
  fi
  cmd_stop 2>/dev/null || true
  rm -rf "$RUN/etcd"
  umask 077
  setsid etcd --name weightroll-test --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "weightroll-test=http://127.0.0.1:$ETCD_PEER_PORT" \
    --listen-metrics-urls "http://127.0.0.1:$ETCD_METRICS_PORT" \
    >"$RUN/etcd.log" 2>&1 </dev/null &
  echo $! >"$RUN/etcd.pid"

  if [ ! -f "$RUN/sa.key" ]; then
    openssl genrsa -out "$RUN/sa.key" 2048 2>/dev/null
    openssl rsa -in "$RUN/sa.key" -pubout -out "$RUN/sa.pub" 2>/dev/null
  fi
  local admin op user
  admin=$(openssl rand -hex 16)
  op=$(openssl rand -hex 16)
  user="system:serviceaccount:$OPERATOR_NAMESPACE:$OPERATOR_SERVICEACCOUNT"
  printf '%s\n' "$admin,admin,admin-uid,system:masters" \
    "$op,$user,operator-uid,\"system:serviceaccounts,system:serviceaccounts:$OPERATOR_NAMESPACE\"" \
    >"$RUN/tokens.csv"
  printf 'ADMIN_TOKEN=%s\nOPERATOR_TOKEN=%s\nOPERATOR_USER=%s\n' "$admin" "$op" "$user" \
    >"$RUN/tokens.env"
  if [ -n "${NODE_NAME:-}" ]; then
    # A kubelet's identity for the Node authorizer (devtools/weightroll_dev/realnode).
    local node
    node=$(openssl rand -hex 16)
    printf '%s\n' "$node,system:node:$NODE_NAME,node-uid,system:nodes" >>"$RUN/tokens.csv"
    printf 'NODE_TOKEN=%s\n' "$node" >>"$RUN/tokens.env"
    write_kubeconfig "$RUN/kubeconfig-node" "system:node:$NODE_NAME" "$node"
  fi
  write_kubeconfig "$RUN/kubeconfig" admin "$admin"
  write_kubeconfig "$RUN/kubeconfig-operator" "$user" "$op"

  # shellcheck disable=SC2086
  setsid "$BIN" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$APISERVER_PORT" \
    --cert-dir="$RUN/certs" --token-auth-file="$RUN/tokens.csv" \
    --authorization-mode=Node,RBAC \
    --service-account-key-file="$RUN/sa.pub" --service-account-signing-key-file="$RUN/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc \
    --service-cluster-ip-range=10.96.0.0/24 --insecure-port=0 \
    --enable-priority-and-fairness=false --endpoint-reconciler-type=none \
    ${APISERVER_EXTRA_ARGS:-} >"$RUN/apiserver.log" 2>&1 </dev/null &
  echo $! >"$RUN/apiserver.pid"

  local i
  for i in $(seq 1 120); do
    if cmd_status; then
      log "ready after $((i / 4)) s on https://127.0.0.1:$APISERVER_PORT"
      echo "$RUN/kubeconfig"
      return 0
    fi
    pid_alive "$RUN/apiserver.pid" || break
    pid_alive "$RUN/etcd.pid" || break
    sleep 0.25
  done
  log "apiserver did not become ready; last log lines:"
  tail -n 20 "$RUN/apiserver.log" >&2 || true
  tail -n 5 "$RUN/etcd.log" >&2 || true
  cmd_stop || true
  return 1
}

stop_pid() { # pidfile
  local pid
  [ -f "$1" ] || return 0
  pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.25
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

cmd_stop() {
  stop_pid "$RUN/apiserver.pid"
  stop_pid "$RUN/etcd.pid"
}

case "${1:-}" in
build) cmd_build ;;
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
path)
  is_built || exit 1
  echo "$BIN"
  ;;
*)
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
  ;;
esac
