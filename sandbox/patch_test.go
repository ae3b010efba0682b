package sandbox

import (
	"os"
	"path/filepath"
	"slices"
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

// TestCopyPatchSourceIsAbsolute: a copy patch's host source is made
// absolute when it is added: it is read once the guest runs, by a VMM
// that may be jailed at / by then, and HostPaths names it for the jail.
func TestCopyPatchSourceIsAbsolute(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "src"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	spec, err := New().CopyIn("src", "/opt/x").Run("true").Spec()
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "src"); len(spec.Patches) != 1 || spec.Patches[0].Source != want {
		t.Fatalf("the copy patch = %+v; want its source %s", spec.Patches, want)
	}
	sb := &Sandbox{c: config{Spec: spec}}
	if read, _ := sb.HostPaths(); !slices.Contains(read, filepath.Join(dir, "src")) {
		t.Errorf("HostPaths() reads %v; want the copy's source", read)
	}
}

// TestServesHostFiles: a sandbox serves host files it did not make, and
// its VMM run by root keeps the file server's capabilities, with a share,
// a disk, a volume or a copy patch; not with written files or an image
// alone.
func TestServesHostFiles(t *testing.T) {
	for _, c := range []struct {
		what string
		spec Spec
		want bool
	}{
		{"nothing", Spec{}, false},
		{"a written file and an image", Spec{Patches: []Patch{{Op: PatchWrite, Path: "/etc/x"}}, Image: &ImageSpec{}}, false},
		{"a share", Spec{Shares: []ShareSpec{{Host: "/src", Guest: "/w"}}}, true},
		{"a disk", Spec{Disks: []DiskSpec{{Path: "/d.img"}}}, true},
		{"a volume", Spec{Volumes: []VolumeSpec{{Name: "v"}}}, true},
		{"a copy", Spec{Patches: []Patch{{Op: PatchCopy, Path: "/x", Source: "/src/x"}}}, true},
	} {
		if got := (&Sandbox{c: config{Spec: c.spec}}).ServesHostFiles(); got != c.want {
			t.Errorf("%s: ServesHostFiles = %v; want %v", c.what, got, c.want)
		}
	}
}
