#!/usr/bin/env bash
# qemu-build.sh: builds the QEMU that runs the nested KVM host's L1 guest
# (tests/nested) and prints the path of its qemu-system-x86_64.
#
# It is Debian's QEMU 10.0.2 source (the orig tarball of the version that
# scripts/qemu-install.sh installs, pinned by hash) with the fixes in
# tests/nested/qemu/*.patch to QEMU's TCG emulation of AMD SVM, which every
# nested test stands on (README, "Guest stalls"). Only the x86_64 system
# emulator is built, with no optional features; the firmware comes from
# Debian's qemu-system-data, installed with qemu-system-x86.
#
# The result is cached outside the checkout, keyed by a hash of what the
# build is made of (the source's version and checksum, the configure flags
# and the patches), so an edit elsewhere in this script rebuilds nothing:
#   $CAPSA_CACHE/qemu/<key>/bin/qemu-system-x86_64, and qemu/current -> <key>
# About 6 minutes on 2 cores the first time; instant afterwards.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
jobs=${JOBS:-$(nproc)}
version=10.0.2
tarball=qemu_${version}+ds.orig.tar.xz
sha256=0901da33844a331bf8b3602b9c1fbd178e60b737c8e3ade678255bd090c9b9f1
configure=(--target-list=x86_64-softmmu --python=/usr/bin/python3 --without-default-features --enable-fdt=system
	--disable-download --disable-install-blobs --disable-docs --disable-werror
	--firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu)

log() { printf 'qemu-build: %s\n' "$*" >&2; }

patches=("$here"/tests/nested/qemu/*.patch)
key=$({ echo "$version $sha256 ${configure[*]}"; cat "${patches[@]}"; } | sha256sum | cut -c1-16)
dest=$cache/qemu/$key
if [ -x "$dest/bin/qemu-system-x86_64" ]; then
	ln -sfn "$key" "$cache/qemu/current"
	echo "$dest/bin/qemu-system-x86_64"
	exit 0
fi

# The firmware (SeaBIOS, option ROMs) is Debian's.
"$here/scripts/qemu-install.sh"
"$here/scripts/apt-install.sh" build-essential pkg-config ninja-build python3-venv \
	libglib2.0-dev libfdt-dev curl xz-utils bzip2 patch
# QEMU 10 needs meson 1.5 or later: Debian 12 has it in bookworm-backports
# (which qemu-install.sh adds), and pycotap only there.
mesonver=$(dpkg-query -W -f='${Version}' meson 2>/dev/null || echo 0)
if ! dpkg --compare-versions "$mesonver" ge 1.5; then
	sudo=""
	[ "$(id -u)" = 0 ] || sudo=sudo
	log "installing meson 1.5+ from bookworm-backports"
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
		-t bookworm-backports meson python3-pycotap >/dev/null
fi
"$here/scripts/apt-install.sh" python3-pycotap

start=$(date +%s)
work=$cache/qemu/build-$key
rm -rf "$work" "$dest" "$dest.tmp"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
dl=$cache/qemu/$tarball
if [ ! -f "$dl" ] || ! echo "$sha256  $dl" | sha256sum -c --quiet 2>/dev/null; then
	# From the mirror this machine's apt takes Debian from (its pool
	# holds the source package's orig tarball), checked by its hash.
	uri=$(apt-get indextargets --format '$(REPO_URI) $(LABEL)' 2>/dev/null | awk '$2 == "Debian" && NF == 2 {print $1; exit}')
	[ -n "$uri" ] || { log "no apt source of this machine serves Debian"; exit 1; }
	url=${uri%/}/pool/main/q/qemu/$tarball
	log "downloading $url"
	curl -fsS -o "$dl.tmp" "$url" || { log "cannot download $url"; exit 1; }
	echo "$sha256  $dl.tmp" | sha256sum -c --quiet || { log "$tarball: sha256 mismatch"; exit 1; }
	mv "$dl.tmp" "$dl"
fi
tar -C "$work" -xJf "$dl"
src=$work/qemu-$version
for p in "${patches[@]}"; do
	log "applying $(basename "$p")"
	patch -d "$src" -p1 --quiet --forward <"$p"
done
# Debian's +ds tarball leaves out the prebuilt EDK2 images, which QEMU's
# meson unpacks whenever bzip2 exists: empty ones, never installed or used.
for f in $(sed -n "s/^ *'\(edk2-[a-z0-9_-]*\.fd\)',\$/\1/p" "$src/pc-bios/meson.build"); do
	[ -f "$src/pc-bios/$f.bz2" ] || bzip2 </dev/null >"$src/pc-bios/$f.bz2"
done
log "configuring"
mkdir -p "$src/build"
(cd "$src/build" && ../configure --prefix="$dest.tmp" "${configure[@]}" >configure.log 2>&1) ||
	{ tail -30 "$src/build/configure.log" >&2; exit 1; }
log "building with $jobs jobs"
ninja -C "$src/build" -j"$jobs" qemu-system-x86_64 >"$work/build.log" 2>&1 ||
	{ tail -40 "$work/build.log" >&2; exit 1; }
mkdir -p "$dest.tmp/bin"
cp "$src/build/qemu-system-x86_64" "$dest.tmp/bin/"
"$dest.tmp/bin/qemu-system-x86_64" --version | head -1 >&2
mv "$dest.tmp" "$dest"
ln -sfn "$key" "$cache/qemu/current"
log "built in $(($(date +%s) - start))s: $dest"
echo "$dest/bin/qemu-system-x86_64"
