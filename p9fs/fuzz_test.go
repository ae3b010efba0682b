package p9fs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hugelgupf/p9/p9"
)

// FuzzWalkNames walks arbitrary name lists ("\xff" separates names) from
// the share root: whatever succeeds must be inside the share, and nothing
// opened may be the secret outside it.
func FuzzWalkNames(f *testing.F) {
	for _, s := range []string{
		"", "..", ".", "file", "dir\xffinner", "dir\xff..\xff..", "etc\xffpasswd", "up\xffx",
		"sec", "relsec", "out\xffkeep", "dir/inner", "../secret", "\x00", "file\x00", "/",
		"dir\xff\xff", strings.Repeat("a", 256),
	} {
		f.Add(s)
	}
	tr := newTree(f)
	root, err := filepath.EvalSymlinks(tr.root)
	must(f, err)
	a := newShare(f, tr.root, Options{})
	rf, err := a.Attach()
	must(f, err)
	defer rf.Close()

	f.Fuzz(func(t *testing.T, in string) {
		names := strings.Split(in, "\xff")
		if in == "" {
			names = nil
		}
		if len(names) > 16 {
			return
		}
		valid := true
		for _, n := range names {
			if checkName(n) != nil {
				valid = false
			}
		}
		qids, nf, err := rf.Walk(names)
		if err != nil {
			return
		}
		defer nf.Close()
		if !valid {
			t.Fatalf("walk %q succeeded with an invalid name", names)
		}
		if len(qids) != len(names) {
			t.Fatalf("walk %q: %d qids", names, len(qids))
		}
		p, err := os.Readlink(procPath(nf.(*file).fd))
		if err != nil {
			t.Fatal(err)
		}
		if p != root && !strings.HasPrefix(p, root+"/") {
			t.Fatalf("walk %q reached %s, outside %s", names, p, root)
		}
		if _, _, err := nf.Open(p9.ReadOnly); err == nil {
			buf := make([]byte, 64)
			n, _ := nf.ReadAt(buf, 0)
			if strings.Contains(string(buf[:n]), secretText) {
				t.Fatalf("walk %q read the secret", names)
			}
		}
	})
}
