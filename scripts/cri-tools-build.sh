#!/usr/bin/env bash
# cri-tools-build.sh OUTDIR: crictl (sigs.k8s.io/cri-tools) and the CNI
# plugins a pod network needs (bridge, host-local, loopback), built from
# their Go modules by `go install` (static, CGO off), for the nested host's
# L1: the shim's CRI end-to-end test drives containerd's CRI plugin with
# them. Also runc (static, its C parts linked in; without seccomp, which
# would need libseccomp) and containerd 1.7's runc shim (tests/runcshim):
# the control of the CRI benchmark. Cached by version under $CAPSA_CACHE/cri-tools.
set -euo pipefail
crictl=${CRICTL_VERSION:-v1.37.0}
cni=${CNI_PLUGINS_VERSION:-v1.9.0}
runc=${RUNC_VERSION:-v1.5.3}
# containerd's runc shim: tests/runcshim, a module of its own (its go.mod
# names the version), keyed by its files.
here=$(cd "$(dirname "$0")/.." && pwd)
runcshim=$(cat "$here/tests/runcshim/go.mod" "$here/tests/runcshim/go.sum" "$here/tests/runcshim/main.go" | sha256sum | cut -c1-12)
out=$1
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
dir=$cache/cri-tools/$crictl-$cni-$runc-$runcshim
if [ ! -f "$dir/done" ]; then
	rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin" "$dir.tmp/cni"
	GOBIN="$dir.tmp/bin" CGO_ENABLED=0 GOFLAGS=-trimpath go install "sigs.k8s.io/cri-tools/cmd/crictl@$crictl"
	GOBIN="$dir.tmp/cni" CGO_ENABLED=0 GOFLAGS=-trimpath go install \
		"github.com/containernetworking/plugins/plugins/main/bridge@$cni" \
		"github.com/containernetworking/plugins/plugins/main/loopback@$cni" \
		"github.com/containernetworking/plugins/plugins/ipam/host-local@$cni"
	(cd "$here/tests/runcshim" && CGO_ENABLED=0 go build -trimpath -o "$dir.tmp/bin/containerd-shim-runc-v2" .)
	GOBIN="$dir.tmp/bin" CGO_ENABLED=1 GOFLAGS=-trimpath go install -tags "netgo osusergo" \
		-ldflags '-extldflags "-static"' "github.com/opencontainers/runc@$runc"
	echo "crictl $crictl, CNI plugins $cni, runc $runc, containerd-shim-runc-v2 $runcshim" >"$dir.tmp/version"
	touch "$dir.tmp/done"
	rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
rm -rf "$out" && cp -r "$dir" "$out"
