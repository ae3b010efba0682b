package e2e

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// psEntry is what `capsa ps --format json` lists.
type psEntry struct {
	Name     string `json:"name"`
	State    string `json:"state"`
	ExitCode *int   `json:"exit_code"`
	Reason   string `json:"reason"`
}

// detachedCLI runs capsa with its state in dir.
func detachedCLI(t *testing.T, dir string) func(timeout time.Duration, args ...string) result {
	return func(timeout time.Duration, args ...string) result {
		t.Helper()
		return capsaWith(t, timeout, func(c *exec.Cmd) { c.Env = append(os.Environ(), "CAPSA_STATE="+dir, "CAPSA_DEBUG=1") }, args...)
	}
}

func psAll(t *testing.T, cli func(time.Duration, ...string) result) map[string]psEntry {
	t.Helper()
	r := cli(time.Minute, "ps", "-a", "--format", "json")
	var rows []psEntry
	if err := json.Unmarshal([]byte(r.stdout), &rows); r.code != 0 || err != nil {
		t.Fatalf("capsa ps -a --format json = exit %d, %v; stdout %q", r.code, err, r.stdout)
	}
	m := map[string]psEntry{}
	for _, row := range rows {
		m[row.Name] = row
	}
	return m
}

// detachedState gives a test a state directory of its own and the CLI on
// it; at cleanup the sandboxes left running are killed, and on failure
// their files logged.
func detachedState(t *testing.T) (string, func(time.Duration, ...string) result) {
	dir := t.TempDir()
	t.Cleanup(func() {
		if t.Failed() {
			logSandboxFiles(t, dir)
		}
		stopAll(t, dir)
	})
	return dir, detachedCLI(t, dir)
}

