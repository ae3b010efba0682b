package shim

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// TestSharePodDir: the pod's directory becomes a mount of its own, shared
// in a peer group of its own (not /'s, where / is shared), and sharing it
// again mounts nothing twice; its removal unmounts it with what is
// beneath, and refuses to remove a directory something is still mounted
// in.
//
// It runs on a thread of its own in a mount namespace of its own, cut off
// from the machine's peer groups (made private: an unshared copy of a
// shared mount is still its peer) and then made shared anew, as a host's
// / is under systemd, so that nothing it mounts reaches the machine's
// (mountinfo reads the thread's own table).
func TestSharePodDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	dir := filepath.Join(t.TempDir(), "pod")
	done := make(chan struct{})
	go func() {
		defer close(done)
		// Never unlocked: the thread, in its own namespace, ends with
		// the goroutine.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			t.Errorf("unshare: %v", err)
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			t.Errorf("make / private: %v", err)
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SHARED, ""); err != nil {
			t.Errorf("make / shared: %v", err)
			return
		}
		testSharePodDir(t, dir)
	}()
	<-done
}

func testSharePodDir(t *testing.T, dir string) {
	for range 2 {
		if err := sharePodDir(dir); err != nil {
			t.Error(err)
			return
		}
	}
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err != nil || len(mounts) != 1 {
		t.Errorf("mounts at %s: %v, %v; want one", dir, mounts, err)
		return
	}
	group := sharedGroup(mounts[0].Optional)
	if group == "" {
		t.Errorf("%s's mount: %q; want shared", dir, mounts[0].Optional)
	}
	parents := mustMounts(t, mountinfo.ParentsFilter(dir))
	var above *mountinfo.Info // the nearest mount above the directory's
	for _, m := range parents {
		if m.Mountpoint != dir && (above == nil || len(m.Mountpoint) > len(above.Mountpoint)) {
			above = m
		}
	}
	if above == nil || sharedGroup(above.Optional) == "" {
		t.Errorf("the mount above %s is not shared (%+v): the test would show nothing", dir, above)
	}
	for _, m := range parents {
		if m.Mountpoint != dir && sharedGroup(m.Optional) == group {
			t.Errorf("%s's mount is in the peer group of %s's (%s); want one of its own", dir, m.Mountpoint, group)
		}
	}
	sub := filepath.Join(dir, "c1", "rootfs")
	if !mountTmpfs(t, sub) {
		return
	}
	if err := removePodDir(dir); err != nil {
		t.Errorf("removePodDir = %v", err)
		return
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("after removePodDir, %s: %v; want it gone", dir, err)
	}
	if left := mustMounts(t, mountinfo.PrefixFilter(dir)); len(left) > 0 {
		t.Errorf("mounts left at or beneath %s: %v", dir, left)
	}

	// A mount the directory's own unmount does not take: refused.
	if !mountTmpfs(t, sub) {
		return
	}
	if err := removePodDir(dir); err == nil || !strings.Contains(err.Error(), "not removed") {
		t.Errorf("removePodDir with a mount left beneath = %v; want it refused", err)
	}
	if _, err := os.Stat(sub); err != nil {
		t.Errorf("the mount left beneath: %v; want it untouched", err)
	}
}

// mountTmpfs makes dir and mounts a tmpfs on it; false, with the test
// failed, if it cannot.
func mountTmpfs(t *testing.T, dir string) bool {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Error(err)
		return false
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Error(err)
		return false
	}
	return true
}

func sharedGroup(optional string) string {
	for _, f := range strings.Fields(optional) {
		if g, ok := strings.CutPrefix(f, "shared:"); ok {
			return g
		}
	}
	return ""
}

func mustMounts(t *testing.T, f mountinfo.FilterFunc) []*mountinfo.Info {
	t.Helper()
	m, err := mountinfo.GetMounts(f)
	if err != nil {
		t.Error(err)
	}
	return m
}
