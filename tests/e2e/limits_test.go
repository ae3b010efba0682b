package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// probeRate runs the test binary's rate job in the detached sandbox name
// of the state directory dir, with the capsa binary bin, and returns the rate it measured, in bytes a
// second. It may run in any goroutine.
func probeRate(bin, dir, name, self, job string) (float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "exec", "-e", netBenchEnv+"="+job, name, "--", "/probe/"+filepath.Base(self))
	cmd.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	out, err := cmd.Output()
	var n int64
	var secs float64
	if _, serr := fmt.Sscanf(string(out), "%d bytes in %g seconds", &n, &secs); err != nil || serr != nil || secs <= 0 {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		return 0, fmt.Errorf("in %s, %s: %v, %q (stderr %q)", name, job, err, out, stderr)
	}
	return float64(n) / secs, nil
}

// bulkServer serves size bytes to each connection on the host's loopback,
// and returns its port.
func bulkServer(t *testing.T, size int) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	data := make([]byte, size)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.Write(data)
			}()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

// TestIOLimits: a sandbox limited to 1 MB/s receives at that rate while
// another on the same host, unlimited, goes on receiving well above it; a
// disk limit holds writes to it, and `capsa update` raises it on the
// running sandbox, which then writes faster, up to the new rate. The rates
// are measured in the guest.
//
// What a limiter guarantees is an upper bound, so that is what the test
// holds tightly. How fast the nested host moves bytes when nothing holds
// them back varies from run to run (3.8 to 7.7 MB/s on the network here),
// so the limits sit well below that and the lower bounds ask only what any
// run's host gives: the limited sandbox near its limit, the other clearly
// above it, and after the raise clearly above the old limit.
func TestIOLimits(t *testing.T) {
	dir, cli := detachedState(t)
	bin := artifact(t, "capsa")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	const (
		size    = 8 << 20
		netRate = 1e6 // net-rx=1MB/s
	)
	port := bulkServer(t, size)
	disk := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(disk, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(disk, 64<<20); err != nil {
		t.Fatal(err)
	}
	allow := fmt.Sprintf("tcp/127.0.0.1:%d", port)
	for _, n := range []string{"l", "u"} {
		args := []string{"run", "-d", "--name", n, "--net", "--allow", allow, "-v", filepath.Dir(self) + ":/probe:ro"}
		if n == "l" {
			args = append(args, "--disk", disk, "--limit", "disk=1MB/s:256KB")
		}
		if r := cli(3*time.Minute, append(args, "--", "sleep", "100000")...); r.code != 0 {
			t.Fatalf("capsa run -d --name %s: exit %d, stderr %q", n, r.code, r.stderr)
		}
	}
	rec := func(name string) (limits string) {
		r := cli(time.Minute, "inspect", name)
		var recs []struct {
			Limits string `json:"limits"`
		}
		if err := json.Unmarshal([]byte(r.stdout), &recs); err != nil || len(recs) != 1 {
			t.Fatalf("capsa inspect %s: %q, %v", name, r.stdout, err)
		}
		return recs[0].Limits
	}
	if got := rec("u"); got != "none" {
		t.Errorf("capsa inspect u: limits %q, want none", got)
	}
	job := fmt.Sprintf("rate 10.0.2.2:%d", port)
	both := func() (l, u float64) {
		t.Helper()
		var wg sync.WaitGroup
		var lerr, uerr error
		wg.Add(2)
		go func() { defer wg.Done(); l, lerr = probeRate(bin, dir, "l", self, job) }()
		go func() { defer wg.Done(); u, uerr = probeRate(bin, dir, "u", self, job) }()
		wg.Wait()
		if err := errors.Join(lerr, uerr); err != nil {
			t.Fatal(err)
		}
		return l, u
	}
	one := func(job string) float64 {
		t.Helper()
		r, err := probeRate(bin, dir, "l", self, job)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	l0, u0 := both()
	t.Logf("no network limit: %.2f and %.2f MB/s", l0/1e6, u0/1e6)
	// Below twice the limit, a run could not tell the limit from the
	// host's own speed.
	if min(l0, u0) < 2*netRate {
		t.Fatalf("unlimited, they received at %.2f and %.2f MB/s: too slow to show a %.0f MB/s limit", l0/1e6, u0/1e6, netRate/1e6)
	}
	if r := cli(time.Minute, "update", "--limit", "net-rx=1MB/s:256KB", "l"); r.code != 0 || !strings.Contains(r.stdout, "net-rx=1MB/s:256KB") {
		t.Fatalf("capsa update --limit net-rx=1MB/s:256KB l: exit %d, %q, %q", r.code, r.stdout, r.stderr)
	}
	// Twice: the two transfers start a moment apart (two execs).
	for i := range 2 {
		l, u := both()
		t.Logf("l limited to 1 MB/s (frames, so about 0.96 MB/s of TCP payload): %.2f and %.2f MB/s", l/1e6, u/1e6)
		// The limit counts frames, headers included, and lets a
		// 256 KB burst through first: 8 MB at 1 MB/s less headers
		// plus the burst is at most 1.04 MB/s of payload.
		if l > 1.05*netRate {
			t.Errorf("run %d: the sandbox limited to 1 MB/s received at %.2f MB/s: over its limit", i, l/1e6)
		}
		if l < 0.85*netRate {
			t.Errorf("run %d: the sandbox limited to 1 MB/s received at only %.2f MB/s (%.2f unlimited): the limiter held it below its rate", i, l/1e6, l0/1e6)
		}
		// The other is not held to its neighbour's limit.
		if u < 1.5*netRate {
			t.Errorf("run %d: the unlimited sandbox received at %.2f MB/s beside the limited one (%.2f when neither was): held back", i, u/1e6, u0/1e6)
		}
	}
	if got := rec("l"); !strings.Contains(got, "net-rx=1MB/s:256KB") || !strings.Contains(got, "disk=1MB/s:256KB") {
		t.Errorf("capsa inspect l: limits %q; want the network's and the disk's", got)
	}

	// The disk: 3 MB at 1 MB/s, then 9 MB after raising it to 3 MB/s
	// (about three seconds each).
	d0 := one("diskwrite /dev/vda " + fmt.Sprint(3<<20))
	t.Logf("disk limited to 1 MB/s: %.2f MB/s", d0/1e6)
	if d0 < 0.8e6 || d0 > 1.2e6 {
		t.Errorf("writes to a disk limited to 1 MB/s went at %.2f MB/s; want within 20%%", d0/1e6)
	}
	if r := cli(time.Minute, "update", "--limit", "disk=3MB/s:256KB", "l"); r.code != 0 {
		t.Fatalf("capsa update --limit disk=3MB/s:256KB l: exit %d, %q", r.code, r.stderr)
	}
	d1 := one("diskwrite /dev/vda " + fmt.Sprint(9<<20))
	t.Logf("disk limit raised to 3 MB/s: %.2f MB/s", d1/1e6)
	if d1 > 3.6e6 {
		t.Errorf("writes after raising the disk limit to 3 MB/s went at %.2f MB/s: over the new limit", d1/1e6)
	}
	if d1 < 1.5e6 {
		t.Errorf("writes after raising the disk limit to 3 MB/s went at %.2f MB/s: the raise did not take (1 MB/s before it)", d1/1e6)
	}

	// Bad limits are refused, naming what is wrong, before anything runs.
	for _, bad := range []string{"net=fast", "disk=1KB", "cpu=2"} {
		r := cli(time.Minute, "update", "--limit", bad, "l")
		if r.code == 0 || !strings.Contains(r.stderr, "limit") {
			t.Errorf("capsa update --limit %s l: exit %d, stderr %q; want an error naming the limit", bad, r.code, r.stderr)
		}
		r = cli(time.Minute, "run", "--limit", bad, "--", "true")
		if r.code == 0 || !strings.Contains(r.stderr, "limit") {
			t.Errorf("capsa run --limit %s: exit %d, stderr %q; want an error naming the limit", bad, r.code, r.stderr)
		}
	}
}
