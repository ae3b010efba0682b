#!/usr/bin/env bash
# Installs what the nested KVM test host needs and prints the directory of the
# unpacked L1 kernel:
#   - qemu-system-x86 10 or later (scripts/qemu-install.sh says why not
#     Debian 12's 7.2) and, built from its source with fixes to its emulated
#     AMD SVM, the QEMU whose TCG runs the L1 guest (scripts/qemu-build.sh),
#   - busybox-static (the L1 userland),
#   - Debian's linux-image-cloud-amd64 kernel and its KVM modules, downloaded
#     and unpacked under $CAPSA_CACHE/l1/<version>, never installed into /boot.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
"$here/scripts/qemu-install.sh"
"$here/scripts/qemu-build.sh" >/dev/null
"$here/scripts/apt-install.sh" busybox-static

# The meta package names the versioned kernel package it depends on.
if ! apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1; then
	apt-get update -qq
fi
pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
[ -n "$pkg" ] || { echo "nested-deps: cannot resolve linux-image-cloud-amd64" >&2; exit 1; }
ver=$(apt-cache show "$pkg" | awk '/^Version:/{print $2; exit}')
dest=$cache/l1/$pkg-$ver
if [ ! -f "$dest/ok" ]; then
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	(cd "$tmp" && apt-get download "$pkg=$ver" >&2 2>/dev/null)
	rm -rf "$dest"
	mkdir -p "$dest"
	dpkg-deb -x "$tmp"/*.deb "$dest"
	ls "$dest"/boot/vmlinuz-* >/dev/null
	find "$dest/lib/modules" -name kvm-amd.ko | grep -q . || { echo "nested-deps: $pkg has no kvm-amd.ko" >&2; exit 1; }
	touch "$dest/ok"
fi
ln -sfn "$dest" "$cache/l1/current"
echo "$dest"
