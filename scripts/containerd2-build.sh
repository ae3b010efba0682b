#!/usr/bin/env bash
# containerd2-build.sh OUTDIR: containerd 2.x and its ctr, built from their
# Go module by `go install` (static, CGO off), for the nested host's L1:
# the shim's end-to-end test runs them beside Debian's containerd 1.6.
# Cached by version under $CAPSA_CACHE/containerd2 (a build takes minutes).
set -euo pipefail
version=${CONTAINERD2_VERSION:-v2.4.2}
out=$1
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
dir=$cache/containerd2/$version
if [ ! -f "$dir/done" ]; then
	rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin"
	GOBIN="$dir.tmp/bin" CGO_ENABLED=0 GOFLAGS=-trimpath go install \
		-tags no_btrfs,no_devmapper,no_zfs \
		"github.com/containerd/containerd/v2/cmd/containerd@$version" \
		"github.com/containerd/containerd/v2/cmd/ctr@$version"
	echo "$version" >"$dir.tmp/version"
	touch "$dir.tmp/done"
	rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
rm -rf "$out" && cp -r "$dir" "$out"