// openByName reaches the detached sandbox name in the state directory dir
// through the library, with a context that ends with the test (or in two
// minutes).
func openByName(t *testing.T, dir, name string) (context.Context, *supervisor.Handle) {
	t.Helper()
	m, err := supervisor.OpenManager(dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	h, err := m.Open(ctx, name)
	if err != nil {
		t.Fatalf("Manager.Open(%s) = %v", name, err)
	}
	return ctx, h
}

// stopAll stops whatever the test left running, at cleanup.
func stopAll(t testing.TB, dir string) {
	st, err := store.Open(dir)
	if err != nil {
		return
	}
	recs, _ := st.List()
	for _, r := range recs {
		if r.Alive() && r.PID > 0 {
			syscall.Kill(r.PID, syscall.SIGKILL)
		}
	}
}

// TestDetachedSandbox: `run -d` leaves a sandbox running after the CLI has
// exited; exec, logs, ps, stop and rm reach it by name; names are unique
// under concurrent runs; a killed supervisor reads as crashed and its name
// can be used again; --ttl stops a sandbox by itself; another user cannot
// reach it.
func TestDetachedSandbox(t *testing.T) {
	dir, cli := detachedState(t)

	r := cli(3*time.Minute, "run", "-d", "--name", "w", "--", "sh", "-c", "echo started; while true; do echo tick; sleep 1; done")
	if r.code != 0 || r.stdout != "w\n" {
		t.Fatalf("capsa run -d --name w = exit %d, stdout %q; want 0, %q", r.code, r.stdout, "w\n")
	}
	// The CLI has exited (capsaWith waited for it): the sandbox serves.
	if r := cli(time.Minute, "exec", "w", "--", "sh", "-c", "echo written > /tmp/f"); r.code != 0 {
		t.Fatalf("capsa exec w (write) = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "w", "--", "cat", "/tmp/f"); r.code != 0 || r.stdout != "written\n" {
		t.Fatalf("capsa exec w -- cat /tmp/f = exit %d, %q; want 0, %q", r.code, r.stdout, "written\n")
	}
	if r := cli(time.Minute, "exec", "-e", "X=7", "w", "--", "sh", "-c", "exit $X"); r.code != 7 {
		t.Errorf("capsa exec w -- exit 7 = exit %d, want 7 (stderr %q)", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "nosuch", "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "no such sandbox") {
		t.Errorf("capsa exec nosuch = exit %d, stderr %q; want 125 naming the missing sandbox", r.code, r.stderr)
	}

	// The library reaches it by name, with typed guest errors.
	ctx, h := openByName(t, dir, "w")
	if _, err := h.ReadFile(ctx, "/no/such/file"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ReadFile(/no/such/file) = %v, want an error that is fs.ErrNotExist", err)
	}
	if out, err := h.Exec(ctx, sandbox.Command("cat", "/tmp/f")); err != nil || string(out.Stdout) != "written\n" {
		t.Errorf("Exec(cat /tmp/f) through the handle = %+v, %v", out, err)
	}

	// logs: what the main process wrote, then more as it comes.
	if r := logsShow(t, cli, "w", "started\n"); r.code != 0 || !strings.HasPrefix(r.stdout, "started\n") {
		t.Errorf("capsa logs w = exit %d, %q; want it to start with %q", r.code, r.stdout, "started\n")
	}
	followLogs(t, dir)
	copyBothWays(t, cli)
	checkStats(t, cli)

	// Two runs of one name at once: one sandbox, one clear error.
	var wg sync.WaitGroup
	results := make([]result, 2)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = cli(3*time.Minute, "run", "-d", "--name", "dup", "--", "sleep", "3600")
		}()
	}
	wg.Wait()
	if ok := (results[0].code == 0) != (results[1].code == 0); !ok {
		t.Fatalf("two concurrent run -d --name dup: exits %d and %d, want exactly one 0", results[0].code, results[1].code)
	}
	for _, r := range results {
		if r.code != 0 && (r.code != 2 || !strings.Contains(r.stderr, `"dup" is taken`)) {
			t.Errorf("the losing run -d --name dup = exit %d, stderr %q; want 2 saying the name is taken", r.code, r.stderr)
		}
	}

	// Another user gets a permission error, not a sandbox.
	asNobody := func(c *exec.Cmd) {
		c.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000}}
		c.Env = []string{"CAPSA_STATE=" + dir, "HOME=/tmp"}
	}
	if r := capsaWith(t, time.Minute, asNobody, "exec", "w", "--", "true"); r.code == 0 || !strings.Contains(r.stderr, "permission denied") {
		t.Errorf("capsa exec w as uid 1000 = exit %d, stderr %q; want a permission error", r.code, r.stderr)
	}

	// stop: the main process gets SIGTERM; ps -a shows how it ended.
	if r := cli(time.Minute, "stop", "w"); r.code != 0 {
		t.Fatalf("capsa stop w = exit %d, stderr %q", r.code, r.stderr)
	}
	if e := psAll(t, cli)["w"]; e.State != "exited" || e.ExitCode == nil || *e.ExitCode != 128+15 {
		t.Errorf("ps -a after stop: w = %+v, want exited with code 143 (SIGTERM)", e)
	}
	if r := cli(time.Minute, "exec", "w", "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "not running") {
		t.Errorf("capsa exec of a stopped sandbox = exit %d, stderr %q; want 125, not running", r.code, r.stderr)
	}
	if r := cli(time.Minute, "rm", "w"); r.code != 0 {
		t.Errorf("capsa rm w = exit %d, stderr %q", r.code, r.stderr)
	}
	if _, ok := psAll(t, cli)["w"]; ok {
		t.Error("ps -a still lists w after rm")
	}

	// A supervisor killed with SIGKILL: crashed, removable, name reusable.
	st, err := store.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := st.Get("dup")
	if err != nil || rec.PID == 0 {
		t.Fatalf("the record of dup = %+v, %v", rec, err)
	}
	if r := cli(time.Minute, "rm", "dup"); r.code == 0 {
		t.Error("capsa rm of a running sandbox succeeded without -f")
	}
	syscall.Kill(rec.PID, syscall.SIGKILL)
	deadline := time.Now().Add(30 * time.Second)
	for psAll(t, cli)["dup"].State != "crashed" {
		if time.Now().After(deadline) {
			t.Fatalf("ps -a after SIGKILL of dup's supervisor: %+v, want crashed", psAll(t, cli)["dup"])
		}
		time.Sleep(200 * time.Millisecond)
	}
	if r := cli(time.Minute, "rm", "dup"); r.code != 0 {
		t.Fatalf("capsa rm of a crashed sandbox = exit %d, stderr %q", r.code, r.stderr)
	}
	start := time.Now()
	if r := cli(3*time.Minute, "run", "-d", "--name", "dup", "--ttl", "5s", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("run -d --name dup after rm = exit %d, stderr %q", r.code, r.stderr)
	}
	if e := waitExited(t, cli, "dup", 2*time.Minute); !strings.Contains(e.Reason, "TTL") || time.Since(start) < 5*time.Second {
		t.Errorf("dup ended after %v: %+v; want its TTL of 5s", time.Since(start), e)
	}
	checkIdleTimeout(t, cli)
}

