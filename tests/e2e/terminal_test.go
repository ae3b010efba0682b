package e2e

import (
	"bufio"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// TestProcessOutlivesExec: a process whose `capsa exec` is killed keeps
// running and finishes its work; the library lists it, attaches to it
// (its earlier output replayed) and reads how it ended.
func TestProcessOutlivesExec(t *testing.T) {
	dir, cli := detachedState(t)
	if r := cli(3*time.Minute, "run", "-d", "--name", "p", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --name p = exit %d, stderr %q", r.code, r.stderr)
	}
	// The process waits for the test's word (/tmp/go) rather than a
	// fixed time, so that a slow host cannot see it end before it is
	// listed.
	const script = "echo begun; until [ -e /tmp/go ]; do sleep 0.1; done; echo finished > /tmp/done; echo out; exit 7"
	cmd := exec.Command(artifact(t, "capsa"), "exec", "p", "--", "sh", "-c", script)
	cmd.Env = append(os.Environ(), "CAPSA_STATE="+dir, "CAPSA_METRICS_TOKEN=metrics-test-token")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "begun\n" {
		cmd.Process.Kill()
		t.Fatalf("capsa exec p's first line = %q, %v; want %q", line, err, "begun\n")
	}
	cmd.Process.Kill() // SIGKILL: no goodbye to the guest
	cmd.Wait()

	ctx, h := openByName(t, dir, "p")
	procs, err := h.Processes(ctx)
	if err != nil {
		t.Fatalf("Processes() = %v", err)
	}
	var found *agent.ProcessInfo
	for i, p := range procs {
		if len(p.Argv) == 3 && p.Argv[2] == script {
			found = &procs[i]
		}
	}
	if found == nil || found.Exit != nil {
		t.Fatalf("Processes() = %+v; want the killed exec's process, running", procs)
	}
	if err := h.WriteFile(ctx, "/tmp/go", nil, 0o644); err != nil {
		t.Fatalf("WriteFile(/tmp/go) = %v", err)
	}
	var out strings.Builder
	p, err := h.Attach(ctx, found.ID, agent.AttachOptions{Stdout: &out})
	if err != nil {
		t.Fatalf("Attach(%d) = %v", found.ID, err)
	}
	es, err := p.Wait()
	if err != nil || es.Code != 7 || out.String() != "begun\nout\n" {
		t.Errorf("attached to process %d: %+v, %v, output %q; want exit 7 and %q", found.ID, es, err, out.String(), "begun\nout\n")
	}
	if es, err := h.WaitProcess(ctx, found.ID); err != nil || es.Code != 7 {
		t.Errorf("WaitProcess(%d) = %+v, %v; want exit 7", found.ID, es, err)
	}
	if b, err := h.ReadFile(ctx, "/tmp/done"); err != nil || string(b) != "finished\n" {
		t.Errorf("the process's work: /tmp/done = %q, %v", b, err)
	}
	checkMetrics(t, dir, "p")
}

// checkMetrics: `capsa metrics` serves the running sandbox name's use to
// Prometheus, labelled by name.
func checkMetrics(t *testing.T, dir, name string) {
	cmd := exec.Command(artifact(t, "capsa"), "metrics", "--listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "CAPSA_STATE="+dir, "CAPSA_METRICS_TOKEN=metrics-test-token")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		if t.Failed() {
			t.Logf("capsa metrics's stderr:\n%s", stderr.String())
		}
	}()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	rest, ok := strings.CutPrefix(strings.TrimSpace(line), "capsa metrics: serving ")
	url, _, _ := strings.Cut(rest, " ")
	if err != nil || !ok {
		t.Fatalf("capsa metrics printed %q, %v; want where it serves", line, err)
	}
	// Only the token's holder reads them (a guest allowed everything
	// reaches the host's loopback through the NAT's gateway).
	if resp, err := http.Get(url); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET %s without the token = %v, %v; want 401", url, resp, err)
	} else {
		resp.Body.Close()
	}
	req, _ := http.NewRequest("GET", url, nil)
	req.Header.Set("Authorization", "Bearer metrics-test-token")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: not Prometheus text: %v", url, err)
	}
	value := func(family string) (float64, bool) {
		f := fams[family]
		if f == nil {
			return 0, false
		}
		for _, m := range f.Metric {
			for _, l := range m.Label {
				if l.GetName() == "sandbox" && l.GetValue() == name {
					switch {
					case m.Counter != nil:
						return m.Counter.GetValue(), true
					case m.Gauge != nil:
						return m.Gauge.GetValue(), true
					}
				}
			}
		}
		return 0, false
	}
	for family, min := range map[string]float64{
		"capsa_sandbox_up": 1, "capsa_sandbox_cpu_seconds_total": 0.01, "capsa_sandbox_memory_resident_bytes": 1 << 20,
		"capsa_sandbox_memory_bytes": 256 << 20, "capsa_sandbox_uptime_seconds": 1, "capsa_sandbox_vcpus": 1,
		"capsa_sandbox_vm_exits_total": 1,
	} {
		if v, ok := value(family); !ok || v < min {
			t.Errorf("%s{sandbox=%q} = %v (present: %v), want at least %v", family, name, v, ok, min)
		}
	}
	if _, ok := value("capsa_sandbox_network_receive_bytes_total"); !ok {
		t.Errorf("capsa_sandbox_network_receive_bytes_total{sandbox=%q} is missing", name)
	}
}

