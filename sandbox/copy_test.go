package sandbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/capsa-sandbox/capsa/agent"
)

// unixGuest reaches an agent on the Unix socket at sock.
func unixGuest(sock string) *Guest {
	return NewGuest(&agent.Client{Name: "test", Dial: func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}, nil, "", 0, nil)
}

// localGuest is the real agent serving this machine's files, as a guest's
// would.
func localGuest(t *testing.T) *Guest {
	t.Helper()
	return unixGuest(serveAgent(t))
}

// serveAgent runs the real agent on a Unix socket until the test ends and
// returns the socket's path.
func serveAgent(t *testing.T) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); l.Close() })
	go (&agent.Server{}).Serve(ctx, l)
	return sock
}

func TestCopyInAndOut(t *testing.T) {
	g := localGuest(t)
	ctx := context.Background()
	src := t.TempDir()
	tree := filepath.Join(src, "tree")
	os.MkdirAll(filepath.Join(tree, "sub", "deeper"), 0o750)
	os.WriteFile(filepath.Join(tree, "a.txt"), []byte("alpha"), 0o640)
	os.WriteFile(filepath.Join(tree, "sub", "deeper", "b.bin"), bytes.Repeat([]byte{7}, 300<<10), 0o755)
	os.Symlink("../a.txt", filepath.Join(tree, "sub", "link"))
	os.Chmod(filepath.Join(tree, "a.txt"), 0o4640) // setuid must not come back

	guestDir := t.TempDir() // "the guest's" directory
	if err := g.CopyIn(ctx, tree, guestDir); err != nil {
		t.Fatalf("CopyIn(tree, %s) = %v", guestDir, err)
	}
	out := t.TempDir()
	if err := g.CopyOut(ctx, filepath.Join(guestDir, "tree"), out); err != nil {
		t.Fatalf("CopyOut(tree, %s) = %v", out, err)
	}
	got := filepath.Join(out, "tree")
	for p, want := range map[string]string{"a.txt": "alpha", "sub/deeper/b.bin": strings.Repeat("\x07", 300<<10)} {
		if b, err := os.ReadFile(filepath.Join(got, p)); err != nil || string(b) != want {
			t.Errorf("copied %s: %d bytes, %v; want %d bytes", p, len(b), err, len(want))
		}
	}
	if fi, err := os.Stat(filepath.Join(got, "sub", "deeper", "b.bin")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("mode of b.bin = %v, %v; want 0755", fi.Mode(), err)
	}
	if fi, err := os.Stat(filepath.Join(got, "a.txt")); err != nil || fi.Mode()&os.ModeSetuid != 0 {
		t.Errorf("mode of a.txt = %v, %v; want no setuid", fi.Mode(), err)
	}
	if fi, err := os.Stat(filepath.Join(got, "sub")); err != nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("mode of sub = %v, %v; want 0750", fi.Mode(), err)
	}
	if l, err := os.Readlink(filepath.Join(got, "sub", "link")); err != nil || l != "../a.txt" {
		t.Errorf("copied symlink = %q, %v; want ../a.txt", l, err)
	}
	// A file to a new name; over an existing file is refused.
	if err := g.CopyOut(ctx, filepath.Join(guestDir, "tree", "a.txt"), filepath.Join(out, "renamed")); err != nil {
		t.Fatalf("CopyOut(a.txt, renamed) = %v", err)
	}
	if err := g.CopyOut(ctx, filepath.Join(guestDir, "tree", "a.txt"), filepath.Join(out, "renamed")); err == nil {
		t.Error("CopyOut over an existing file succeeded")
	}
	if err := g.CopyOut(ctx, "relative", out); err == nil {
		t.Error("CopyOut of a relative guest path succeeded")
	}
}

// hostileGuest answers every stat with a directory and every listing with
// entries, as a guest that lies would.
func hostileGuest(t *testing.T, entries []agent.FileInfo) *Guest {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer nc.Close()
				c := agent.NewConn(nc)
				c.ReadFrame()
				c.WriteJSON(agent.FrameHello, agent.Hello{Version: agent.ProtocolVersion, Name: "liar"})
				_, b, _ := c.ReadFrame()
				var req agent.Request
				json.Unmarshal(b, &req)
				switch req.Op {
				case agent.OpStat:
					c.WriteJSON(agent.FrameReply, agent.FileInfo{Name: "d", IsDir: true, Mode: uint32(os.ModeDir | 0o755)})
				case agent.OpList:
					c.WriteJSON(agent.FrameReply, agent.DirList{Entries: entries})
				}
			}()
		}
	}()
	return unixGuest(sock)
}

