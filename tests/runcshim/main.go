// Command containerd-shim-runc-v2 is containerd 1.7's runc shim, linked
// from its module's packages: the control runtime of BenchmarkCRIStart in
// the nested host (scripts/cri-tools-build.sh builds it). It is a module of
// its own because capsa's module cannot hold it: gVisor needs go-runc 1.1,
// whose process monitor containerd 1.7's runc shim does not satisfy.
// containerd's own command cannot be built with `go install` (its go.mod
// has exclude directives), and containerd 2's runc shim answers `start` in
// a form containerd 1.6 cannot read.
package main

import (
	"context"

	"github.com/containerd/containerd/runtime/v2/runc/manager"
	_ "github.com/containerd/containerd/runtime/v2/runc/pause"
	_ "github.com/containerd/containerd/runtime/v2/runc/task/plugin"
	"github.com/containerd/containerd/runtime/v2/shim"
)

func main() {
	shim.RunManager(context.Background(), manager.NewShimManager("io.containerd.runc.v2"))
}