// tmuxServer runs commands of a tmux server of the test's own (tmux from
// scripts/test-images.sh), killed at cleanup.
func tmuxServer(t *testing.T) func(args ...string) string {
	bin := artifact(t, "testimages/tmux/tmux")
	sock := filepath.Join(t.TempDir(), "tmux.sock")
	tm := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("/bin/sh", append([]string{bin, "-S", sock}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("tmux %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	t.Cleanup(func() { exec.Command("/bin/sh", bin, "-S", sock, "kill-server").Run() })
	return tm
}

// shellPane starts cmd, which gives a shell on a terminal, in a new tmux
// session of 100x30; waits for the shell's prompt and its `stty size` of
// the pane's; then resizes the window to 120x40 and waits for the shell
// to see that too: how each terminal test starts. It returns the pane's
// driver (paneDriver), each wait bounded by wait.
func shellPane(t *testing.T, tm func(args ...string) string, session, cmd string, wait time.Duration) (seen func(string), keys func(...string), screen func() string) {
	t.Helper()
	tm("new-session", "-d", "-s", session, "-x", "100", "-y", "30", cmd)
	seen, keys, screen = paneDriver(t, tm, session, wait)
	seen("#")
	keys("stty size", "Enter")
	seen("30 100")
	tm("resize-window", "-t", session, "-x", "120", "-y", "40")
	seenResize(t, keys, screen, "40 120", wait)
	return seen, keys, screen
}

// seenResize types `stty size` until the shell in the pane reports want:
// a resize reaches the guest apart from the keys typed after it, so one
// try may come before it; up to wait.
func seenResize(t *testing.T, keys func(...string), screen func() string, want string, wait time.Duration) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		keys("clear", "Enter")
		keys("stty size", "Enter")
		for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
			if strings.Contains(screen(), want) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the shell never reported the size %s; the pane shows:\n%s", want, screen())
		}
	}
}

// startSleep has the pane's shell run sleep 100 behind a line it prints
// first, and waits for that line: a ^C typed then ends the sleep, not the
// command line before the shell has read it.
func startSleep(seen func(string), keys func(...string)) {
	keys("echo go-$((1+1)); sleep 100", "Enter")
	seen("go-2")
	time.Sleep(time.Second)
}

// paneDriver drives the tmux session's pane as a person at it would:
// seen waits up to wait for want on the screen ("#": a line that is dash's
// prompt and nothing else, as capture-pane drops trailing spaces), keys
// types, screen is what the pane shows.
func paneDriver(t *testing.T, tm func(args ...string) string, session string, wait time.Duration) (seen func(want string), keys func(keys ...string), screen func() string) {
	screen = func() string { return tm("capture-pane", "-p", "-t", session) }
	seen = func(want string) {
		t.Helper()
		deadline := time.Now().Add(wait)
		has := func(s string) bool { return strings.Contains(s, want) }
		if want == "#" {
			has = func(s string) bool { return slices.Contains(strings.Split(s, "\n"), "#") }
		}
		for !has(screen()) {
			if time.Now().After(deadline) {
				t.Fatalf("the pane never showed %q; it shows:\n%s", want, screen())
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	keys = func(keys ...string) { tm(append([]string{"send-keys", "-t", session}, keys...)...) }
	return seen, keys, screen
}

// TestTerminal: `capsa exec -it NAME sh` in a tmux pane, typed at through
// send-keys as a person does and read with capture-pane: the shell's
// prompt, `stty size` as the pane's, a resize followed, ^C interrupting
// `sleep 100` with the shell still there, its exit code passed through,
// and the terminal's modes as they were before.
func TestTerminal(t *testing.T) {
	ref := pythonImage(t, "tty")
	dir, cli := detachedState(t)
	if r := cli(5*time.Minute, "run", "-d", "--name", "tty", "--image", ref, "-u", "0", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --image %s = exit %d, stderr %q", ref, r.code, r.stderr)
	}
	tm := tmuxServer(t)
	work := t.TempDir()
	// The pane: the terminal's modes before and after capsa, and its exit
	// code, then a pause so the pane stays to be read.
	pane := fmt.Sprintf("stty -g > %[1]s/before; CAPSA_STATE=%[2]s %[3]s exec -it tty -- sh; echo capsa-exit-$?; stty -g > %[1]s/after; sleep 3600",
		work, dir, artifact(t, "capsa"))
	seen, keys, screen := shellPane(t, tm, "e2e", pane, 90*time.Second) // the resize: SIGWINCH to capsa

	startSleep(seen, keys)
	start := time.Now()
	keys("C-c")
	keys("echo alive-$?", "Enter")
	seen("alive-130")
	if d := time.Since(start); d > 60*time.Second {
		t.Errorf("^C took %v to end sleep 100", d)
	}
	keys("exit 3", "Enter")
	seen("capsa-exit-3")
	deadline := time.Now().Add(30 * time.Second)
	for {
		before, _ := os.ReadFile(filepath.Join(work, "before"))
		after, err := os.ReadFile(filepath.Join(work, "after"))
		if err == nil && len(after) > 0 {
			if string(after) != string(before) {
				t.Errorf("the terminal's modes after capsa exec -it = %q, want them restored to %q", after, before)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pane never recorded the terminal's modes after capsa; it shows:\n%s", screen())
		}
		time.Sleep(100 * time.Millisecond)
	}
}
