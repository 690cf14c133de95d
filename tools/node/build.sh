#!/usr/bin/env bash
# Build the real node's binaries: kubelet and kube-proxy from the control plane's own
# k8s.io/kubernetes pin (tools/node/go.mod carries tools/k8s's version and staging replaces),
# crictl (tools/crictl) and the pod sandbox's pause process (tools/node/pause). A cache of its own,
# keyed by the Kubernetes version and a hash of these go.sum files, the pause source and this
# script, so the control plane's cache (tools/k8s/build.sh) is untouched; Go's build cache shares
# the packages both use. A complete cache is reused as it is (seconds).
#
# containerd, runc and the CNI plugins come from Debian (scripts/bootstrap --with-node).
# Output: the cache's bin/ folder on the last line of stdout.
# Env: KVFLEET_NODE_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/kvfleet/node).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tools="$(dirname "$here")"
version="$(tr -d '[:space:]' < "$tools/k8s/VERSION")"
command -v go >/dev/null 2>&1 || { echo "node build: FAILED: no 'go' on PATH (Go >= 1.26 is needed)" >&2; exit 1; }
grep -qE "^(require )?[[:space:]]*k8s.io/kubernetes $version( // indirect)?$" "$here/go.mod" \
  || { echo "node build: FAILED: tools/node/go.mod does not pin k8s.io/kubernetes $version (tools/k8s/VERSION)" >&2; exit 1; }
key="$version-$(cat "$here/go.sum" "$tools/crictl/go.sum" "$here/pause/main.go" "$here/build.sh" | sha256sum | cut -c1-12)"
root="${KVFLEET_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/node}"
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

# The same version stamps as tools/k8s/build.sh: the node reports them, and skew checks read them.
minor="$(echo "$version" | cut -d. -f2)"
date_utc="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags="$ldflags -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date_utc"
done

step() {  # step NAME MODULE_DIR PACKAGE [LDFLAGS]
  local name=$1 dir=$2 pkg=$3 flags=${4:-"-s -w"} t0
  if [ -x "$out/bin/$name" ]; then echo "node build: $name already built" >&2; return; fi
  t0=$(date +%s)
  echo "node build: building $name ($pkg) ..." >&2
  if ! (cd "$dir" && go build -trimpath -ldflags "$flags" -o "$out/bin/$name.tmp" "$pkg") >>"$log" 2>&1; then
    echo "node build: FAILED building $name; the last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  mv "$out/bin/$name.tmp" "$out/bin/$name"
  echo "node build: $name done in $(( $(date +%s) - t0 )) s" >&2
}

step pause "$here" ./pause
step crictl "$tools/crictl" sigs.k8s.io/cri-tools/cmd/crictl
step kubelet "$here" k8s.io/kubernetes/cmd/kubelet "$ldflags"
step kube-proxy "$here" k8s.io/kubernetes/cmd/kube-proxy "$ldflags"

secs=$(( $(date +%s) - start ))
{
  echo "version=$version"
  echo "build_seconds=$secs"
  echo "bin_bytes=$(du -sb "$out/bin" | cut -f1)"
  echo "nproc=$(nproc)"
} > "$out/build-info.txt"
touch "$out/.complete"
echo "node build: complete in $secs s ($(du -sh "$out/bin" | cut -f1) of binaries)" >&2
echo "$out/bin"
