package sandbox

import (
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/agent"
)

func TestBadPatchesAreRefusedBeforeBoot(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		p    Patch
		want string
	}{
		{Patch{Op: PatchWrite, Path: "etc/x"}, "must be absolute"},
		{Patch{Op: PatchRemove, Path: "/"}, "cannot change /"},
		{Patch{Op: PatchSymlink, Path: "/a"}, "no target"},
		{Patch{Op: PatchCopy, Path: "/a", Source: dir + "/missing"}, "no such file"},
		{Patch{Op: PatchWrite, Path: "/a", Data: make([]byte, MaxPatchData+1)}, "use a copy patch"},
		{Patch{Op: PatchMkdir, Path: "/a", Owner: &agent.Owner{UID: -1}}, "must not be negative"},
		{Patch{Op: 99, Path: "/a"}, "unknown operation"},
	} {
		err := New().Patch(tc.p).Err()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Patch(%v %q).Err() = %v, want an error containing %q", tc.p.Op, tc.p.Path, err, tc.want)
		}
	}
	if err := New().CopyIn(dir, "/opt/x").Patch(Patch{Op: PatchWrite, Path: "/etc/motd", Data: []byte("hi")}).Err(); err != nil {
		t.Errorf("good patches: Err() = %v", err)
	}
}
