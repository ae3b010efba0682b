package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
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
	hostAfter := time.Now()
	fi, err := sb.Stat(ctx, "/tmp/now")
	if err != nil {
		t.Fatal(err)
	}
	// Stamped between the host's times around the write, give or take 2 s.
	if m := time.Unix(0, fi.ModTimeNs); m.Before(hostNow.Add(-2*time.Second)) || m.After(hostAfter.Add(2*time.Second)) {
		t.Errorf("the guest's wall clock after Resume stamped a file %v, the host wrote it between %v and %v: want within 2s", m, hostNow, hostAfter)
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

// TestSuspendResumeCLI: capsa suspend writes a detached sandbox to disk
// and ends its VM (its supervisor process is gone and ps says suspended);
// capsa resume restores it where it was: a file in the guest's memory
// (/tmp) and a process an exec left running are still there, and the
// snapshot goes. A sandbox with a disk cannot be suspended and runs on.
func TestSuspendResumeCLI(t *testing.T) {
	dir, cli := detachedState(t)
	st, err := store.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if r := cli(3*time.Minute, "run", "-d", "--name", "s", "--memory", "256M", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --name s = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "s", "--", "sh", "-c", "echo kept > /tmp/mark"); r.code != 0 {
		t.Fatalf("capsa exec s (a file in /tmp) = exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	// A process that outlives its exec's client, in the agent's table.
	bg := exec.Command(artifact(t, "capsa"), "exec", "s", "--", "sleep", "7777")
	bg.Env = append(os.Environ(), "CAPSA_STATE="+dir, "CAPSA_METRICS_TOKEN=metrics-test-token")
	if err := bg.Start(); err != nil {
		t.Fatal(err)
	}
	var before agent.ProcessInfo
	for deadline := time.Now().Add(time.Minute); before.PID == 0; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			bg.Process.Kill()
			t.Fatal("capsa top s never listed sleep 7777")
		}
		before, _ = sleeper(t, cli)
	}
	bg.Process.Kill()
	bg.Wait()
	rec, err := st.Get("s")
	if err != nil || rec.PID == 0 {
		t.Fatalf("the record of s: %+v, %v", rec, err)
	}
	supervisorPID := rec.PID
	if r := cli(2*time.Minute, "suspend", "s"); r.code != 0 || r.stdout != "s\n" {
		t.Fatalf("capsa suspend s = exit %d, stdout %q, stderr %q; want 0 and s", r.code, r.stdout, r.stderr)
	}
	if e := psAll(t, cli)["s"]; e.State != "suspended" {
		t.Errorf("capsa ps: s is %q (%s) after suspend, want suspended", e.State, e.Reason)
	}
	// It ends with its VM: gone, or a zombie until whoever adopted it
	// reaps it (a moment, longer on a slow host).
	ended := func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", supervisorPID))
		if err != nil {
			return syscall.Kill(supervisorPID, 0) == syscall.ESRCH
		}
		_, after, _ := strings.Cut(string(b), ") ")
		return strings.HasPrefix(after, "Z")
	}
	for deadline := time.Now().Add(10 * time.Second); !ended() && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
	}
	if !ended() {
		t.Errorf("the supervisor of the suspended sandbox (pid %d) still runs, want it ended with its VM", supervisorPID)
	}
	snap := filepath.Join(st.SandboxDir("s"), "suspended")
	if _, err := os.Stat(filepath.Join(snap, "manifest.json")); err != nil {
		t.Errorf("the suspended sandbox's snapshot: %v", err)
	}
	if r := cli(time.Minute, "exec", "s", "--", "true"); r.code == 0 || !strings.Contains(r.stderr, "suspended") || !strings.Contains(r.stderr, "capsa resume s") {
		t.Errorf("capsa exec into a suspended sandbox = exit %d, stderr %q; want a failure naming the suspension and capsa resume", r.code, r.stderr)
	}
	// Not of an image, it has no disk to boot again from: only its
	// memory, which --reboot would drop.
	if r := cli(time.Minute, "resume", "--reboot", "s"); r.code == 0 || !strings.Contains(r.stderr, "not an image sandbox") {
		t.Errorf("capsa resume --reboot s = exit %d, stderr %q; want a refusal: not an image sandbox", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "resume", "s"); r.code != 0 || r.stdout != "s\n" {
		t.Fatalf("capsa resume s (from disk) = exit %d, stdout %q, stderr %q; want 0 and s", r.code, r.stdout, r.stderr)
	}
	if e := psAll(t, cli)["s"]; e.State != "running" {
		t.Errorf("capsa ps: s is %q (%s) after resume, want running", e.State, e.Reason)
	}
	if r := cli(time.Minute, "exec", "s", "--", "cat", "/tmp/mark"); r.code != 0 || r.stdout != "kept\n" {
		t.Errorf("after resume from disk: cat /tmp/mark = exit %d, stdout %q, stderr %q; want kept", r.code, r.stdout, r.stderr)
	}
	if after, top := sleeper(t, cli); after.ID != before.ID || after.PID != before.PID || after.Exit != nil {
		t.Errorf("after resume from disk: sleep 7777 in capsa top = %+v, want %+v still running\n%s", after, before, top)
	}
	if _, err := os.Stat(snap); !os.IsNotExist(err) {
		t.Errorf("the snapshot of a resumed sandbox: stat = %v, want it gone", err)
	}
	// Not of an image, it has no disk to keep alone.
	if r := cli(time.Minute, "suspend", "--no-memory", "s"); r.code == 0 || !strings.Contains(r.stderr, "not an image sandbox") {
		t.Errorf("capsa suspend --no-memory s = exit %d, stderr %q; want a refusal: not an image sandbox", r.code, r.stderr)
	}
	if e := psAll(t, cli)["s"]; e.State != "running" {
		t.Errorf("capsa ps: s is %q (%s) after a refused suspension, want running", e.State, e.Reason)
	}

	// A sandbox with a disk cannot be snapshotted: refused, and it runs on.
	disk := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(disk, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := cli(3*time.Minute, "run", "-d", "--name", "d", "--memory", "256M", "--disk", disk, "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --name d --disk = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(2*time.Minute, "suspend", "d"); r.code == 0 || !strings.Contains(r.stderr, "disks") {
		t.Errorf("capsa suspend of a sandbox with a disk = exit %d, stderr %q; want a refusal naming its disks", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "d", "--", "echo", "on"); r.code != 0 || r.stdout != "on\n" {
		t.Errorf("capsa exec d after a refused suspend = exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}

	// A suspended sandbox is removed as an ended one is, snapshot and all.
	if r := cli(2*time.Minute, "suspend", "s"); r.code != 0 {
		t.Fatalf("capsa suspend s (again) = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "rm", "s"); r.code != 0 {
		t.Fatalf("capsa rm of a suspended sandbox = exit %d, stderr %q", r.code, r.stderr)
	}
	if _, ok := psAll(t, cli)["s"]; ok {
		t.Error("capsa ps -a still lists s after capsa rm")
	}
	if _, err := os.Stat(st.SandboxDir("s")); !os.IsNotExist(err) {
		t.Errorf("the removed sandbox's directory: stat = %v, want it gone", err)
	}
}

// sleeper is the process sleep 7777 in capsa top s, if listed, and top's
// output.
func sleeper(t *testing.T, cli func(time.Duration, ...string) result) (agent.ProcessInfo, string) {
	t.Helper()
	r := cli(time.Minute, "top", "--format", "json", "s")
	var procs []agent.ProcessInfo
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &procs) != nil {
		t.Fatalf("capsa top --format json s = exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	for _, p := range procs {
		if len(p.Argv) == 2 && p.Argv[1] == "7777" {
			return p, r.stdout
		}
	}
	return agent.ProcessInfo{}, r.stdout
}
