#!/bin/sh
# install.sh: run by daemonset.yaml's init container with the host's root at
# $HOST_ROOT and the host's PID namespace: installs capsa and its shim, adds
# the runtime handler to containerd's configuration once, restarts
# containerd.
set -eu
root=${HOST_ROOT:-/host}
[ -c "$root/dev/kvm" ] || { echo "capsa-installer: this node has no /dev/kvm" >&2; exit 1; }
install -m 0755 /capsa "$root/usr/local/bin/capsa"
ln -sf capsa "$root/usr/local/bin/containerd-shim-capsa-v2"
conf=$root/etc/containerd/config.toml
# containerd 2.x's configuration (version 3) names the CRI plugin apart.
snippet=/containerd-config.toml
grep -q '^version *= *3' "$conf" 2>/dev/null && snippet=/containerd2-config.toml
if ! grep -q '^\[.*runtimes\.capsa\]' "$conf" 2>/dev/null; then
	mkdir -p "$(dirname "$conf")"
	# The snippet's own version line is the file's if it had none.
	if [ -s "$conf" ]; then grep -v '^version' "$snippet" >>"$conf"; else cat "$snippet" >"$conf"; fi
fi
nsenter --target 1 --mount --uts --ipc --net --pid -- systemctl restart containerd
echo "capsa-installer: capsa $("$root/usr/local/bin/capsa" version 2>/dev/null || echo installed) and its shim are on this node"
