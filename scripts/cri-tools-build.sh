#!/usr/bin/env bash
# cri-tools-build.sh OUTDIR: crictl (sigs.k8s.io/cri-tools) and the CNI
# plugins a pod network needs (bridge, host-local, loopback), built from
# their Go modules by `go install` (static, CGO off), for the nested host's
# L1: the shim's CRI end-to-end test drives containerd's CRI plugin with
# them. Cached by version under $CAPSA_CACHE/cri-tools.
set -euo pipefail
crictl=${CRICTL_VERSION:-v1.37.0}
cni=${CNI_PLUGINS_VERSION:-v1.9.0}
out=$1
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
dir=$cache/cri-tools/$crictl-$cni
if [ ! -f "$dir/done" ]; then
	rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin" "$dir.tmp/cni"
	GOBIN="$dir.tmp/bin" CGO_ENABLED=0 GOFLAGS=-trimpath go install "sigs.k8s.io/cri-tools/cmd/crictl@$crictl"
	GOBIN="$dir.tmp/cni" CGO_ENABLED=0 GOFLAGS=-trimpath go install \
		"github.com/containernetworking/plugins/plugins/main/bridge@$cni" \
		"github.com/containernetworking/plugins/plugins/main/loopback@$cni" \
		"github.com/containernetworking/plugins/plugins/ipam/host-local@$cni"
	echo "crictl $crictl, CNI plugins $cni" >"$dir.tmp/version"
	touch "$dir.tmp/done"
	rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
rm -rf "$out" && cp -r "$dir" "$out"
