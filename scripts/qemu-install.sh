#!/usr/bin/env bash
# qemu-install.sh: installs QEMU 10 or later for the nested KVM host, from
# Debian's packages. QEMU 7.2 (Debian 12's own) emulates AMD SVM with bugs
# that stop nested guests now and then (see docs/testing.md, "Guest stalls"): on
# Debian 12 this takes qemu-system-x86 from bookworm-backports, adding
# that suite to apt's sources when it is missing.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
want=10
have() {
	local v
	v=$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null) || return 1
	v=${v#*:}
	[ "${v%%.*}" -ge "$want" ] 2>/dev/null
}
have && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
. /etc/os-release
if [ "${VERSION_CODENAME:-}" = bookworm ]; then
	src=/etc/apt/sources.list.d/capsa-bookworm-backports.sources
	if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
		# The backports of the mirror this machine takes bookworm from.
		uri=$(apt-get indextargets --format '$(REPO_URI) $(CODENAME)' 2>/dev/null | awk '$2 == "bookworm" {print $1; exit}')
		[ -n "$uri" ] || { echo "qemu-install: no apt source of this machine serves bookworm" >&2; exit 1; }
		printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$uri" | $sudo tee "$src" >/dev/null
	fi
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends -t bookworm-backports qemu-system-x86 >/dev/null
else
	"$here/scripts/apt-install.sh" qemu-system-x86
fi
have || { echo "qemu-install: qemu-system-x86 $(dpkg-query -W -f='${Version}' qemu-system-x86) is older than $want" >&2; exit 1; }
