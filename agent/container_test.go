package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestContainerCheck(t *testing.T) {
	good := Container{Root: "/capsa-pod/c1/rootfs", Mounts: []ContainerMount{
		{Destination: "/proc", Type: "proc"},
		{Destination: "/dev", Type: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/etc/hosts", Type: "bind", Source: "/capsa-pod/c1/mounts/3", Options: []string{"rbind", "ro"}},
	}, Rlimits: []Rlimit{{Type: "RLIMIT_NOFILE", Soft: 1024, Hard: 1024}}}
	if err := good.Check(); err != nil {
		t.Fatalf("Check(ctr's container) = %v", err)
	}
	for _, c := range []struct {
		name, want string
		change     func(*Container)
	}{
		{"relative root", "container root", func(c *Container) { c.Root = "rootfs" }},
		{"root /", "container root", func(c *Container) { c.Root = "/" }},
		{"relative destination", "not absolute", func(c *Container) { c.Mounts[0].Destination = "proc" }},
		{"unknown type", `type "ext4"`, func(c *Container) { c.Mounts[0].Type = "ext4" }},
		{"relative bind source", "not an absolute guest path", func(c *Container) { c.Mounts[2].Source = "mounts/3" }},
		{"option with a comma", "bad option", func(c *Container) { c.Mounts[1].Options = append(c.Mounts[1].Options, "a,b") }},
		{"unknown rlimit", "RLIMIT_X", func(c *Container) { c.Rlimits[0].Type = "RLIMIT_X" }},
		{"soft above hard", "soft 2048 above hard", func(c *Container) { c.Rlimits[0].Soft = 2048 }},
		{"too many mounts", "more than", func(c *Container) {
			c.Mounts = make([]ContainerMount, maxContainerMounts+1)
		}},
	} {
		c2 := good
		c2.Mounts = append([]ContainerMount(nil), good.Mounts...)
		c2.Rlimits = append([]Rlimit(nil), good.Rlimits...)
		c.change(&c2)
		if err := c2.Check(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Check = %v, want an error naming %q", c.name, err, c.want)
		}
	}
}

func TestMountFlags(t *testing.T) {
	flags, remount, data, err := mountFlags(ContainerMount{Destination: "/dev", Type: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}})
	if err != nil || flags != unix.MS_NOSUID|unix.MS_STRICTATIME || remount != 0 || data != "mode=755,size=65536k" {
		t.Errorf("tmpfs: flags %#x remount %#x data %q err %v", flags, remount, data, err)
	}
	flags, remount, _, err = mountFlags(ContainerMount{Destination: "/etc/hosts", Type: "bind", Source: "/x", Options: []string{"rbind", "ro", "nosuid"}})
	if err != nil || flags != unix.MS_BIND|unix.MS_REC || remount != unix.MS_RDONLY|unix.MS_NOSUID {
		t.Errorf("read-only bind: flags %#x remount %#x err %v; want the bind, then a remount read-only", flags, remount, err)
	}
}

