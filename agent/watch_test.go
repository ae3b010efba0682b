package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestRename(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "a"), 0o755)
	os.MkdirAll(filepath.Join(dir, "b"), 0o755)
	os.WriteFile(filepath.Join(dir, "a", "f"), []byte("x"), 0o644)
	// Across directories, as a share's rename must be too.
	if err := cl.Rename(ctx, filepath.Join(dir, "a", "f"), filepath.Join(dir, "b", "g")); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "b", "g")); err != nil || string(b) != "x" {
		t.Errorf("after the rename: %q, %v", b, err)
	}
	err := cl.Rename(ctx, filepath.Join(dir, "a", "f"), filepath.Join(dir, "b", "h"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("renaming a missing file: %v; want a not-exist error", err)
	}
	if err := cl.Rename(ctx, filepath.Join(dir, "b", "g"), "relative"); err == nil {
		t.Error("a relative target was taken")
	}
}

// TestStatOwners: a file's owner and group come by ID and by name.
func TestStatOwners(t *testing.T) {
	cl := serve(t)
	fi, err := cl.Stat(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if fi.UID != os.Getuid() || fi.GID != os.Getgid() {
		t.Errorf("uid %d gid %d; want %d %d", fi.UID, fi.GID, os.Getuid(), os.Getgid())
	}
	if want := readIDNames("/etc/passwd")[os.Getuid()]; fi.Owner != want {
		t.Errorf("owner %q; want %q", fi.Owner, want)
	}
}

// TestWatch: changes in a watched tree come as they happen, named from the
// watched directory, recursive ones included, and what a new directory
// held before its watch began is reported too.
func TestWatch(t *testing.T) {
	cl := serve(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "old", "deep"), 0o755)
	w, err := cl.Watch(ctx, dir, true, false)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	want := map[string]string{}
	expect := func(name, op string) { want[name+" "+op] = "" }
	os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644)
	expect("f", WatchCreate)
	os.WriteFile(filepath.Join(dir, "old", "deep", "g"), []byte("x"), 0o644)
	expect("old/deep/g", WatchCreate)
	// A tree made at once: its inner files may be made before the new
	// directory is watched.
	os.MkdirAll(filepath.Join(dir, "new", "a", "b"), 0o755)
	os.WriteFile(filepath.Join(dir, "new", "a", "b", "h"), []byte("x"), 0o644)
	expect("new", WatchCreate)
	expect("new/a/b/h", WatchCreate)
	os.Chmod(filepath.Join(dir, "f"), 0o600)
	expect("f", WatchChmod)
	os.Rename(filepath.Join(dir, "f"), filepath.Join(dir, "old", "f2"))
	expect("f", WatchRename)
	expect("old/f2", WatchCreate)
	os.Remove(filepath.Join(dir, "old", "f2"))
	expect("old/f2", WatchRemove)
	for len(want) > 0 {
		ev, err := w.Next()
		if err != nil {
			t.Fatalf("still waiting for %v: %v", want, err)
		}
		delete(want, ev.Name+" "+ev.Op)
	}
	// Only a directory is watched.
	if _, err := cl.Watch(ctx, filepath.Join(dir, "old", "deep", "g"), false, false); err == nil {
		t.Error("watching a file succeeded")
	}
	if _, err := cl.Watch(ctx, filepath.Join(dir, "nope"), false, false); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("watching a missing directory: %v", err)
	}
}

// TestDialPort: a guest port reached through the agent carries bytes both
// ways, with each side's end; a closed port is an error.
func TestDialPort(t *testing.T) {
	cl := serve(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b, _ := io.ReadAll(c) // to the host's end
		c.Write(append([]byte("echo:"), b...))
	}()
	pc, err := cl.DialPort(ctx, l.Addr().(*net.TCPAddr).Port)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	big := bytes.Repeat([]byte("x"), 3*chunk+5)
	if _, err := pc.Write(big); err != nil {
		t.Fatal(err)
	}
	pc.CloseWrite()
	got, err := io.ReadAll(pc)
	if err != nil || !bytes.Equal(got, append([]byte("echo:"), big...)) {
		t.Errorf("read back %d bytes, %v; want %d", len(got), err, len(big)+5)
	}
	l.Close()
	if _, err := cl.DialPort(ctx, l.Addr().(*net.TCPAddr).Port); err == nil {
		t.Error("dialing a closed port succeeded")
	}
	if _, err := cl.DialPort(ctx, 70000); err == nil {
		t.Error("port 70000 was taken")
	}
}

// TestXattrs: a write sets user attributes with the file, a stat and a
// listing return them when asked, and bad ones are refused.
func TestXattrs(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	dir := t.TempDir()
	if err := unix.Setxattr(dir, "user.capsa-probe", []byte("1"), 0); err != nil {
		t.Skipf("the test's file system holds no user attributes: %v", err)
	}
	p := filepath.Join(dir, "f")
	if err := cl.WriteFileXattrs(ctx, p, 0o644, strings.NewReader("x"), map[string]string{"e2b.k": "v", "e2b.other": "w"}); err != nil {
		t.Fatal(err)
	}
	fi, err := cl.StatXattrs(ctx, p)
	if err != nil || fi.Xattrs["e2b.k"] != "v" || fi.Xattrs["e2b.other"] != "w" {
		t.Errorf("StatXattrs = %+v, %v", fi, err)
	}
	if fi, _ := cl.Stat(ctx, p); fi.Xattrs != nil {
		t.Errorf("Stat, not asked, gave %v", fi.Xattrs)
	}
	list, err := cl.ListDirXattrs(ctx, dir)
	if err != nil || len(list) != 1 || list[0].Xattrs["e2b.k"] != "v" {
		t.Errorf("ListDirXattrs = %+v, %v", list, err)
	}
	big := map[string]string{}
	for i := range MaxXattrs + 1 {
		big[fmt.Sprint(i)] = "v"
	}
	for _, bad := range []map[string]string{big, {"": "v"}, {"k": strings.Repeat("v", MaxXattrValue+1)}} {
		if err := cl.WriteFileXattrs(ctx, p, 0o644, strings.NewReader("y"), bad); err == nil {
			t.Errorf("a write with %d attributes (%.20v) succeeded", len(bad), bad)
		}
	}
	if b, _ := os.ReadFile(p); string(b) != "x" {
		t.Errorf("a refused write changed the file: %q", b)
	}
}

// TestTimeoutKillsTheWholeGroup: at an exec's timeout, what its process
// group still runs is killed, whether its leader still runs or ended
// before, even while something in it keeps starting more (as a fork
// bomb's copies do).
func TestTimeoutKillsTheWholeGroup(t *testing.T) {
	cl := serve(t)
	for _, script := range []string{
		// The leader runs on; a spawner in the group starts more.
		"(while :; do sleep 60 & sleep 0.005; done) & sleep 60",
		// The leader ends at once, leaving the spawner and its children.
		"(while :; do sleep 60 & sleep 0.005; done) & exit 0",
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		p, err := cl.Start(ctx, ExecOptions{Shell: script, Timeout: 300 * time.Millisecond})
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		pgid := p.PID
		t.Cleanup(func() {
			for unix.Kill(-pgid, unix.SIGKILL) == nil {
				time.Sleep(time.Millisecond)
			}
		})
		p.Wait()
		deadline := time.Now().Add(killLeftoversFor + 5*time.Second)
		for groupHasMembers(pgid) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if groupHasMembers(pgid) {
			t.Errorf("%q: its group still has live members %v after its timeout", script, killLeftoversFor+5*time.Second)
		}
		cancel()
	}
}
