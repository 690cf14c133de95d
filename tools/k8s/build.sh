#!/usr/bin/env bash
# Build the upstream Kubernetes control plane used by the k8s-marked tests and `kvfleet dev cluster`:
# kube-apiserver, kube-controller-manager, kube-scheduler (tools/k8s), etcd (tools/etcd), kwok
# (tools/kwok) and the helm CLI (tools/helm), from Go modules through the Go module proxy. Nothing is
# committed: binaries go to a cache outside the repository keyed by the Kubernetes version and a hash
# of the go.sum files and this script, and a complete cache is reused as it is (seconds). Prints
# progress; fails loudly with the reason.
#
# Output: the cache's bin/ folder on the last line of stdout.
# Env: KVFLEET_K8S_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/kvfleet/k8s).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tools="$(dirname "$here")"
version="$(tr -d '[:space:]' < "$here/VERSION")"
command -v go >/dev/null 2>&1 || { echo "k8s build: FAILED: no 'go' on PATH (Go >= 1.26 is needed)" >&2; exit 1; }
key="$version-$(cat "$here/go.sum" "$tools/etcd/go.sum" "$tools/kwok/go.sum" "$tools/helm/go.sum" "$here/build.sh" | sha256sum | cut -c1-12)"
root="${KVFLEET_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/k8s}"
out="$root/$key"
if [ -f "$out/.complete" ]; then
  echo "$out/bin"
  exit 0
fi
mkdir -p "$out/bin"
log="$out/build.log"
: > "$log"
start=$(date +%s)
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false

# The version stamps upstream's hack/lib/version.sh sets: without them /version says
# v0.0.0-master and Helm's kubeVersion checks and kubectl's skew checks misbehave.
minor="$(echo "$version" | cut -d. -f2)"
date_utc="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags="$ldflags -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date_utc"
done

step() {  # step NAME MODULE_DIR PACKAGE [LDFLAGS]
  local name=$1 dir=$2 pkg=$3 flags=${4:-"-s -w"} t0
  if [ -x "$out/bin/$name" ]; then echo "k8s build: $name already built"; return; fi
  t0=$(date +%s)
  echo "k8s build: building $name ($pkg) ..." >&2
  if ! (cd "$dir" && go build -trimpath -ldflags "$flags" -o "$out/bin/$name.tmp" "$pkg") >>"$log" 2>&1; then
    echo "k8s build: FAILED building $name; the last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  mv "$out/bin/$name.tmp" "$out/bin/$name"
  echo "k8s build: $name done in $(( $(date +%s) - t0 )) s" >&2
}

step etcd "$tools/etcd" go.etcd.io/etcd/server/v3
step kube-apiserver "$here" k8s.io/kubernetes/cmd/kube-apiserver "$ldflags"
step kube-controller-manager "$here" k8s.io/kubernetes/cmd/kube-controller-manager "$ldflags"
step kube-scheduler "$here" k8s.io/kubernetes/cmd/kube-scheduler "$ldflags"
step kwok "$tools/kwok" sigs.k8s.io/kwok/cmd/kwok
# kwok's own "fast" stages (nodes Ready with leases, pods Ready at once, deleted at once), taken
# from the pinned module so they always match the binary.
kwok_dir="$(cd "$tools/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
for stage in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  cat "$kwok_dir/kustomize/stage/$stage"; echo "---"
done > "$out/kwok-stages.yaml"
# The Prometheus Operator's own ServiceMonitor and PrometheusRule CRDs (the chart creates both
# kinds), from its pinned Go module: the chart installs against the real schemas.
promop=$(cd / && go mod download -json github.com/prometheus-operator/prometheus-operator@v0.85.0 \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
mkdir -p "$out/crds"
for kind in servicemonitors prometheusrules; do
  cp "$promop/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$out/crds/"
done
helm_version="$(cd "$tools/helm" && go list -m -f '{{.Version}}' helm.sh/helm/v4)"
step helm "$tools/helm" helm.sh/helm/v4/cmd/helm "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version"

secs=$(( $(date +%s) - start ))
{
  echo "version=$version"
  echo "build_seconds=$secs"
  echo "bin_bytes=$(du -sb "$out/bin" | cut -f1)"
  echo "go_cache_bytes=$(du -sb "$(go env GOCACHE)" 2>/dev/null | cut -f1)"
  echo "go_modcache_bytes=$(du -sb "$(go env GOMODCACHE)" 2>/dev/null | cut -f1)"
  echo "nproc=$(nproc)"
} > "$out/build-info.txt"
touch "$out/.complete"
echo "k8s build: complete in $secs s ($(du -sh "$out/bin" | cut -f1) of binaries)" >&2
echo "$out/bin"
