#!/usr/bin/env bash
# test-images.sh OUTDIR TOOLSDIR: what the image end-to-end tests need in the
# nested host, built from Debian's packages and cached by this script's hash
# under $CAPSA_CACHE/testimages, so CI builds them once:
#   OUTDIR/python.tar.gz  a bookworm minbase root with python3 (mmdebstrap; the
#                      test layers it into an image with go-containerregistry)
#   TOOLSDIR/tools.tar.gz the same with git, python3-venv, Debian's setuptools
#                      and wheel as a local wheelhouse, and sqlite3: the root
#                      of TestWorkspacePrograms's image (apart, as only its
#                      session carries it)
#   OUTDIR/registry/   the reference registry (Debian's docker-registry,
#                      unpacked, never installed or started on this host) with
#                      the libc it loads and a wrapper `registry CONFIG`,
#                      since L1 has only busybox.
#   OUTDIR/tmux/tmux   tmux with the libraries it loads, the same way: the
#                      terminal test types at `capsa exec -it` through it.
# Prints OUTDIR's cache directory when done.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$1 tools=$2
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
key=$(sha256sum "$here/scripts/test-images.sh" | cut -c1-16)
dir=$cache/testimages/$key
if [ ! -f "$dir/done" ]; then
	"$here/scripts/apt-install.sh" mmdebstrap
	rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/registry"
	# The package sources: this machine's own apt sources (mmdebstrap pastes
	# each file into the new root's sources), so the roots come from
	# wherever this machine gets its packages.
	sources=()
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
		[ -s "$f" ] && grep -q bookworm "$f" && sources+=("$f")
	done
	[ ${#sources[@]} -gt 0 ] || { echo "test-images: no apt source of this machine names bookworm" >&2; exit 1; }
	# root OUT PACKAGES: a bookworm minbase root with PACKAGES, without
	# documentation or translations; gzipped.
	root() {
		SOURCE_DATE_EPOCH=1700000000 mmdebstrap --quiet --variant=minbase --include="$2" \
			--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
			--dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
			--format=tar bookworm "$1" "${sources[@]}"
	}
	# The python root: python3 (urllib included).
	root "$dir.tmp/python.tar.gz" python3
	root "$dir.tmp/tools.tar.gz" git,python3,python3-venv,python3-setuptools-whl,python3-wheel-whl,sqlite3
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
rm -rf "$tools" && mkdir -p "$tools"
ln -s "$dir/tools.tar.gz" "$tools/tools.tar.gz"
cp -r "$dir/registry" "$out/registry"
cp -r "$dir/tmux" "$out/tmux"
echo "$dir"
