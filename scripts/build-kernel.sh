#!/usr/bin/env bash
# Builds capsa's guest kernel from Debian's linux-source-6.12 with kernel/config
# and the patches in kernel/patches (applied in name order with patch -p1).
#
# The result is cached outside the checkout, keyed by a hash of the config, the
# patches, this script and the exact source package version, so a second build
# is instant:
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
for p in build-essential bc bison flex libelf-dev libssl-dev xz-utils patch; do
	dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
	log "installing ${need_pkgs[*]}"
	"$here/scripts/apt-install.sh" "${need_pkgs[@]}"
fi

srcver=$(dpkg-query -W -f='${Version}' linux-source-6.12)
tarball=/usr/src/linux-source-6.12.tar.xz
[ -f "$tarball" ] || { log "missing $tarball"; exit 1; }

shopt -s nullglob
patches=("$here"/kernel/patches/*.patch)
shopt -u nullglob
# The patched source tree is its own: srcid names the source version and
# the patches' contents.
srcid=$srcver
if ((${#patches[@]})); then
	srcid=$srcver-$(cat "${patches[@]}" | sha256sum | cut -c1-12)
fi
key=$(cat "$config" "$0" ${patches[@]+"${patches[@]}"} <(echo "$srcver") | sha256sum | cut -c1-16)
dest=$cache/kernel/$key
if [ -f "$dest/vmlinux" ] && [ -f "$dest/bzImage" ]; then
	log "cached: $dest (config+patches+source key $key)"
else
	start=$(date +%s)
	src=$cache/src/$srcid/linux-source-6.12
	if [ ! -f "$src/Makefile" ]; then
		log "unpacking $tarball ($srcver)"
		rm -rf "$cache/src/$srcid.tmp"
		mkdir -p "$cache/src/$srcid.tmp"
		tar -C "$cache/src/$srcid.tmp" -xf "$tarball"
		for p in ${patches[@]+"${patches[@]}"}; do
			log "applying $(basename "$p")"
			patch -s -p1 -d "$cache/src/$srcid.tmp/linux-source-6.12" <"$p"
		done
		rm -rf "$cache/src/$srcid"
		mv "$cache/src/$srcid.tmp" "$cache/src/$srcid"
	fi
	# One object directory per source tree: a config change rebuilds
	# incrementally instead of from scratch.
	obj=$cache/obj/$srcid
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