// checkStats: `capsa stats --no-stream` measures the CPU use of a busy loop
// in the running sandbox w, and its resident guest memory.
func checkStats(t *testing.T, cli func(time.Duration, ...string) result) {
	t.Helper()
	busy := make(chan result, 1)
	go func() {
		// Sent even if cli gives up on this goroutine (t.Fatal).
		var r result
		defer func() { busy <- r }()
		r = cli(time.Minute, "exec", "--timeout", "20s", "w", "--", "sh", "-c", "while :; do :; done")
	}()
	type row struct {
		Name       string  `json:"name"`
		CPUPercent float64 `json:"cpu_percent"`
		CPUTime    int64   `json:"cpu_time_ns"`
		Resident   uint64  `json:"memory_resident_bytes"`
		Memory     uint64  `json:"memory_bytes"`
		Uptime     int64   `json:"uptime_ns"`
		Error      string  `json:"error"`
	}
	// Until the loop runs (its exec's start is slow on a slow host), up
	// to 15 s of its 20.
	var s row
	for deadline := time.Now().Add(15 * time.Second); ; {
		time.Sleep(2 * time.Second)
		r := cli(time.Minute, "stats", "--no-stream", "--format", "json", "w")
		var rows []row
		if err := json.Unmarshal([]byte(r.stdout), &rows); r.code != 0 || err != nil || len(rows) != 1 {
			t.Fatalf("capsa stats --no-stream --format json w = exit %d, %v, %q (stderr %q); want one row", r.code, err, r.stdout, r.stderr)
		}
		s = rows[0]
		if s.CPUPercent >= 20 || time.Now().After(deadline) {
			break
		}
	}
	if s.Name != "w" || s.CPUPercent < 20 || s.CPUTime <= 0 || s.Resident == 0 || s.Resident > s.Memory || s.Memory != 512<<20 || s.Uptime <= 0 {
		t.Errorf("capsa stats of w running a busy loop = %+v; want its name, CPU above 20%%, some of its 512 MiB resident", s)
	}
	if b := <-busy; b.code != 124 {
		t.Errorf("the busy loop's exec --timeout 20s = exit %d, stderr %q; want 124, its timeout", b.code, b.stderr)
	}
	if r := cli(time.Minute, "stats", "--no-stream", "nosuch"); r.code == 0 || !strings.Contains(r.stderr, "no such sandbox") {
		t.Errorf("capsa stats nosuch = exit %d, stderr %q; want an error naming the missing sandbox", r.code, r.stderr)
	}
}

