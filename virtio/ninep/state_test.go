package ninep

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const tgetattr = 24

// TestStateCarriesOpenFiles: a session's fids, saved and restored on a
// new device over the same share, are the same files: the root fid walks,
// an open fid reads on, a fid renamed before the save follows its file, a
// fid whose file was removed meanwhile on the host is refused, and the
// guest's msize stands.
func TestStateCarriesOpenFiles(t *testing.T) {
	root := t.TempDir()
	os.WriteFile(filepath.Join(root, "f"), []byte("hello world"), 0o644)
	os.WriteFile(filepath.Join(root, "old"), []byte("renamed"), 0o644)
	os.WriteFile(filepath.Join(root, "doomed"), []byte("x"), 0o644)
	os.Mkdir(filepath.Join(root, "d"), 0o755)
	g := newGuest(t, root, false)
	g.attach()
	walk := func(g *guest, tag uint16, fid, newfid uint32, names ...string) {
		t.Helper()
		body := cat(u32b(fid), u32b(newfid), u16b(uint16(len(names))))
		for _, n := range names {
			body = cat(body, str9(n))
		}
		g.ok(twalk, tag, body, 256)
	}
	read := func(g *guest, tag uint16, fid uint32, off uint64, n uint32) []byte {
		t.Helper()
		r := g.call(tread, tag, cat(u32b(fid), u64b(off), u32b(n)), 4096)
		if r[4] != tread+1 {
			return nil
		}
		return r[headerLen+4:]
	}
	walk(g, 2, 1, 2, "f")
	g.ok(tlopen, 3, cat(u32b(2), u32b(0)), 64)
	if b := read(g, 4, 2, 0, 5); string(b) != "hello" {
		t.Fatalf("read before the save = %q", b)
	}
	walk(g, 5, 1, 3, "old")
	g.ok(tlopen, 6, cat(u32b(3), u32b(0)), 64)
	g.ok(trenameat, 7, cat(u32b(1), str9("old"), u32b(1), str9("new")), 64)
	walk(g, 8, 1, 4, "doomed")
	walk(g, 9, 1, 5, "d")
	g.ok(tclunk, 10, u32b(5), 64) // gone before the save
	raw, err := g.dev.SaveState()
	if err != nil {
		t.Fatalf("SaveState() = %v", err)
	}
	var st sessionSnapshot
	json.Unmarshal(raw, &st)
	if p := st.Fids[3]; p == nil || strings.Join(p.Path, "/") != "new" || !p.Open {
		t.Errorf("saved fid 3 = %+v, want the renamed file, open", p)
	}
	if _, ok := st.Fids[5]; ok || st.Msize != 8192 {
		t.Errorf("saved: fid 5 present %v, msize %d; want clunked, 8192", ok, st.Msize)
	}

	os.Remove(filepath.Join(root, "doomed"))
	g2 := newGuest(t, root, false)
	if err := g2.dev.RestoreState(raw); err != nil {
		t.Fatalf("RestoreState() = %v", err)
	}
	if b := read(g2, 11, 2, 6, 5); string(b) != "world" {
		t.Errorf("read of the restored open fid = %q, want world", b)
	}
	if b := read(g2, 12, 3, 0, 7); string(b) != "renamed" {
		t.Errorf("read of the restored renamed fid = %q, want renamed", b)
	}
	walk(g2, 13, 1, 6, "f") // the root fid walks again
	if r := g2.call(tgetattr, 14, cat(u32b(4), u64b(0x3fff)), 256); errnoOf(r) < 0 {
		t.Errorf("a fid whose file was removed on the host answered % x, want an error", r[:8])
	}
	// The msize the guest settled stands: a request larger is refused.
	if r := g2.call(twrite, 15, cat(u32b(2), u64b(0), u32b(9000), make([]byte, 9000)), 64); errnoOf(r) < 0 {
		t.Errorf("a request over the restored msize answered % x, want an error", r[:8])
	}
}

// TestStateRefusesBadInput: a saved session no device could have had is
// refused before anything reaches the file server.
func TestStateRefusesBadInput(t *testing.T) {
	g := newGuest(t, t.TempDir(), false)
	for _, tc := range []struct{ name, raw, want string }{
		{"msize", `{"version":"9P2000.L","msize":12,"attaches":[],"fids":{}}`, "msize 12"},
		{"version", `{"version":"9P2000","msize":8192,"attaches":[],"fids":{}}`, "version"},
		{"escaping name", `{"version":"9P2000.L","msize":8192,"attaches":[{"uname":"root","aname":"","n_uname":0}],"fids":{"1":{"attach":0,"path":["a/../../b"]}}}`, "path name"},
		{"dotdot", `{"version":"9P2000.L","msize":8192,"attaches":[{"uname":"root","aname":"","n_uname":0}],"fids":{"1":{"attach":0,"path":[".."]}}}`, "path name"},
		{"attach", `{"version":"9P2000.L","msize":8192,"attaches":[],"fids":{"1":{"attach":3}}}`, "attach 3"},
		{"unknown", `{"version":"9P2000.L","msize":8192,"surprise":1}`, "unknown field"},
	} {
		if err := g.dev.RestoreState(json.RawMessage(tc.raw)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: RestoreState() = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

// FuzzRestoreState: any saved session is refused or replayed on the file
// server, never a panic or a walk out of the share.
func FuzzRestoreState(f *testing.F) {
	f.Add([]byte(`{"version":"9P2000.L","msize":8192,"attaches":[{"uname":"root","aname":"","n_uname":0}],"fids":{"1":{"attach":0},"2":{"attach":0,"path":["f"],"open":true},"3":{"attach":0,"path":["nope","x"]},"4":{"lost":true}}}`))
	f.Add([]byte(`{"version":"9P2000.L","msize":4096,"attaches":[{"uname":"","aname":"../..","n_uname":4294967295}],"fids":{"4294967294":{"attach":0,"path":["f"],"open":true,"flags":4294967295}}}`))
	root := f.TempDir()
	os.WriteFile(filepath.Join(root, "f"), []byte("data"), 0o644)
	f.Fuzz(func(t *testing.T, raw []byte) {
		g := newGuest(t, root, true)
		g.dev.RestoreState(json.RawMessage(raw))
	})
}
