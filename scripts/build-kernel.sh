#!/usr/bin/env bash
# Builds capsa's guest kernel from Debian's linux-source-6.12 with kernel/config.
#
# The result is cached outside the checkout, keyed by a hash of the config, this
# script and the exact source package version, so a second build is instant:
#   $CAPSA_CACHE/kernel/<key>/{vmlinux,bzImage,config}
# and copied to the output directory given as $1 (default: build/kernel).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/build/kernel}
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
config=$here/kernel/config
jobs=${JOBS:-$(nproc)}

log() { printf 'build-kernel: %s\n' "$*" >&2; }

need_pkgs=()
dpkg -s linux-source-6.12 >/dev/null 2>&1 || need_pkgs+=(linux-source-6.12)
for p in build-essential bc bison flex libelf-dev libssl-dev xz-utils; do
	dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
	log "installing ${need_pkgs[*]}"
	"$here/scripts/apt-install.sh" "${need_pkgs[@]}"
fi

srcver=$(dpkg-query -W -f='${Version}' linux-source-6.12)
tarball=/usr/src/linux-source-6.12.tar.xz
[ -f "$tarball" ] || { log "missing $tarball"; exit 1; }

key=$(cat "$config" "$0" <(echo "$srcver") | sha256sum | cut -c1-16)
dest=$cache/kernel/$key
if [ -f "$dest/vmlinux" ] && [ -f "$dest/bzImage" ]; then
	log "cached: $dest (config+source key $key)"
else
	start=$(date +%s)
	src=$cache/src/$srcver/linux-source-6.12
	if [ ! -f "$src/Makefile" ]; then
		log "unpacking $tarball ($srcver)"
		rm -rf "$cache/src/$srcver.tmp"
		mkdir -p "$cache/src/$srcver.tmp"
		tar -C "$cache/src/$srcver.tmp" -xf "$tarball"
		rm -rf "$cache/src/$srcver"
		mv "$cache/src/$srcver.tmp" "$cache/src/$srcver"
	fi
	# One object directory per source version: a config change rebuilds
	# incrementally instead of from scratch.
	obj=$cache/obj/$srcver
	mkdir -p "$obj"
	log "configuring (allnoconfig + kernel/config)"
	make -s -C "$src" O="$obj" KCONFIG_ALLCONFIG="$config" allnoconfig >/dev/null
	make -s -C "$src" O="$obj" olddefconfig >/dev/null
	"$here/scripts/check-kernel-config.sh" "$config" "$obj/.config"
	log "building with $jobs jobs"
	make -s -C "$src" O="$obj" -j"$jobs" vmlinux bzImage
	mkdir -p "$dest.tmp"
	cp "$obj/vmlinux" "$dest.tmp/vmlinux.full"
	objcopy --strip-all "$dest.tmp/vmlinux.full" "$dest.tmp/vmlinux"
	rm "$dest.tmp/vmlinux.full"
	cp "$obj/arch/x86/boot/bzImage" "$dest.tmp/bzImage"
	cp "$obj/.config" "$dest.tmp/config"
	echo "$srcver" >"$dest.tmp/source-version"
	rm -rf "$dest"
	mv "$dest.tmp" "$dest"
	log "built in $(($(date +%s) - start))s: $dest"
fi
mkdir -p "$out"
cp "$dest/vmlinux" "$dest/bzImage" "$dest/config" "$dest/source-version" "$out/"
log "$(cd "$out" && du -h vmlinux bzImage | tr '\n' ' ')"