// checkIdleTimeout: --idle-timeout stops a sandbox once nobody has been
// connected to it for that long, and not while an exec runs.
func checkIdleTimeout(t *testing.T, cli func(time.Duration, ...string) result) {
	t.Helper()
	if r := cli(3*time.Minute, "run", "-d", "--name", "idle", "--idle-timeout", "4s", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("run -d --name idle --idle-timeout 4s = exit %d, stderr %q", r.code, r.stderr)
	}
	// An exec that lasts longer than the timeout keeps it alive.
	if r := cli(time.Minute, "exec", "idle", "--", "sleep", "6"); r.code != 0 {
		t.Fatalf("capsa exec idle -- sleep 6 = exit %d, stderr %q; the sandbox must not stop while an exec runs", r.code, r.stderr)
	}
	last := time.Now()
	if e := waitExited(t, cli, "idle", 2*time.Minute); !strings.Contains(e.Reason, "idle timeout") || time.Since(last) < 3*time.Second {
		t.Errorf("idle ended %v after its last exec: %+v; want its idle timeout of 4s", time.Since(last), e)
	}
}

// waitExited polls `ps -a` until the sandbox name has exited.
func waitExited(t *testing.T, cli func(time.Duration, ...string) result, name string, limit time.Duration) psEntry {
	t.Helper()
	start := time.Now()
	for {
		e := psAll(t, cli)[name]
		if e.State == "exited" {
			return e
		}
		if time.Since(start) > limit {
			t.Fatalf("%s still %s after %v", name, e.State, limit)
		}
		time.Sleep(time.Second)
	}
}

// followLogs checks that `capsa logs -f w` prints the main process's
// output as it comes: new ticks arrive while it runs.
func followLogs(t *testing.T, dir string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, artifact(t, "capsa"), "logs", "-f", "--tail", "0", "w")
	cmd.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer cancel()
	sc := bufio.NewScanner(out)
	for i := range 3 {
		if !sc.Scan() {
			t.Fatalf("capsa logs -f w: output ended after %d lines: %v", i, sc.Err())
		}
		if sc.Text() != "tick" {
			t.Fatalf("capsa logs -f w: line %q, want tick", sc.Text())
		}
	}
}

