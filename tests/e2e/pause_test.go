package e2e

import (
	"context"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestPauseResume: a busy loop makes no progress while its sandbox is
// paused (its vCPU threads take no CPU time and an exec waits), the guest
// sees no time pass (its uptime skips the pause), and after Resume the
// loop goes on and the guest's wall clock is the host's.
func TestPauseResume(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sb := startSandbox(t, ctx, sandbox.New())
	loop, err := sb.Stream(ctx, sandbox.ExecOptions{Argv: []string{"sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; done"}})
	if err != nil {
		t.Fatal(err)
	}
	defer loop.Signal(context.Background(), "SIGKILL")
	count := func() int {
		t.Helper()
		// The loop truncates the file before each write: a read may
		// fall between the two.
		for range 20 {
			b, err := sb.ReadFile(ctx, "/tmp/count")
			if err != nil {
				t.Fatalf("ReadFile(/tmp/count) = %v", err)
			}
			if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
				return n
			}
		}
		t.Fatal("/tmp/count was never whole in 20 reads")
		return 0
	}
	uptime := func() float64 {
		t.Helper()
		b, err := sb.ReadFile(ctx, "/proc/uptime")
		f := strings.Fields(string(b))
		if err != nil || len(f) == 0 {
			t.Fatalf("ReadFile(/proc/uptime) = %q, %v", b, err)
		}
		u, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	time.Sleep(time.Second)
	before := count()
	up1, host1 := uptime(), time.Now()

	if err := sb.Pause(ctx); err != nil {
		t.Fatalf("Pause() = %v", err)
	}
	if !sb.Paused() || !sb.Debug(ctx).Paused {
		t.Fatalf("Paused() = %v, Debug().Paused = %v after Pause; want true", sb.Paused(), sb.Debug(ctx).Paused)
	}
	if err := sb.Pause(ctx); err != nil {
		t.Errorf("Pause() of a paused sandbox = %v, want nil", err)
	}
	st1, err := sb.Stats()
	if err != nil {
		t.Fatal(err)
	}
	// A guest operation waits: the agent does not run.
	short, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	_, err = sb.Exec(short, sandbox.ExecOptions{Argv: []string{"true"}})
	cancelShort()
	if err == nil {
		t.Error("Exec() while paused = nil error, want it to wait past its deadline")
	}
	time.Sleep(time.Second)
	st2, err := sb.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if used := st2.CPUTime - st1.CPUTime; used > 50*time.Millisecond {
		t.Errorf("the vCPU threads used %v of CPU time over %v paused, want none", used, st2.Taken.Sub(st1.Taken))
	}
	if err := sb.Resume(ctx); err != nil {
		t.Fatalf("Resume() = %v", err)
	}
	if sb.Paused() {
		t.Fatal("Paused() = true after Resume")
	}
	up2, host2 := uptime(), time.Now()
	// The guest's monotonic time skipped the 3 s paused.
	if hostGap, guestGap := host2.Sub(host1).Seconds(), up2-up1; guestGap > hostGap-2.5 {
		t.Errorf("guest uptime went on by %.2fs over %.2fs of host time with 3s paused; want the pause skipped", guestGap, hostGap)
	}
	// The guest's wall clock, as the time it stamps on a file it writes
	// (u-root's date prints no epoch seconds).
	hostNow := time.Now()
	if err := sb.WriteFile(ctx, "/tmp/now", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	fi, err := sb.Stat(ctx, "/tmp/now")
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Unix(0, fi.ModTimeNs).Sub(hostNow); math.Abs(d.Seconds()) > 2 {
		t.Errorf("the guest's wall clock is %v off the host's after Resume, want within 2s", d.Round(time.Millisecond))
	}
	time.Sleep(time.Second)
	if after := count(); after <= before {
		t.Errorf("the loop's count went from %d to %d after Resume, want it going on", before, after)
	}
}

// TestPauseResumeCLI: capsa pause and resume on a detached sandbox, by
// name; an exec into a paused sandbox is refused with a hint, and a paused
// sandbox still stops.
func TestPauseResumeCLI(t *testing.T) {
	_, cli := detachedState(t)
	if r := cli(3*time.Minute, "run", "-d", "--name", "p", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --name p = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "pause", "p"); r.code != 0 || r.stdout != "p\n" {
		t.Fatalf("capsa pause p = exit %d, stdout %q, stderr %q; want 0 and p", r.code, r.stdout, r.stderr)
	}
	if got := psAll(t, cli)["p"].State; got != "paused" {
		t.Errorf("capsa ps: p is %q after pause, want paused", got)
	}
	if r := cli(time.Minute, "exec", "p", "--", "true"); r.code == 0 || !strings.Contains(r.stderr, "paused") || !strings.Contains(r.stderr, "capsa resume p") {
		t.Errorf("capsa exec into a paused sandbox = exit %d, stderr %q; want a failure naming the pause and capsa resume", r.code, r.stderr)
	}
	if r := cli(time.Minute, "resume", "p"); r.code != 0 || r.stdout != "p\n" {
		t.Fatalf("capsa resume p = exit %d, stdout %q, stderr %q; want 0 and p", r.code, r.stdout, r.stderr)
	}
	if r := cli(time.Minute, "exec", "p", "--", "echo", "back"); r.code != 0 || r.stdout != "back\n" {
		t.Errorf("capsa exec after resume = exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	if r := cli(time.Minute, "resume", "nosuch"); r.code == 0 || !strings.Contains(r.stderr, "nosuch") {
		t.Errorf("capsa resume nosuch = exit %d, stderr %q; want an error naming it", r.code, r.stderr)
	}
	if r := cli(time.Minute, "pause", "p"); r.code != 0 {
		t.Fatalf("capsa pause p (again) = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(2*time.Minute, "stop", "p"); r.code != 0 {
		t.Fatalf("capsa stop of a paused sandbox = exit %d, stderr %q", r.code, r.stderr)
	}
	if e := psAll(t, cli)["p"]; e.State != "exited" {
		t.Errorf("capsa ps: p is %q (%s) after stop, want exited", e.State, e.Reason)
	}
}
