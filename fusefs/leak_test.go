package fusefs

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/capsa-sandbox/capsa/p9fs"
)

// TestNoDescriptorLeak: lookups, reads and writes by node (the lent open
// of a 0444 file included), attributes, listings with READDIRPLUS and
// forgets, 200 rounds over a share allowed 10 descriptors: none is kept
// past its request, and every node is gone once forgotten.
func TestNoDescriptorLeak(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"a", "b", "c"} {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("hello"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(dir, "c"), 0o444); err != nil {
		t.Fatal(err)
	}
	fs := newFS(t, dir, p9fs.Options{MaxFDs: 10})
	for i := 0; i < 200; i++ {
		for _, n := range []string{"a", "b", "c"} {
			e, st := lookup(t, fs, rootID, n)
			if !st.Ok() {
				t.Fatalf("round %d lookup %s: %v", i, n, st)
			}
			buf := make([]byte, 100)
			if _, st := fs.Read(nil, &fuse.ReadIn{InHeader: hdr(e.NodeId), Size: 100}, buf); !st.Ok() {
				t.Fatalf("round %d read %s: %v", i, n, st)
			}
			if _, st := fs.Write(nil, &fuse.WriteIn{InHeader: hdr(e.NodeId)}, []byte("x")); !st.Ok() && n != "c" {
				t.Fatalf("round %d write %s: %v", i, n, st)
			}
			var a fuse.AttrOut
			h := hdr(e.NodeId)
			fs.GetAttr(nil, &fuse.GetAttrIn{InHeader: h}, &a)
			fs.Forget(e.NodeId, 1)
		}
		var open fuse.OpenOut
		if st := fs.OpenDir(nil, &fuse.OpenIn{InHeader: hdr(rootID)}, &open); !st.Ok() {
			t.Fatalf("round %d opendir: %v", i, st)
		}
		list := fuse.NewDirEntryList(make([]byte, 4096), 0)
		if st := fs.ReadDirPlus(nil, &fuse.ReadIn{InHeader: hdr(rootID), Fh: open.Fh, Size: 4096}, list); !st.Ok() {
			t.Fatalf("round %d readdirplus: %v", i, st)
		}
		for _, e := range parsePlus(t, list.Bytes()) {
			if e.out.NodeId != 0 {
				fs.Forget(e.out.NodeId, 1)
			}
		}
		fs.ReleaseDir(&fuse.ReleaseIn{Fh: open.Fh})
	}
	if n, h := fs.Nodes(); n != 1 || h != 0 {
		t.Fatalf("after 200 rounds: %d nodes, %d handles; want the root alone", n, h)
	}
}
