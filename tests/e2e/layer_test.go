package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/supervisor"
)

// TestIncrementalSnapshot: a second snapshot of a running sandbox, taken
// as a layer over its first after 10 MiB of new data, is at most a fifth
// of a full snapshot of the same state on disk, and restores to the same state: the data
// whole, the main process counting on. The parent cannot be removed from
// under it, a chain without its parent is refused by name, and a squash
// makes the layer whole, after which the parent may go.
func TestIncrementalSnapshot(t *testing.T) {
	dir, cli := detachedState(t)
	if r := cli(3*time.Minute, "run", "-d", "--name", "s", "--memory", "256M", "--",
		"sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done"); r.code != 0 {
		t.Fatalf("capsa run -d = exit %d, stderr %q", r.code, r.stderr)
	}
	timed := func(args ...string) time.Duration {
		t.Helper()
		start := time.Now()
		if r := cli(3*time.Minute, args...); r.code != 0 {
			t.Fatalf("capsa %s = exit %d, stderr %q", strings.Join(args, " "), r.code, r.stderr)
		}
		return time.Since(start)
	}
	sh := func(name, script string) string {
		t.Helper()
		r := cli(time.Minute, "exec", name, "--", "sh", "-c", script)
		if r.code != 0 {
			t.Fatalf("%s in %s: exit %d, stderr %q", script, name, r.code, r.stderr)
		}
		return strings.TrimSpace(r.stdout)
	}
	// A workspace's worth of files first: what the parent holds and a
	// full snapshot writes again each time.
	sh("s", "head -c 67108864 /dev/urandom > /tmp/workspace")
	fullTime := timed("snapshot", "create", "s", "full")
	sum := sh("s", "head -c 10485760 /dev/urandom > /tmp/big && md5sum /tmp/big")
	layerTime := timed("snapshot", "create", "--parent", "full", "s", "layer")
	// A full snapshot of the same state, to compare the layer with.
	againTime := timed("snapshot", "create", "s", "again")

	r := cli(time.Minute, "snapshot", "ls", "--format", "json")
	var infos []supervisor.SnapshotInfo
	if err := json.Unmarshal([]byte(r.stdout), &infos); r.code != 0 || err != nil {
		t.Fatalf("capsa snapshot ls = exit %d, %q (%v)", r.code, r.stdout, err)
	}
	size := map[string]int64{}
	for _, in := range infos {
		size[in.Name] = in.DiskBytes
		if in.Name == "layer" && (in.Parent != "full" || in.Chain != 2) {
			t.Errorf("the layer is listed with parent %q, chain %d; want full, 2", in.Parent, in.Chain)
		}
	}
	mib := func(n int64) float64 { return float64(n) / (1 << 20) }
	t.Logf("the parent: %.1f MiB on disk in %v; after 10 MiB written, the layer over it: %.1f MiB in %v, a full snapshot: %.1f MiB in %v",
		mib(size["full"]), fullTime.Round(time.Millisecond), mib(size["layer"]), layerTime.Round(time.Millisecond), mib(size["again"]), againTime.Round(time.Millisecond))
	if size["layer"] < 10<<20 || size["layer"]*5 > size["again"] {
		t.Errorf("the layer takes %d bytes, a full snapshot of the same state %d: want at least the 10 MiB written and at most a fifth", size["layer"], size["again"])
	}
	if r := cli(time.Minute, "snapshot", "inspect", "--verify", "layer"); r.code != 0 {
		t.Errorf("capsa snapshot inspect --verify layer = exit %d, stderr %q", r.code, r.stderr)
	}

	// Restored from the layer: the data written after the parent, and
	// the main process, which counts on.
	restored := func(snap, name string) {
		t.Helper()
		if r := cli(3*time.Minute, "snapshot", "restore", snap, "--name", name); r.code != 0 {
			t.Fatalf("capsa snapshot restore %s = exit %d, stderr %q", snap, r.code, r.stderr)
		}
		if got := sh(name, "md5sum /tmp/big"); got != sum {
			t.Errorf("%s: /tmp/big sums to %q, want %q", name, got, sum)
		}
		a, _ := strconv.Atoi(sh(name, catCount))
		time.Sleep(time.Second)
		b, _ := strconv.Atoi(sh(name, catCount))
		if a == 0 || b <= a {
			t.Errorf("%s: the main process's counter went from %d to %d; want it counting", name, a, b)
		}
	}
	restored("layer", "r1")

	if r := cli(time.Minute, "snapshot", "rm", "full"); r.code != 1 || !strings.Contains(r.stderr, "layer lie over it") {
		t.Errorf("capsa snapshot rm full (a layer's parent) = exit %d, stderr %q", r.code, r.stderr)
	}
	snaps := filepath.Join(dir, "snapshots")
	if err := os.Rename(filepath.Join(snaps, "full"), filepath.Join(snaps, "elsewhere")); err != nil {
		t.Fatal(err)
	}
	if r := cli(time.Minute, "snapshot", "restore", "layer"); r.code != 1 || !strings.Contains(r.stderr, "its parent") {
		t.Errorf("capsa snapshot restore of a layer without its parent = exit %d, stderr %q; want it refused naming the parent", r.code, r.stderr)
	}
	os.Rename(filepath.Join(snaps, "elsewhere"), filepath.Join(snaps, "full"))

	if r := cli(3*time.Minute, "snapshot", "squash", "layer"); r.code != 0 {
		t.Fatalf("capsa snapshot squash layer = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "snapshot", "rm", "full"); r.code != 0 {
		t.Fatalf("capsa snapshot rm full after the squash = exit %d, stderr %q", r.code, r.stderr)
	}
	restored("layer", "r2")
}
