#!/usr/bin/env bash
# build-initramfs.sh AGENT OUT: builds the guest initramfs (u-root core
# commands, gosh as /bin/sh, AGENT as /init) with the initramfs module.
# u-root's busybox build takes a minute, so the result is cached outside the
# checkout, keyed by the agent binary and the builder's own files.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
agent=$(realpath "$1") out=$2
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
key=$(cat "$agent" "$here/initramfs/go.mod" "$here/initramfs/go.sum" "$here/initramfs/main.go" "$0" | sha256sum | cut -c1-16)
cached=$cache/initramfs/$key.cpio
if [ ! -f "$cached" ]; then
	mkdir -p "$cache/initramfs"
	start=$(date +%s)
	(cd "$here/initramfs" && go run . -agent "$agent" -o "$cached.tmp")
	mv "$cached.tmp" "$cached"
	echo "build-initramfs: built in $(($(date +%s) - start))s: $cached" >&2
fi
cp "$cached" "$out"
