#!/usr/bin/env bash
# containerd-bundle.sh OUTDIR: Debian 12's containerd (1.6) for the nested
# host's L1, which has only busybox: OUTDIR/bin/containerd and OUTDIR/bin/ctr
# are wrappers that run the package's binaries through the bundled dynamic
# loader with the libraries they load (as scripts/qemu-bundle.sh does for
# QEMU). The containerd shim end-to-end test runs them against capsa's shim.
# Cached by the package's version under $CAPSA_CACHE/containerd.
set -euo pipefail
out=$1
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# apt knows no packages before an update on a fresh machine.
(cd "$tmp" && apt-get download -q containerd >/dev/null 2>&1 ||
	{ apt-get update -qq && apt-get download -q containerd >/dev/null; })
deb=$(ls "$tmp"/containerd_*.deb)
version=$(dpkg-deb -f "$deb" Version)
dir=$cache/containerd/$version
if [ ! -f "$dir/done" ]; then
	rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin" "$dir.tmp/lib"
	dpkg-deb -x "$deb" "$tmp/pkg"
	for b in containerd ctr; do
		cp "$tmp/pkg/usr/bin/$b" "$dir.tmp/bin/$b.bin"
		ldd "$tmp/pkg/usr/bin/$b" | awk '/=>/ {print $3}' | while read -r lib; do
			[ -f "$lib" ] && cp -L "$lib" "$dir.tmp/lib/"
		done
		cat >"$dir.tmp/bin/$b" <<WRAP
#!/bin/sh
d=\$(dirname "\$0")/..
exec "\$d/lib/ld-linux-x86-64.so.2" --library-path "\$d/lib" "\$d/bin/$b.bin" "\$@"
WRAP
		chmod +x "$dir.tmp/bin/$b"
	done
	loader=$(ldd "$tmp/pkg/usr/bin/containerd" | awk '/ld-linux/ {print $1}')
	cp -L "$loader" "$dir.tmp/lib/ld-linux-x86-64.so.2"
	echo "$version" >"$dir.tmp/version"
	touch "$dir.tmp/done"
	rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
rm -rf "$out" && cp -r "$dir" "$out"