// copyBothWays: `capsa cp` of a 64 MiB file into w and back, and of a
// directory tree into w and back, every byte checked.
func copyBothWays(t *testing.T, cli func(time.Duration, ...string) result) {
	t.Helper()
	host := t.TempDir()
	data := make([]byte, 64<<20)
	rand.Read(data)
	big := filepath.Join(host, "big")
	if err := os.WriteFile(big, data, 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if r := cli(2*time.Minute, "cp", big, "w:/tmp/big"); r.code != 0 {
		t.Fatalf("capsa cp big w:/tmp/big = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "w", "--", "shasum", "-a", "256", "/tmp/big"); !strings.HasPrefix(r.stdout, hex.EncodeToString(sum[:])) {
		t.Errorf("the guest's sha256 of the copied file = %q, want %x", r.stdout, sum)
	}
	back := filepath.Join(host, "back")
	if r := cli(2*time.Minute, "cp", "w:/tmp/big", back); r.code != 0 {
		t.Fatalf("capsa cp w:/tmp/big back = exit %d, stderr %q", r.code, r.stderr)
	}
	if got := fileSum(t, back); got != sum {
		t.Errorf("sha256 of the file copied back = %x, want %x", got, sum)
	}
	src := filepath.Join(host, "tree")
	lines := makeTree(t, src)
	if r := cli(2*time.Minute, "cp", src, "w:/tmp"); r.code != 0 {
		t.Fatalf("capsa cp tree w:/tmp = exit %d, stderr %q", r.code, r.stderr)
	}
	out := filepath.Join(host, "out")
	os.Mkdir(out, 0o755)
	if r := cli(2*time.Minute, "cp", "w:/tmp/tree", out); r.code != 0 {
		t.Fatalf("capsa cp w:/tmp/tree out = exit %d, stderr %q", r.code, r.stderr)
	}
	for _, l := range lines {
		rel, want, _ := strings.Cut(l, " ")
		if got := fileSum(t, filepath.Join(out, "tree", rel)); hex.EncodeToString(got[:]) != want {
			t.Errorf("%s after the round trip: sha256 %x, want %s", rel, got, want)
		}
	}
}

// logsShow runs `capsa logs name` until its output holds want, for at
// most 30 seconds, and gives the last run. The main process's output
// reaches main.log on its own stream, apart from the exec and start
// requests that return before it may have been written, so a test that
// reads the log right after one of them waits for the line it expects:
// a log that never shows it still fails.
func logsShow(t *testing.T, cli func(time.Duration, ...string) result, name, want string) result {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		r := cli(time.Minute, "logs", name)
		if r.code != 0 || strings.Contains(r.stdout, want) || time.Now().After(deadline) {
			return r
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// logSandboxFiles logs the tails of every sandbox's supervisor log and
// guest console, for a failed test.
func logSandboxFiles(t *testing.T, dir string) {
	// A live supervisor writes the VM's state to its log on SIGQUIT.
	if st, err := store.Open(dir); err == nil {
		recs, _ := st.List()
		for _, r := range recs {
			if r.State == store.Running && r.PID > 0 {
				syscall.Kill(r.PID, syscall.SIGQUIT)
			}
		}
		time.Sleep(5 * time.Second)
	}
	for _, name := range []string{supervisor.SupervisorLog, supervisor.ConsoleLog} {
		paths, _ := filepath.Glob(filepath.Join(dir, "sandboxes", "*", name))
		for _, p := range paths {
			b, _ := os.ReadFile(p)
			if len(b) > 64<<10 {
				b = b[len(b)-64<<10:]
			}
			t.Logf("%s:\n%s", p, b)
		}
	}
}

// TestCreateStart: `capsa create` records a sandbox that does not run until
// `capsa start`; only a created sandbox starts.
func TestCreateStart(t *testing.T) {
	_, cli := detachedState(t)
	if r := cli(time.Minute, "create", "--name", "c", "--", "sh", "-c", "echo created-then-started; sleep 3600"); r.code != 0 || r.stdout != "c\n" {
		t.Fatalf("capsa create --name c = exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	if e := psAll(t, cli)["c"]; e.State != "created" {
		t.Errorf("ps -a after create: c = %+v, want created", e)
	}
	if r := cli(time.Minute, "exec", "c", "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "not running") {
		t.Errorf("capsa exec of a created sandbox = exit %d, stderr %q; want 125, not running", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "start", "c"); r.code != 0 || r.stdout != "c\n" {
		t.Fatalf("capsa start c = exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	if r := cli(time.Minute, "exec", "c", "--", "true"); r.code != 0 {
		t.Errorf("capsa exec c after start = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := logsShow(t, cli, "c", "created-then-started"); !strings.Contains(r.stdout, "created-then-started") {
		t.Errorf("capsa logs c = %q; want the main process's output", r.stdout)
	}
	if r := cli(time.Minute, "start", "c"); r.code == 0 || !strings.Contains(r.stderr, "running") {
		t.Errorf("capsa start of a running sandbox = exit %d, stderr %q; want an error saying it runs", r.code, r.stderr)
	}
	if r := cli(time.Minute, "stop", "c"); r.code != 0 {
		t.Fatalf("capsa stop c = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "start", "c"); r.code == 0 || !strings.Contains(r.stderr, "only a created or suspended sandbox starts") {
		t.Errorf("capsa start of an exited sandbox = exit %d, stderr %q; want a clear refusal", r.code, r.stderr)
	}
	if r := cli(time.Minute, "start", "nosuch"); r.code == 0 || !strings.Contains(r.stderr, "no such sandbox") {
		t.Errorf("capsa start nosuch = exit %d, stderr %q; want no such sandbox", r.code, r.stderr)
	}
	if r := cli(time.Minute, "rm", "c"); r.code != 0 {
		t.Errorf("capsa rm c = exit %d, stderr %q", r.code, r.stderr)
	}
}
