package confine

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
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

// followHost is the test binary as the host of TestJailFollowsHostMounts,
// in a mount namespace of its own (made private first, so that nothing
// reaches the real host): it makes FOLLOW_DIR and FOLLOW_RO shared mounts,
// the first with a mount beneath it already, spawns two jailed children that bind it writable
// and FOLLOW_RO read-only, one following the host's mounts beneath
// FOLLOW_DIR and one not, and then mounts and unmounts beneath both
// directories, and looks for the follower's own mount. It prints what
// each saw.
func followHost() int {
	got := map[string]string{}
	try := recorder(got)
	dir, ro := os.Getenv("FOLLOW_DIR"), os.Getenv("FOLLOW_RO")
	defer json.NewEncoder(os.Stdout).Encode(got)
	for _, step := range []struct {
		what string
		err  func() error
	}{
		{"make / private", func() error { return unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, "") }},
		{"bind", func() error { return unix.Mount(dir, dir, "", unix.MS_BIND, "") }},
		{"make shared", func() error { return unix.Mount("", dir, "", unix.MS_SHARED, "") }},
		// The read-only path shared too, as every mount of a host whose
		// / is shared (systemd's): only the followed directory may take
		// what comes.
		{"bind the read-only", func() error { return unix.Mount(ro, ro, "", unix.MS_BIND, "") }},
		{"make it shared", func() error { return unix.Mount("", ro, "", unix.MS_SHARED, "") }},
		{"mount before", func() error { return unix.Mount("tmpfs", filepath.Join(dir, "pre"), "tmpfs", 0, "size=1m") }},
		{"write before", func() error { return os.WriteFile(filepath.Join(dir, "pre", "f"), []byte("there before"), 0o644) }},
	} {
		if err := step.err(); err != nil {
			try("host: "+step.what, err)
			return 0
		}
	}
	type jailed struct {
		name string
		in   io.WriteCloser
		out  *bufio.Reader
	}
	var children []*jailed
	for _, follow := range []string{"1", "0"} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"=follow-jail", "FOLLOW="+follow)
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS}
		cmd.Stderr = os.Stderr
		in, err1 := cmd.StdinPipe()
		out, err2 := cmd.StdoutPipe()
		if err := errors.Join(err1, err2, cmd.Start()); err != nil {
			try("host: spawn", err)
			return 0
		}
		children = append(children, &jailed{name: map[string]string{"1": "follower", "0": "not following"}[follow], in: in, out: bufio.NewReader(out)})
		defer cmd.Wait()
		defer in.Close()
	}
	// step tells each child to go on, and takes the line it answers.
	step := func(what string) {
		for _, j := range children {
			io.WriteString(j.in, what+"\n")
			line, err := j.out.ReadString('\n')
			if err != nil {
				got[j.name+": "+what] = "no answer: " + err.Error()
				continue
			}
			got[j.name+": "+what] = strings.TrimSpace(line)
		}
	}
	step("jail")
	try("host: mount beneath", unix.Mount("tmpfs", filepath.Join(dir, "sub"), "tmpfs", 0, "size=1m"))
	try("host: write in it", os.WriteFile(filepath.Join(dir, "sub", "f"), []byte("mounted"), 0o644))
	try("host: mount beneath the read-only", unix.Mount("tmpfs", filepath.Join(ro, "sub"), "tmpfs", 0, "size=1m"))
	try("host: write in that", os.WriteFile(filepath.Join(ro, "sub", "f"), []byte("mounted"), 0o644))
	step("read after the mounts")
	try("host: unmount", unix.Unmount(filepath.Join(dir, "sub"), unix.MNT_DETACH))
	step("read after the unmount")
	_, err := os.Stat(filepath.Join(dir, "own", "f"))
	try("host: the follower's own mount", err)
	return 0
}

// followJail is a child of followHost: it jails itself with FOLLOW_DIR
// writable and FOLLOW_RO read-only, following the host's mounts beneath
// FOLLOW_DIR or not (FOLLOW), and then, at each line its host writes,
// does the next step and answers in one line: what it reads of the files
// its host wrote, beneath a mount made before the jail and beneath the
// two made after.
func followJail() int {
	dir, ro := os.Getenv("FOLLOW_DIR"), os.Getenv("FOLLOW_RO")
	in := bufio.NewReader(os.Stdin)
	answer := func(s string) { fmt.Println(s) }
	next := func() bool { _, err := in.ReadString('\n'); return err == nil }
	read := func() string {
		var out []string
		for _, f := range []string{filepath.Join(dir, "pre", "f"), filepath.Join(dir, "sub", "f"), filepath.Join(ro, "sub", "f")} {
			b, err := os.ReadFile(f)
			if err != nil {
				b = []byte("none")
			}
			out = append(out, string(b))
		}
		return strings.Join(out, ", ")
	}
	if !next() {
		return 1
	}
	c := JailConfig{Read: []string{ro}, Write: []string{dir}}
	if os.Getenv("FOLLOW") == "1" {
		c.Follow = []string{dir}
	}
	what, err := Jail(c, slog.New(slog.DiscardHandler))
	if err != nil {
		answer("jail: " + err.Error())
		return 0
	}
	// A mount of its own beneath the directory, which must not reach
	// the host.
	own := filepath.Join(dir, "own")
	if err := unix.Mount("tmpfs", own, "tmpfs", 0, "size=1m"); err == nil {
		os.WriteFile(filepath.Join(own, "f"), []byte("x"), 0o644)
	}
	answer(what)
	for range 2 {
		if !next() {
			return 1
		}
		answer(read())
	}
	return 0
}

// TestJailFollowsHostMounts: a jail that follows the host's mounts beneath
// a directory holds what was mounted there before it, sees a mount made
// there after it was jailed, and its unmount, but not one made beneath a
// read-only path; one that does not follow sees none of them; and the
// follower's own mounts do not reach the host.
func TestJailFollowsHostMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the jail needs root")
	}
	base := t.TempDir()
	dir, ro := filepath.Join(base, "pod"), filepath.Join(base, "ro")
	for _, d := range []string{"pod/pre", "pod/sub", "pod/own", "ro/sub"} {
		if err := os.MkdirAll(filepath.Join(base, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=follow-host", "FOLLOW_DIR="+dir, "FOLLOW_RO="+ro)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS}
	got := childResult(t, cmd, "the host child")
	want := map[string]string{
		"host: mount beneath": "ok", "host: write in it": "ok", "host: mount beneath the read-only": "ok", "host: write in that": "ok", "host: unmount": "ok",
		"follower: jail":                        "mount namespace, 3 paths, following the host's mounts beneath 1 of them, uid 0",
		"not following: jail":                   "mount namespace, 3 paths, uid 0",
		"follower: read after the mounts":       "there before, mounted, none",
		"follower: read after the unmount":      "there before, none, none",
		"not following: read after the mounts":  "none, none, none",
		"not following: read after the unmount": "none, none, none",
		"host: the follower's own mount":        "stat " + filepath.Join(dir, "own", "f") + ": no such file or directory",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("the host child printed %v; want only %v", got, want)
	}
}
