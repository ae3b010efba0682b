#!/usr/bin/env bash
# qemu-bundle.sh OUTDIR: copies qemu-system-x86_64 with every shared library
# it loads and the microvm firmware into OUTDIR, with a wrapper `qemu` that
# runs it through the bundled dynamic loader. The nested host's L1 guest has
# only busybox; this lets the boot benchmark run QEMU there beside capsa.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$1
"$here/scripts/qemu-install.sh"
bin=$(command -v qemu-system-x86_64)
rm -rf "$out"
mkdir -p "$out/lib" "$out/share"
cp "$bin" "$out/qemu-system-x86_64"
ldd "$bin" | awk '/=>/ {print $3} /^\s*\/lib/ {print $1}' | sort -u | while read -r lib; do
	[ -f "$lib" ] && cp -L "$lib" "$out/lib/"
done
loader=$(ldd "$bin" | awk '/ld-linux/ {print $1}')
cp -L "$loader" "$out/lib/ld-linux-x86-64.so.2"
cp -L /usr/share/qemu/qboot.rom "$out/share/qboot.rom"
cp -L /usr/share/qemu/qboot.rom "$out/share/bios-microvm.bin"
cp -L /usr/share/qemu/pvh.bin "$out/share/pvh.bin"
cat >"$out/qemu" <<'WRAP'
#!/bin/sh
d=$(dirname "$0")
exec "$d/lib/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/qemu-system-x86_64" -L "$d/share" "$@"
WRAP
chmod +x "$out/qemu"
