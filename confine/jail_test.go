package confine

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// jailChild is the test binary as a process spawned in a mount namespace
// of its own: it jails itself as 65534:65534 with the directories the
// test made, tries what it may and may not reach, and prints what each
// got.
func jailChild() int {
	ro, rw, own, shared := os.Getenv("JAIL_RO"), os.Getenv("JAIL_RW"), os.Getenv("JAIL_OWN"), os.Getenv("JAIL_SHARED")
	what, err := Jail(JailConfig{
		Read: []string{ro, "/proc/self", "/nonexistent/skipped"}, Write: []string{rw, own, shared, filepath.Join(rw, "sub")},
		User: &User{65534, 65534}, Own: []string{own}, Shared: []string{shared},
	}, slog.New(slog.DiscardHandler))
	if err != nil {
		json.NewEncoder(os.Stdout).Encode(map[string]string{"jail": err.Error()})
		return 0
	}
	got := map[string]string{"jail": what, "uid": strconv.Itoa(os.Getuid()), "gid": strconv.Itoa(os.Getgid())}
	try := recorder(got)
	_, err = os.ReadFile(filepath.Join(ro, "f"))
	try("read ro", err)
	try("write ro", os.WriteFile(filepath.Join(ro, "new"), nil, 0o644))
	try("write rw", os.WriteFile(filepath.Join(rw, "new"), []byte("x"), 0o644))
	try("remove a directory beneath rw", os.Remove(filepath.Join(rw, "sub"))) // not a mount point of its own
	try("write own", os.WriteFile(filepath.Join(own, "f"), []byte("x"), 0o644))
	try("write shared", os.WriteFile(shared, []byte("x"), 0o600))
	_, err = os.ReadFile(os.Getenv("JAIL_OUTSIDE"))
	try("read outside", err)
	_, err = os.ReadFile("/etc/hostname")
	try("read /etc/hostname", err)
	_, err = os.ReadFile("/proc/self/status")
	try("read /proc/self/status", err)
	if f, err := os.Open(filepath.Join(ro, "f")); err == nil {
		_, err = os.ReadFile("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
		try("reopen through /proc/self/fd", err)
		f.Close()
	}
	try("write /dev/null", os.WriteFile("/dev/null", []byte("x"), 0))
	try("mount", unix.Mount("none", rw, "tmpfs", 0, ""))
	try("create in /", os.WriteFile("/new", nil, 0o644))
	try("setuid 0", syscall.Setuid(0))
	root, _ := os.ReadDir("/")
	var names []string
	for _, e := range root {
		names = append(names, e.Name())
	}
	got["/"] = filepath.Join(names...)
	json.NewEncoder(os.Stdout).Encode(got)
	return 0
}

// TestJail spawns the test binary in a new mount namespace (as root) and
// checks what the jailed child sees, and that it runs as the user given.
func TestJail(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the jail needs root")
	}
	base := t.TempDir()
	dirs := map[string]string{}
	for _, d := range []string{"ro", "rw", "rw/sub", "own", "outside"} {
		dirs[d] = filepath.Join(base, d)
		if err := os.Mkdir(dirs[d], 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(dirs["rw"], 0o777)
	os.Chmod(base, 0o700) // the jail's own directories must be what lets the user through
	if err := os.WriteFile(filepath.Join(dirs["ro"], "f"), []byte("ro"), 0o644); err != nil {
		t.Fatal(err)
	}
	outside := filepath.Join(dirs["outside"], "secret")
	shared := filepath.Join(base, "shared.db")
	for _, f := range []string{outside, shared} {
		if err := os.WriteFile(f, []byte("s"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=jail", "JAIL_RO="+dirs["ro"], "JAIL_RW="+dirs["rw"], "JAIL_OWN="+dirs["own"],
		"JAIL_SHARED="+shared, "JAIL_OUTSIDE="+outside)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	got := childResult(t, cmd, "the jailed child")
	t.Logf("jail: %s", got["jail"])
	if got["jail"] != "mount namespace, 6 paths, uid 65534 gid 65534" {
		t.Fatalf("Jail() = %q, want mount namespace, 6 paths, uid 65534 gid 65534", got["jail"])
	}
	want := map[string]string{
		"uid": "65534", "gid": "65534",
		"read ro": "ok", "write rw": "ok", "remove a directory beneath rw": "ok", "write own": "ok", "write shared": "ok",
		"read /proc/self/status": "ok", "reopen through /proc/self/fd": "ok", "write /dev/null": "ok",
		"write ro":           "open " + filepath.Join(dirs["ro"], "new") + ": read-only file system",
		"read outside":       "open " + outside + ": no such file or directory",
		"read /etc/hostname": "open /etc/hostname: no such file or directory",
		"mount":              unix.EPERM.Error(),
		"create in /":        "open /new: read-only file system",
		"setuid 0":           unix.EPERM.Error(),
	}
	want["/"] = filepath.Join(slices.Sorted(slices.Values([]string{"dev", "proc", firstComponent(base)}))...)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("jailed child: %s = %q, want %q", k, got[k], v)
		}
	}
	// Outside, nothing changed but the owner of own and the ACL of
	// shared.
	var st unix.Stat_t
	if err := unix.Stat(dirs["own"], &st); err != nil || st.Uid != 65534 {
		t.Errorf("the owner of %s = %d (%v), want 65534", dirs["own"], st.Uid, err)
	}
	if err := unix.Stat(dirs["rw"]+"/new", &st); err != nil || st.Uid != 65534 {
		t.Errorf("the owner of the file the child made = %d (%v), want 65534", st.Uid, err)
	}
	if _, err := os.Stat("/etc/hostname"); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the host's /etc/hostname: %v", err)
	}
}

func firstComponent(p string) string {
	for i := 1; i < len(p); i++ {
		if p[i] == '/' {
			return p[1:i]
		}
	}
	return p[1:]
}

// TestJailRefusedOutsideItsNamespace: a process that was not spawned in a
// mount namespace of its own is refused, before anything changes.
func TestJailRefusedOutsideItsNamespace(t *testing.T) {
	own, err := InOwnMountNamespace()
	if err != nil {
		t.Skip(err)
	}
	if own {
		t.Skip("this test process runs in a mount namespace of its own")
	}
	_, err = Jail(JailConfig{Read: []string{"/etc"}}, slog.New(slog.DiscardHandler))
	if !errors.Is(err, errUnavailable) {
		t.Errorf("Jail() outside its own namespace = %v, want unavailable", err)
	}
}

func TestGrantACL(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to set another user's entry")
	}
	f := filepath.Join(t.TempDir(), "db")
	if err := os.WriteFile(f, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, uid := range []int{65534, 1000, 65534} {
		if err := grantACL(f, uid); err != nil {
			t.Fatalf("grantACL(%s, %d) = %v", f, uid, err)
		}
	}
	buf := make([]byte, 256)
	n, err := unix.Getxattr(f, aclXattr, buf)
	if err != nil {
		t.Fatal(err)
	}
	var got []aclEntry
	for b := buf[4:n]; len(b) >= 8; b = b[8:] {
		got = append(got, aclEntry{binary.LittleEndian.Uint16(b), binary.LittleEndian.Uint16(b[2:]), binary.LittleEndian.Uint32(b[4:])})
	}
	want := []aclEntry{{aclUserObj, 6, aclNoID}, {aclUser, 6, 1000}, {aclUser, 6, 65534}, {aclGroup, 0, aclNoID}, {aclMask, 6, aclNoID}, {aclOther, 0, aclNoID}}
	if !slices.Equal(got, want) {
		t.Errorf("the ACL after three grants = %v, want %v", got, want)
	}
}

func TestParseUser(t *testing.T) {
	for in, want := range map[string]User{"65534": {65534, 65534}, "1000:100": {1000, 100}, "0:0": {0, 0}} {
		if got, err := ParseUser(in); err != nil || got != want {
			t.Errorf("ParseUser(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "nobody", "1:", ":1", "-1", "4294967295", "1:2:3"} {
		if got, err := ParseUser(in); err == nil {
			t.Errorf("ParseUser(%q) = %v, want an error", in, got)
		}
	}
}