// TestOpenInStaysInTheRoot: a symbolic link in the container's root (an
// image's tree) that points outside it is resolved inside the root, so a
// mount's target is never made or found outside.
func TestOpenInStaysInTheRoot(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	if err := os.Symlink(outside, filepath.Join(root, "etc")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../../../..", filepath.Join(root, "up")); err != nil {
		t.Fatal(err)
	}
	if f, err := openIn(root, "/etc/hosts", true); err == nil {
		f.Close()
	}
	if _, err := os.Stat(filepath.Join(outside, "hosts")); err == nil {
		t.Fatalf("openIn followed the root's etc -> %s out of the root", outside)
	}
	f, err := openIn(root, "/up/proc", false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	if got != filepath.Join(root, "proc") {
		t.Errorf("openIn(/up/proc) = %s, want %s (.. stops at the root)", got, filepath.Join(root, "proc"))
	}
	f2, err := openIn(root, "/a/b/c", true)
	if err != nil {
		t.Fatal(err)
	}
	f2.Close()
	if st, err := os.Stat(filepath.Join(root, "a/b/c")); err != nil || !st.Mode().IsRegular() {
		t.Errorf("openIn(/a/b/c, file) made %v, %v; want the directories and an empty file", st, err)
	}
}

func TestCapabilities(t *testing.T) {
	m, err := capMask([]string{"CAP_CHOWN", "CAP_KILL", "CAP_SETPCAP", "CAP_SETFCAP", "CAP_CHECKPOINT_RESTORE"})
	if err != nil || m != 1<<0|1<<5|1<<8|1<<31|1<<40 {
		t.Errorf("capMask = %#x, %v", m, err)
	}
	c := Container{Root: "/r", Capabilities: &Capabilities{Bounding: []string{"CAP_CHOWN"}, Ambient: []string{"CAP_NOPE"}}}
	if err := c.Check(); err == nil || !strings.Contains(err.Error(), "CAP_NOPE") {
		t.Errorf("Check with an unknown capability = %v, want it named", err)
	}
	if len(capNumbers) != unix.CAP_LAST_CAP+1 {
		t.Errorf("capNumbers names %d capabilities, want every one up to CAP_LAST_CAP (%d)", len(capNumbers), unix.CAP_LAST_CAP)
	}
}

// TestMaskAndReadonlyPaths masks a directory and a file and makes a
// directory read-only inside a root, in a mount namespace of the test's
// own; paths that do not exist are left alone.
func TestMaskAndReadonlyPaths(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	runtime.LockOSThread() // never unlocked: the thread ends with the test
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	defer func() {
		for _, p := range []string{"secret", "file", "ro"} {
			unix.Unmount(filepath.Join(root, p), unix.MNT_DETACH)
		}
	}()
	for _, d := range []string{"secret", "ro"} {
		os.MkdirAll(filepath.Join(root, d), 0o755)
	}
	os.WriteFile(filepath.Join(root, "secret", "key"), []byte("k"), 0o600)
	os.WriteFile(filepath.Join(root, "file"), []byte("contents"), 0o644)
	for _, p := range []string{"/secret", "/file", "/missing"} {
		if err := maskPath(root, p); err != nil {
			t.Fatalf("maskPath(%s): %v", p, err)
		}
	}
	if err := readonlyPath(root, "/ro"); err != nil {
		t.Fatal(err)
	}
	if err := readonlyPath(root, "/missing"); err != nil {
		t.Errorf("readonlyPath of a missing path = %v, want nil", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(root, "secret")); len(ents) != 0 {
		t.Errorf("the masked directory shows %d entries, want none", len(ents))
	}
	if b, _ := os.ReadFile(filepath.Join(root, "file")); len(b) != 0 {
		t.Errorf("the masked file reads %q, want nothing", b)
	}
	if err := os.WriteFile(filepath.Join(root, "ro", "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("a write in the read-only directory = %v, want EROFS", err)
	}
	if _, err := os.Stat(filepath.Join(root, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a missing path was made: %v", err)
	}
}

func TestCgroupLimits(t *testing.T) {
	l := CgroupLimits{MemoryMax: 64 << 20, CPUQuota: 50000, CPUWeight: 39}
	want := [][2]string{{"memory.max", "67108864"}, {"pids.max", "max"}, {"cpu.max", "50000 100000"}, {"cpu.weight", "39"}}
	if got := l.Files(); !reflect.DeepEqual(got, want) {
		t.Errorf("Files = %q, want %q", got, want)
	}
	if got := (CgroupLimits{}).Files(); !reflect.DeepEqual(got, [][2]string{{"memory.max", "max"}, {"pids.max", "max"}, {"cpu.max", "max 100000"}}) {
		t.Errorf("no limits: Files = %q, want every limit lifted", got)
	}
	for _, bad := range []ContainerCgroup{
		{Name: "../x"}, {Name: ""}, {Name: "a/b"}, {Name: ".hidden"},
		{Name: "c", Limits: CgroupLimits{MemoryMax: -1}},
		{Name: "c", Limits: CgroupLimits{CPUPeriod: 10}},
		{Name: "c", Limits: CgroupLimits{CPUWeight: 20000}},
	} {
		if err := bad.Check(); err == nil {
			t.Errorf("Check(%+v) = nil, want an error", bad)
		}
	}
	if err := (&ContainerCgroup{Name: "3f2a_b.c-d"}).Check(); err != nil {
		t.Errorf("Check of a containerd id: %v", err)
	}
}
