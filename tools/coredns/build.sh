#!/usr/bin/env bash
# Build the real node's cluster DNS: CoreDNS (tools/coredns/go.mod pins it, with the control
# plane's client-go) with only the plugins the node's Corefile uses (tools/coredns/main.go), from
# Go modules through the Go module proxy. The binary goes to a cache outside the repository keyed
# by a hash of go.mod, go.sum, main.go and this script; a complete cache is reused as it is.
#
# Output: the cache's bin/ folder (holding `coredns`) on the last line of stdout.
# Env: KVFLEET_COREDNS_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/kvfleet/coredns).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v go >/dev/null 2>&1 || { echo "coredns build: FAILED: no 'go' on PATH (Go >= 1.26 is needed)" >&2; exit 1; }
version="$(awk '{for (i = 1; i < NF; i++) if ($i == "github.com/coredns/coredns") {print $(i + 1); exit}}' "$here/go.mod")"
key="$version-$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" "$here/build.sh" | sha256sum | cut -c1-12)"
root="${KVFLEET_COREDNS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet/coredns}"
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
echo "coredns build: building coredns ($version) ..." >&2
if ! (cd "$here" && go build -trimpath -ldflags "-s -w" -o "$out/bin/coredns.tmp" .) >>"$log" 2>&1; then
  echo "coredns build: FAILED building coredns; the last lines of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
mv "$out/bin/coredns.tmp" "$out/bin/coredns"
secs=$(( $(date +%s) - start ))
{
  echo "version=$version"
  echo "build_seconds=$secs"
  echo "bin_bytes=$(stat -c %s "$out/bin/coredns")"
  echo "nproc=$(nproc)"
} > "$out/build-info.txt"
touch "$out/.complete"
echo "coredns build: complete in $secs s ($(du -sh "$out/bin/coredns" | cut -f1))" >&2
echo "$out/bin"
