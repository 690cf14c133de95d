#!/usr/bin/env bash
# Build SeaweedFS's `weed` (tools/seaweedfs/go.mod pins it), the real S3-protocol server the
# weight-cache tests and benchmarks run against, from Go modules through the Go module proxy.
# Nothing is committed: the binary goes to a cache outside the repository keyed by a hash of
# go.mod, go.sum and this script, and a complete cache is reused as it is (milliseconds). Its own
# cache key (not tools/k8s's), so changing one never rebuilds the other. Fails loudly with the reason.
#
# Output: the path of the `weed` binary on the last line of stdout.
# Env: KVFLEET_SEAWEEDFS_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/kvfleet/seaweedfs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v go >/dev/null 2>&1 || { echo "seaweedfs build: FAILED: no 'go' on PATH (Go >= 1.26.6 is needed)" >&2; exit 1; }
version="$(sed -n 's#^[[:space:]]*github.com/seaweedfs/seaweedfs \(v[^ ]*\).*#\1#p' "$here/go.mod" | head -n1)"
key="${version##*-}-$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-12)"
root="${KVFLEET_SEAWEEDFS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/seaweedfs}"
out="$root/$key"
if [ -f "$out/.complete" ]; then
  echo "$out/bin/weed"
  exit 0
fi
mkdir -p "$out/bin"
log="$out/build.log"
: > "$log"
start=$(date +%s)
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
echo "seaweedfs build: building weed ($version) ..." >&2
if ! (cd "$here" && go build -trimpath -ldflags "-s -w" -o "$out/bin/weed.tmp" github.com/seaweedfs/seaweedfs/weed) >>"$log" 2>&1; then
  echo "seaweedfs build: FAILED building weed; the last lines of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
mv "$out/bin/weed.tmp" "$out/bin/weed"
secs=$(( $(date +%s) - start ))
{
  echo "version=$version"
  echo "build_seconds=$secs"
  echo "bin_bytes=$(stat -c %s "$out/bin/weed")"
  echo "nproc=$(nproc)"
} > "$out/build-info.txt"
touch "$out/.complete"
echo "seaweedfs build: complete in $secs s ($(du -sh "$out/bin/weed" | cut -f1))" >&2
echo "$out/bin/weed"