// A guest's listing cannot lead CopyOut outside its destination, and an
// endless tree ends.
func TestCopyOutHostileGuest(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{"..", ".", "../escape", "a/b", "", "x\x00y"} {
		out := t.TempDir()
		g := hostileGuest(t, []agent.FileInfo{{Name: name, Mode: 0o644}})
		if err := g.CopyOut(ctx, "/d", filepath.Join(out, "dst")); err == nil || !strings.Contains(err.Error(), "bad entry name") {
			t.Errorf("CopyOut with a guest entry %q = %v, want a bad entry name error", name, err)
		}
	}
	out := t.TempDir()
	g := hostileGuest(t, []agent.FileInfo{{Name: "x", IsSymlink: true, Target: "/etc", Mode: uint32(os.ModeSymlink | 0o777)},
		{Name: "x", IsDir: true, Mode: uint32(os.ModeDir | 0o755)}})
	if err := g.CopyOut(ctx, "/d", filepath.Join(out, "dst")); err == nil || !strings.Contains(err.Error(), "bad entry name") {
		t.Errorf("CopyOut with a name listed twice (a symlink, then a directory) = %v, want a bad entry name error", err)
	}
	// Every directory holds itself again: the depth bound ends it.
	g = hostileGuest(t, []agent.FileInfo{{Name: "again", IsDir: true, Mode: uint32(os.ModeDir | 0o755)}})
	if err := g.CopyOut(ctx, "/d", filepath.Join(out, "deep")); err == nil || !strings.Contains(err.Error(), "deep") {
		t.Errorf("CopyOut of an endless tree = %v, want the depth bound", err)
	}
}

// TestReadFilesFromAnOlderAgent: a guest whose agent does not announce
// OpReadFiles (one restored from an older snapshot) is read one file at a
// time, with the same answers and the same bound on each file.
func TestReadFilesFromAnOlderAgent(t *testing.T) {
	sock := serveAgent(t)
	var asked []string
	var mu sync.Mutex
	// The real agent, its Hello without the feature and every request
	// recorded: an older agent speaks the same protocol less the
	// operation.
	older := NewGuest(&agent.Client{Name: "test", Dial: func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		up, err := d.DialContext(ctx, "unix", sock)
		if err != nil {
			return nil, err
		}
		mine, theirs := net.Pipe()
		go func() {
			defer up.Close()
			defer theirs.Close()
			u, c := agent.NewConn(up), agent.NewConn(theirs)
			var h agent.Hello
			if c.ReadJSON(agent.FrameHello, &h) != nil || u.WriteJSON(agent.FrameHello, h) != nil || u.ReadJSON(agent.FrameHello, &h) != nil {
				return
			}
			h.Features = slices.DeleteFunc(h.Features, func(f string) bool { return f == agent.FeatureReadFiles })
			var req agent.Request
			if c.WriteJSON(agent.FrameHello, h) != nil || c.ReadJSON(agent.FrameRequest, &req) != nil || u.WriteJSON(agent.FrameRequest, req) != nil {
				return
			}
			mu.Lock()
			asked = append(asked, req.Op)
			mu.Unlock()
			go io.Copy(up, theirs)
			io.Copy(theirs, up)
		}()
		return mine, nil
	}}, nil, "", 0, nil)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "a"), []byte("alpha"), 0o644)
	os.WriteFile(filepath.Join(dir, "big"), make([]byte, agent.MaxReadFileSize+1), 0o644)
	got, err := older.ReadFiles(context.Background(), []string{filepath.Join(dir, "a"), filepath.Join(dir, "missing"), filepath.Join(dir, "big")})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || string(got[0].Data) != "alpha" || got[0].Err != nil || !errors.Is(got[1].Err, fs.ErrNotExist) ||
		!errors.Is(got[2].Err, syscall.EFBIG) {
		t.Errorf("ReadFiles from an older agent = %+v", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{agent.OpRead, agent.OpRead, agent.OpRead}; !slices.Equal(asked, want) {
		t.Errorf("the older agent was asked %v, want %v", asked, want)
	}
}
