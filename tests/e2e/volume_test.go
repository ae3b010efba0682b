package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// volumeEntry is what `capsa volume ls|inspect` shows of a volume.
type volumeEntry struct {
	Name   string   `json:"name"`
	Quota  int64    `json:"quota"`
	Used   int64    `json:"used"`
	InUse  bool     `json:"in_use"`
	UsedBy []string `json:"used_by"`
}

func inspectVolume(t *testing.T, cli func(time.Duration, ...string) result, name string) volumeEntry {
	t.Helper()
	r := cli(time.Minute, "volume", "inspect", name)
	var vs []volumeEntry
	if err := json.Unmarshal([]byte(r.stdout), &vs); r.code != 0 || err != nil || len(vs) != 1 {
		t.Fatalf("capsa volume inspect %s = exit %d, %v; stdout %q", name, r.code, err, r.stdout)
	}
	return vs[0]
}

// onHostDisk is what the files under dir take on the host's disk.
func onHostDisk(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		n += fi.Sys().(*syscall.Stat_t).Blocks * 512
		return nil
	})
	if err != nil {
		t.Fatalf("walking %s: %v", dir, err)
	}
	return n
}

// TestSharedVolume is cersei's shared-volume recipe: two detached
// sandboxes (two supervisor processes) mount one named volume read-write;
// what one writes the other reads, and the host sees. The volume cannot
// be removed while they run, and says who uses it.
func TestSharedVolume(t *testing.T) {
	dir, cli := detachedState(t)
	if r := cli(time.Minute, "volume", "create", "shared"); r.code != 0 || r.stdout != "shared\n" {
		t.Fatalf("capsa volume create shared = exit %d, %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	for _, n := range []string{"a", "b"} {
		if r := cli(3*time.Minute, "run", "-d", "--name", n, "-v", "shared:/shared", "--", "sleep", "600"); r.code != 0 {
			t.Fatalf("capsa run -d --name %s -v shared:/shared = exit %d, stderr %q", n, r.code, r.stderr)
		}
	}
	if r := cli(time.Minute, "exec", "a", "--", "sh", "-c", "echo hello from a > /shared/note.txt"); r.code != 0 {
		t.Fatalf("capsa exec a (write /shared/note.txt) = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "b", "--", "cat", "/shared/note.txt"); r.code != 0 || r.stdout != "hello from a\n" {
		t.Fatalf("capsa exec b -- cat /shared/note.txt = exit %d, %q; want 0, %q", r.code, r.stdout, "hello from a\n")
	}
	// And back the other way, into a file a has read before.
	if r := cli(time.Minute, "exec", "b", "--", "sh", "-c", "echo and from b >> /shared/note.txt"); r.code != 0 {
		t.Fatalf("capsa exec b (append) = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "a", "--", "cat", "/shared/note.txt"); r.stdout != "hello from a\nand from b\n" {
		t.Errorf("capsa exec a -- cat /shared/note.txt = %q, want both lines", r.stdout)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "volumes", "shared", "data", "note.txt")); err != nil || string(b) != "hello from a\nand from b\n" {
		t.Errorf("the host's copy = %q, %v; want both lines", b, err)
	}

	r := cli(time.Minute, "volume", "rm", "shared")
	if r.code == 0 || !strings.Contains(r.stderr, "in use by a, b") {
		t.Errorf("capsa volume rm shared while a and b run = exit %d, stderr %q; want it refused naming a, b", r.code, r.stderr)
	}
	if v := inspectVolume(t, cli, "shared"); !v.InUse || strings.Join(v.UsedBy, ",") != "a,b" {
		t.Errorf("capsa volume inspect shared = %+v, want in use by a and b", v)
	}
	if r := cli(2*time.Minute, "stop", "a", "b"); r.code != 0 {
		t.Fatalf("capsa stop a b = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "volume", "rm", "shared"); r.code != 0 {
		t.Errorf("capsa volume rm shared after stop = exit %d, stderr %q", r.code, r.stderr)
	}
	// A volume that does not exist is an error before anything boots.
	r = cli(time.Minute, "run", "-v", "shared:/shared", "--", "true")
	if r.code != 2 || !strings.Contains(r.stderr, "capsa volume create shared") {
		t.Errorf("capsa run -v shared:/shared after rm = exit %d, stderr %q; want 2 and how to make it", r.code, r.stderr)
	}
}

// TestVolumeQuota: a 10 MiB volume refuses the guest's dd of 20 MiB with
// ENOSPC, also when two sandboxes write at once, and the host's disk never
// holds more than 10 MiB of it.
func TestVolumeQuota(t *testing.T) {
	const quota = 10 << 20
	dir, cli := detachedState(t)
	data := filepath.Join(dir, "volumes", "small", "data")
	if r := cli(time.Minute, "volume", "create", "small", "--size", "10M"); r.code != 0 {
		t.Fatalf("capsa volume create small --size 10M = exit %d, stderr %q", r.code, r.stderr)
	}
	// The write(2) that passes the quota fails with ENOSPC: the test
	// binary's fillraw probe writes 1 MiB at a time with write(2),
	// going on after a short write, until the first error. (Linux's 9p
	// client, with cache=readahead, answers the write that crosses the
	// quota with the part that fit, the next with ENOSPC, and any write
	// after that, also a first write to another file of the full
	// volume, with 0 bytes and no error; Go's os.File reports that 0 as
	// "unexpected EOF", and so does u-root's dd.)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	r := cli(3*time.Minute, "run", "-v", "small:/vol", "-v", filepath.Dir(self)+":/probe:ro", "-e", probeEnv+"=1", "--",
		"/probe/"+filepath.Base(self), "fillraw", "/vol/big")
	if !strings.Contains(r.stdout, "enospc=true") {
		t.Errorf("the fillraw probe in a 10 MiB volume = exit %d, %q; want its write to fail with ENOSPC", r.code, r.stdout)
	}
	if n := onHostDisk(t, data); n > quota {
		t.Errorf("the volume takes %d bytes of the host's disk, past its quota %d", n, quota)
	}
	if r := cli(time.Minute, "run", "-v", "small:/vol", "--", "rm", "/vol/big"); r.code != 0 {
		t.Fatalf("rm /vol/big = exit %d, stderr %q", r.code, r.stderr)
	}
	r = cli(3*time.Minute, "run", "-v", "small:/vol", "--", "dd", "if=/dev/zero", "of=/vol/big", "bs=1M", "count=20")
	if r.code == 0 {
		t.Errorf("dd of 20 MiB into a 10 MiB volume = exit 0, stderr %q; want a failure", r.stderr)
	}
	if n := onHostDisk(t, data); n > quota {
		t.Errorf("the volume takes %d bytes of the host's disk, past its quota %d", n, quota)
	}
	fi, err := os.Stat(filepath.Join(data, "big"))
	if err != nil || fi.Size() < quota-(1<<20) {
		t.Errorf("the guest's file on the host: %v, %v; want it filled to within 1 MiB of the quota", fi, err)
	}
	if v := inspectVolume(t, cli, "small"); v.Quota != quota || v.Used > quota || v.InUse {
		t.Errorf("capsa volume inspect small = %+v, want quota %d, used within it, not in use", v, quota)
	}
	// The guest's df sees the quota, and what is left of it.
	r = cli(3*time.Minute, "run", "-v", "small:/vol", "--", "sh", "-c", "rm /vol/big && df -k /vol")
	if r.code != 0 || !strings.Contains(r.stdout, "10240") {
		t.Errorf("df -k /vol in the guest = exit %d, %q; want a size of 10240 KiB", r.code, r.stdout)
	}

	// Two sandboxes, two processes, writing at once.
	for _, n := range []string{"w1", "w2"} {
		if r := cli(3*time.Minute, "run", "-d", "--name", n, "-v", "small:/vol", "--", "sleep", "600"); r.code != 0 {
			t.Fatalf("capsa run -d --name %s -v small:/vol = exit %d, stderr %q", n, r.code, r.stderr)
		}
	}
	var wg sync.WaitGroup
	results := make([]result, 2)
	for i, n := range []string{"w1", "w2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = cli(3*time.Minute, "exec", n, "--", "dd", "if=/dev/zero", "of=/vol/"+n, "bs=1M", "count=20")
		}()
	}
	wg.Wait()
	for i, r := range results {
		if r.code == 0 {
			t.Errorf("w%d's dd of 20 MiB beside the other's = exit 0, want ENOSPC (stderr %q)", i+1, r.stderr)
		}
	}
	if n := onHostDisk(t, data); n > quota {
		t.Errorf("after two writers at once the volume takes %d bytes of the host's disk, past its quota %d", n, quota)
	}
	// Deleting frees the space for the other sandbox at once.
	if r := cli(time.Minute, "exec", "w1", "--", "rm", "/vol/w1", "/vol/w2"); r.code != 0 {
		t.Fatalf("capsa exec w1 -- rm = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "exec", "w2", "--", "dd", "if=/dev/zero", "of=/vol/again", "bs=1M", "count=8"); r.code != 0 {
		t.Errorf("dd of 8 MiB after the volume was emptied = exit %d, stderr %q", r.code, r.stderr)
	}
}
