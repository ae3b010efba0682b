#!/usr/bin/env bash
# test-images.sh OUTDIR: what the registry end-to-end test needs in the
# nested host, built from Debian's packages and cached by this script's hash
# under $CAPSA_CACHE/testimages, so CI builds them once:
#   OUTDIR/python.tar.gz  a bookworm minbase root with python3 (mmdebstrap; the
#                      test layers it into an image with go-containerregistry)
#   OUTDIR/registry/   the reference registry (Debian's docker-registry,
#                      unpacked, never installed or started on this host) with
#                      the libc it loads and a wrapper `registry CONFIG`,
#                      since L1 has only busybox.
#   OUTDIR/tmux/tmux   tmux with the libraries it loads, the same way: the
#                      terminal test types at `capsa exec -it` through it.
# Prints OUTDIR's cache directory when done.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$1
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
key=$(sha256sum "$here/scripts/test-images.sh" | cut -c1-16)
dir=$cache/testimages/$key
if [ ! -f "$dir/done" ]; then
	"$here/scripts/apt-install.sh" mmdebstrap
	rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/registry"
	# The python root: minbase plus python3 (urllib included), without
	# documentation or translations; gzipped.
	SOURCE_DATE_EPOCH=1700000000 mmdebstrap --quiet --variant=minbase --include=python3 \
		--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
		--format=tar bookworm "$dir.tmp/python.tar.gz" http://deb.debian.org/debian
	# The registry: the package's binary and the libraries it loads.
	(cd "$dir.tmp" && apt-get download -q docker-registry >/dev/null 2>&1 ||
		{ apt-get update -qq && apt-get download -q docker-registry >/dev/null; })
	dpkg-deb -x "$dir.tmp"/docker-registry_*.deb "$dir.tmp/pkg"
	cp "$dir.tmp/pkg/usr/bin/docker-registry" "$dir.tmp/registry/docker-registry"
	mkdir -p "$dir.tmp/registry/lib"
	ldd "$dir.tmp/registry/docker-registry" | awk '/=>/ {print $3}' | while read -r lib; do
		[ -f "$lib" ] && cp -L "$lib" "$dir.tmp/registry/lib/"
	done
	cp -L "$(ldd "$dir.tmp/registry/docker-registry" | awk '/ld-linux/ {print $1}')" "$dir.tmp/registry/lib/ld-linux-x86-64.so.2"
	cat >"$dir.tmp/registry/registry" <<'WRAP'
#!/bin/sh
d=$(dirname "$0")
exec "$d/lib/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/docker-registry" serve "$@"
WRAP
	chmod +x "$dir.tmp/registry/registry"
	# tmux: the host's package (installed here if missing), with its
	# libraries, behind the same kind of wrapper.
	"$here/scripts/apt-install.sh" tmux
	mkdir -p "$dir.tmp/tmux/lib"
	cp /usr/bin/tmux "$dir.tmp/tmux/tmux.bin"
	ldd /usr/bin/tmux | awk '/=>/ {print $3}' | while read -r lib; do
		[ -f "$lib" ] && cp -L "$lib" "$dir.tmp/tmux/lib/"
	done
	cp -L "$(ldd /usr/bin/tmux | awk '/ld-linux/ {print $1}')" "$dir.tmp/tmux/lib/ld-linux-x86-64.so.2"
	# tmux refuses to start without a UTF-8 locale: libc-bin's C.UTF-8.
	mkdir -p "$dir.tmp/tmux/locale"
	cp -r /usr/lib/locale/C.utf8 "$dir.tmp/tmux/locale/"
	cat >"$dir.tmp/tmux/tmux" <<'WRAP'
#!/bin/sh
d=$(cd "$(dirname "$0")" && pwd)
LOCPATH="$d/locale" exec "$d/lib/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/tmux.bin" "$@"
WRAP
	chmod +x "$dir.tmp/tmux/tmux"
	rm -rf "$dir.tmp/pkg" "$dir.tmp"/*.deb
	touch "$dir.tmp/done"
	rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
rm -rf "$out" && mkdir -p "$out"
ln -s "$dir/python.tar.gz" "$out/python.tar.gz"
cp -r "$dir/registry" "$out/registry"
cp -r "$dir/tmux" "$out/tmux"
echo "$dir"
