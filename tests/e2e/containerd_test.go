package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// containerdEnv is a containerd running for one test, with capsa's shim on
// its PATH and a capsa state directory of the test's own: Debian 12's 1.6
// (the bundle of scripts/containerd-bundle.sh) or 2.x built from its
// module (scripts/containerd2-build.sh).
type containerdEnv struct {
	t       testing.TB
	ctr     string
	address string
	env     []string // containerd's, the shim's and capsa's
	state   string   // CAPSA_STATE
	ns      string   // ctr's namespace
	tmp     string   // the test's directory for containerd
	daemon  *exec.Cmd
	start   func() // starts containerd and waits until it answers
}

// restart stops containerd (SIGTERM, as a service manager does) and starts
// it again on the same state: the shims and their pods live on.
func (e *containerdEnv) restart() {
	e.t.Helper()
	e.daemon.Process.Signal(syscall.SIGTERM)
	e.daemon.Wait()
	e.start()
}

// startContainerd starts containerd with capsa's shim (the capsa binary
// linked as containerd-shim-capsa-v2 on its PATH) and stops it at cleanup,
// logging its log's tail if the test failed.
func startContainerd(t testing.TB, bundle string) *containerdEnv {
	t.Helper()
	return startContainerdWith(t, bundle, nil, "")
}

// startContainerdWith starts containerd with the configuration conf
// writes for the test's directory tmp (nil: defaultContainerdConf), and
// extraPath (if not empty) on its PATH beside the shim.
func startContainerdWith(t testing.TB, bundle string, conf func(tmp string) string, extraPath string) *containerdEnv {
	t.Helper()
	bin := artifact(t, "capsa")
	cd := artifact(t, bundle)
	tmp := t.TempDir()
	path := filepath.Join(tmp, "bin")
	if err := os.MkdirAll(path, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(bin, filepath.Join(path, "containerd-shim-capsa-v2")); err != nil {
		t.Fatal(err)
	}
	e := &containerdEnv{t: t, ctr: filepath.Join(cd, "bin", "ctr"), address: filepath.Join(tmp, "containerd.sock"),
		state: filepath.Join(tmp, "capsa"), ns: "capsa-test", tmp: tmp}
	if extraPath != "" {
		path += ":" + extraPath
	}
	e.env = append(os.Environ(), "PATH="+path+":"+os.Getenv("PATH"), "CAPSA_STATE="+e.state)
	config := filepath.Join(tmp, "config.toml")
	text := defaultContainerdConf(bundle)
	if conf != nil {
		text = conf(tmp)
	}
	if err := os.WriteFile(config, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(tmp, "containerd.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	e.start = func() {
		cmd := exec.Command(filepath.Join(cd, "bin", "containerd"), "--config", config, "--address", e.address,
			"--root", filepath.Join(tmp, "root"), "--state", filepath.Join(tmp, "state"), "--log-level", "info")
		cmd.Env, cmd.Stdout, cmd.Stderr = e.env, logf, logf
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		e.daemon = cmd
		deadline := time.Now().Add(30 * time.Second)
		for {
			if _, _, code := e.run(10*time.Second, "", "version"); code == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("containerd did not answer in 30s")
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	t.Cleanup(func() {
		if e.daemon != nil {
			e.daemon.Process.Kill()
			e.daemon.Wait()
		}
		logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			var keep []string
			for _, l := range strings.Split(string(b), "\n") {
				if !strings.Contains(l, "loading plugin") {
					keep = append(keep, l)
				}
			}
			t.Logf("containerd.log (tail, without its plugin loading):\n%s", tailLines(strings.Join(keep, "\n"), 80))
			for _, l := range globAll(filepath.Join(e.state, "sandboxes", "*", "*.log")) {
				b, _ := os.ReadFile(l)
				t.Logf("%s (tail):\n%s", l, tailLines(string(b), 40))
			}
		}
		// A pod VM the test left running: stopped, so it does not
		// outlive the test.
		var names []string
		for _, d := range globAll(filepath.Join(e.state, "sandboxes", "*")) {
			names = append(names, filepath.Base(d))
		}
		if len(names) > 0 {
			capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, append([]string{"rm", "-f"}, names...)...)
		}
	})
	e.start()
	return e
}

// capField is a /proc/PID/status capability line's mask (0: none).
func capField(status, name string) uint64 {
	m := regexp.MustCompile(`(?m)^` + name + `:\s+([0-9a-f]+)$`).FindStringSubmatch(status)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseUint(m[1], 16, 64)
	return v
}

func regexpMatch(re, s string) bool { return regexp.MustCompile(re).MatchString(s) }

// defaultContainerdConf is containerd's configuration for the ctr tests:
// the CRI plugin is not theirs (without CNI it only logs).
func defaultContainerdConf(bundle string) string {
	if bundle == "containerd2" {
		// containerd 2's transfer service unpacks images only for the
		// platforms and snapshotters its configuration names: the ctr
		// tests use the native snapshotter.
		return "version = 3\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n" +
			"[[plugins.'io.containerd.transfer.v1.local'.unpack_config]]\n" +
			"platform = \"linux/amd64\"\nsnapshotter = \"native\"\n"
	}
	return "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n"
}

func globAll(pattern string) []string {
	m, _ := filepath.Glob(pattern)
	return m
}

func tailLines(s string, lines int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// run runs ctr against the test's containerd in its namespace e.ns,
// with stdin (if not empty), and returns its output and exit code.
func (e *containerdEnv) run(timeout time.Duration, stdin string, args ...string) (stdout, stderr string, code int) {
	return runTool(timeout, e.env, stdin, e.ctr, append([]string{"--address", e.address, "--namespace", e.ns}, args...)...)
}

// runTool runs a program with env and stdin (if not empty) for at most
// timeout, and returns its output and exit code (-1: it did not run or
// was killed).
func runTool(timeout time.Duration, env []string, stdin, name string, args ...string) (stdout, stderr string, code int) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = env
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		code = -1
		errb.WriteString(err.Error())
	}
	if ctx.Err() != nil {
		errb.WriteString(fmt.Sprintf(" (timed out after %v)", timeout))
	}
	return out.String(), errb.String(), code
}

// deleteOnceStopped waits up to a minute for ctr task ls to show the task
// id STOPPED (after: what ended it, for the failure's message), then
// deletes the task and its container.
func (e *containerdEnv) deleteOnceStopped(id, after string) {
	e.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		out, _, _ := e.run(time.Minute, "", "task", "ls")
		if regexpMatch(id+`\s+\d+\s+STOPPED`, out) {
			break
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%s not STOPPED a minute after %s: %q", id, after, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	e.ctrWant(0, "", "task", "delete", id)
	e.ctrWant(0, "", "container", "delete", id)
}

// ctrRun is `ctr run` on capsa's shim with the native snapshotter, a test's
// flags and arguments appended (its capacity is its length, so each append
// makes a new slice).
var ctrRun = []string{"run", "--snapshotter", "native", "--runtime", "io.containerd.capsa.v2"}

// ctr runs ctr and fails the test unless it exits with want.
func (e *containerdEnv) ctrWant(want int, stdin string, args ...string) string {
	e.t.Helper()
	start := time.Now()
	out, errs, code := e.run(3*time.Minute, stdin, args...)
	e.t.Logf("ctr %s: exit %d after %v\nstdout: %q\nstderr: %q", strings.Join(args, " "), code, time.Since(start).Round(time.Millisecond), tailLines(out, 10), tailLines(errs, 10))
	if code != want {
		e.t.Fatalf("ctr %s: exit code %d, want %d; stderr: %s", strings.Join(args, " "), code, want, errs)
	}
	return out
}

// importImage imports Debian's python root as the image capsa.test/python:1
// (a docker-save tarball ctr imports) with the native snapshotter (a
// container's root is then a bind mount; the CRI test uses overlayfs).
func (e *containerdEnv) importImage() string { return e.importImageWith("native") }

// importImageWith imports the image (importImage) for snapshotter.
func (e *containerdEnv) importImageWith(snapshotter string) string {
	e.t.Helper()
	base := artifact(e.t, "testimages/python.tar.gz")
	layer, err := tarball.LayerFromFile(base)
	if err != nil {
		e.t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		e.t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		e.t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	// Its command blocks, as a pod's sandbox (pause) image's must where
	// runc runs it (BenchmarkCRIStart's anchor).
	cf.Config = v1.Config{Env: []string{"PATH=" + imagePath}, Cmd: []string{"sleep", "infinity"}}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		e.t.Fatal(err)
	}
	const ref = "capsa.test/python:1"
	tag, err := name.NewTag(ref)
	if err != nil {
		e.t.Fatal(err)
	}
	path := filepath.Join(e.t.TempDir(), "image.tar")
	if err := tarball.WriteToFile(path, tag, img); err != nil {
		e.t.Fatal(err)
	}
	e.ctrWant(0, "", "images", "import", "--snapshotter", snapshotter, "--platform", "linux/amd64", path)
	return ref
}

// TestContainerdShim runs containers through Debian 12's containerd 1.6
// and through containerd 2.x, with their ctr and capsa's shim (runtime io.containerd.capsa.v2): each
// container's pod is a capsa microVM that capsa ps lists; output, exit
// codes, stdin, exec, kill and delete work as with runc; two containers
// run at once, each in its own VM with its own root; a spec capsa cannot
// honour is refused at create, naming the field.
func TestContainerdShim(t *testing.T) {
	for _, c := range []struct{ name, bundle string }{
		{"containerd-1.6", "containerd"},
		{"containerd-2.x", "containerd2"},
	} {
		t.Run(c.name, func(t *testing.T) { testContainerdShim(t, startContainerd(t, c.bundle)) })
	}
}

func testContainerdShim(t *testing.T, e *containerdEnv) {
	ref := e.importImage()

	// Output, the image's root and environment, and the exit code.
	out := e.ctrWant(3, "", append(ctrRun, "--rm", ref, "c1", "sh", "-c",
		`echo "hello from debian $(cat /etc/debian_version) as $(id -u) in $PWD"; echo to-stderr >&2; exit 3`)...)
	if !strings.Contains(out, "hello from debian 12") || !strings.Contains(out, "as 0 in /") {
		t.Errorf("ctr run output = %q, want the image's /etc/debian_version (12.x), uid 0 and cwd /", out)
	}

	// A process the guest's OOM killer ends: exit 137, and containerd
	// hears /tasks/oom for its container. The VM is sized by the spec's
	// memory limit (256 MiB).
	events := exec.Command(e.ctr, "--address", e.address, "--namespace", e.ns, "events")
	var evOut syncBuffer
	events.Stdout, events.Env = &evOut, e.env
	if err := events.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	e.ctrWant(137, "", append(ctrRun, "--rm", "--memory-limit", "268435456", ref, "coom", "python3", "-c",
		"a = []\nwhile True: a.append(bytearray(32 << 20))")...)
	// The event may trail the exit a little: watched for up to 10 s.
	oomEvent := regexp.MustCompile(`/tasks/oom\s.*coom`)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !oomEvent.MatchString(evOut.String()); {
		time.Sleep(100 * time.Millisecond)
	}
	events.Process.Kill()
	events.Wait()
	if !oomEvent.MatchString(evOut.String()) {
		t.Errorf("ctr events while coom ran out of memory = %q, want /tasks/oom for coom", tailLines(evOut.String(), 20))
	}

	// Stdin reaches the container's process and its end closes it. The
	// container runs under containerd's default seccomp profile
	// (--seccomp, what Kubernetes' RuntimeDefault gives): python runs,
	// and setarch -R's personality(ADDR_NO_RANDOMIZE), which the profile
	// leaves out, fails with EPERM (c3 below, unconfined, runs it).
	out = e.ctrWant(0, "line one\nline two\n", append(ctrRun, "--rm", "--seccomp", ref, "c2", "sh", "-c",
		"wc -l; python3 -c 'import sys; print(sys.version_info[0])'; grep ^Seccomp: /proc/self/status; setarch x86_64 -R true 2>&1; echo setarch=$?")...)
	if !strings.Contains(out, "2\n3\nSeccomp:\t2\n") || !strings.Contains(out, "Operation not permitted") || strings.Contains(out, "setarch=0") {
		t.Errorf("ctr run --seccomp with stdin: output %q, want 2 lines counted, python 3, a seccomp filter (Seccomp: 2) and setarch -R refused", out)
	}

	// A detached container: exec, the pod VM in capsa ps, kill, delete.
	e.ctrWant(0, "", append(ctrRun, "-d", "--env", "WHO=c3", ref, "c3", "sh", "-c", "echo started > /tmp/mark; exec sleep 1000")...)
	out = e.ctrWant(4, "", "task", "exec", "--exec-id", "e1", "c3", "sh", "-c", `cat /tmp/mark; echo "exec as $WHO"; exit 4`)
	if !strings.Contains(out, "started") || !strings.Contains(out, "exec as c3") {
		t.Errorf("ctr task exec output = %q, want the init's /tmp/mark and the container's environment", out)
	}
	out = e.ctrWant(0, "", "task", "ls")
	if !regexpMatch(`c3\s+\d+\s+RUNNING`, out) {
		t.Errorf("ctr task ls = %q, want c3 RUNNING", out)
	}
	ps := capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, "ps")
	if ps.code != 0 || !strings.Contains(ps.stdout, "capsa-test-c3") {
		t.Errorf("capsa ps = %d %q %q, want the pod VM capsa-test-c3", ps.code, ps.stdout, ps.stderr)
	}
	if st := capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, "stats", "--no-stream", "--format", "json", "capsa-test-c3"); st.code != 0 || !strings.Contains(st.stdout, "cpu_time_ns") {
		t.Errorf("capsa stats capsa-test-c3 = %d %q %q, want the pod VM's figures", st.code, st.stdout, st.stderr)
	}
	// The pod VM's supervisor is jailed, and its jail took c3's root,
	// which the shim mounted after it was: the exec above ran in it.
	// (Its capabilities: a root VMM serving host files keeps the four a
	// file server needs, and no other.)
	pod := inspectConfined(t, func(d time.Duration, args ...string) result {
		return capsaWith(t, d, func(c *exec.Cmd) { c.Env = e.env }, args...)
	}, "capsa-test-c3")
	if l := pod.Confinement; !strings.HasPrefix(l.Namespaces, "on (mount namespace") || !strings.Contains(l.Namespaces, "following the host's mounts") {
		t.Errorf("the pod VM's namespaces layer = %q; want its jail, following the host's mounts", l.Namespaces)
	}
	checkCapabilities(t, pod.Confinement, pod.PID, capsFileServer)

	// The spec's capabilities (ctr's default set, without CAP_SYS_ADMIN,
	// so a mount is refused), masked paths and read-only paths.
	out = e.ctrWant(0, "", "task", "exec", "--exec-id", "caps", "c3", "sh", "-c", "grep -E '^Cap(Bnd|Eff)' /proc/self/status; mount -t tmpfs none /mnt 2>&1; echo mount=$?; "+
		"grep ^Seccomp: /proc/self/status; setarch x86_64 -R true; echo setarch=$?; "+
		"echo firmware=$(ls -A /sys/firmware | wc -l); grep -E ' /(sys/firmware|proc/fs) ' /proc/mounts")
	bnd, eff := capField(out, "CapBnd"), capField(out, "CapEff")
	if bnd == 0 || bnd&(1<<21) != 0 || bnd&(1<<12) != 0 || bnd&1 == 0 || eff != bnd || strings.Contains(out, "mount=0") {
		t.Errorf("capabilities in the container: %q; want the spec's (CAP_CHOWN, not CAP_SYS_ADMIN or CAP_NET_ADMIN) as the bounding and effective sets, and mount refused", out)
	}
	if !strings.Contains(out, "Seccomp:\t0\nsetarch=0\n") {
		t.Errorf("c3, run without --seccomp: %q, want no seccomp filter and setarch -R working", out)
	}
	// Its masked and read-only paths (of ctr's defaults, those the guest
	// kernel has): /sys/firmware an empty read-only tmpfs, /proc/fs
	// mounted read-only.
	if !strings.Contains(out, "firmware=0\n") || !regexpMatch(`(?m)^tmpfs /sys/firmware tmpfs ro[, ]`, out) || !regexpMatch(`(?m)^proc /proc/fs proc ro[, ]`, out) {
		t.Errorf("masked and read-only paths in the container: %q; want /sys/firmware masked by an empty read-only tmpfs and /proc/fs read-only", out)
	}

	// Stats: the pod VM's real figures, as cgroup v2 metrics.
	out = e.ctrWant(0, "", "task", "metrics", "c3")
	if !regexpMatch(`memory\.usage_limit\s+536870912\b`, out) || !regexpMatch(`cpu\.usage_usec\s+[1-9]\d*`, out) || !regexpMatch(`memory\.usage\s+[1-9]\d*`, out) {
		t.Errorf("ctr task metrics c3 = %q, want the VM's 512 MiB as the memory limit, and CPU time and memory used", out)
	}

	// Pause and resume: the pod VM's vCPUs stop and run again.
	e.ctrWant(0, "", "task", "pause", "c3")
	if out = e.ctrWant(0, "", "task", "ls"); !regexpMatch(`c3\s+\d+\s+PAUSED`, out) {
		t.Errorf("ctr task ls after pause = %q, want c3 PAUSED", out)
	}
	if ps := capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, "ps"); !regexpMatch(`capsa-test-c3\s+paused`, ps.stdout) {
		t.Errorf("capsa ps with c3 paused = %q, want its VM paused", ps.stdout)
	}
	e.ctrWant(0, "", "task", "resume", "c3")
	if out = e.ctrWant(0, "", "task", "exec", "--exec-id", "resumed", "c3", "cat", "/tmp/mark"); !strings.Contains(out, "started") {
		t.Errorf("ctr task exec after resume = %q, want the container's file", out)
	}

	// A pod VM that dies (its VMM killed): the container is reported
	// exited, not hung.
	e.ctrWant(0, "", append(ctrRun, "-d", ref, "clost", "sleep", "1000")...)
	out = e.ctrWant(0, "", "task", "ls")
	m := regexp.MustCompile(`clost\s+(\d+)\s+RUNNING`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("ctr task ls = %q, want clost RUNNING with its VM's PID", out)
	}
	vmm, _ := strconv.Atoi(m[1])
	if err := syscall.Kill(vmm, syscall.SIGKILL); err != nil {
		t.Fatalf("kill the pod VM's process %d: %v", vmm, err)
	}
	e.deleteOnceStopped("clost", "its VM was killed")

	// containerd restarts: it finds the shim again, which still runs the
	// container and its VM.
	e.restart()
	if out = e.ctrWant(0, "", "task", "ls"); !regexpMatch(`c3\s+\d+\s+RUNNING`, out) {
		t.Errorf("ctr task ls after containerd restarted = %q, want c3 RUNNING", out)
	}
	if out = e.ctrWant(0, "", "task", "exec", "--exec-id", "after-restart", "c3", "cat", "/tmp/mark"); !strings.Contains(out, "started") {
		t.Errorf("ctr task exec after containerd restarted = %q, want the container's file", out)
	}

	// Two containers at once, each in its own VM with its own root.
	e.ctrWant(0, "", append(ctrRun, "-d", ref, "c4", "sleep", "1000")...)
	e.ctrWant(0, "", "task", "exec", "--exec-id", "w", "c4", "sh", "-c", "echo c4 > /tmp/only-c4")
	out = e.ctrWant(0, "", "task", "exec", "--exec-id", "r", "c3", "sh", "-c", "ls /tmp; test ! -e /tmp/only-c4 && echo separate")
	if !strings.Contains(out, "separate") {
		t.Errorf("c3 sees c4's file: %q", out)
	}
	ps = capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, "ps")
	if !strings.Contains(ps.stdout, "capsa-test-c3") || !strings.Contains(ps.stdout, "capsa-test-c4") {
		t.Errorf("capsa ps = %q, want both pod VMs", ps.stdout)
	}

	for _, id := range []string{"c3", "c4"} {
		e.ctrWant(0, "", "task", "kill", "--signal", "SIGTERM", id)
		e.deleteOnceStopped(id, "SIGTERM")
	}
	ps = capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, "ps", "-a")
	if strings.Contains(ps.stdout, "capsa-test-c3") || strings.Contains(ps.stdout, "capsa-test-c4") {
		t.Errorf("capsa ps -a after the deletes = %q, want the pod VMs gone", ps.stdout)
	}

	containerdTerminal(t, e, ref)

	// What a VM cannot honour is refused at create, naming the field.
	for _, c := range []struct {
		flag, want string
	}{
		{"--privileged", "process.capabilities"},
		{"--net-host", "hostNetwork"},
	} {
		_, errs, code := e.run(3*time.Minute, "", append(ctrRun, "--rm", c.flag, ref, "bad", "true")...)
		if code == 0 || !strings.Contains(errs, c.want) {
			t.Errorf("ctr run %s: exit %d, stderr %q; want a failure naming %s", c.flag, code, errs, c.want)
		}
		e.run(time.Minute, "", "container", "delete", "bad")
	}
}

// containerdTerminal: `ctr run -t` in a tmux pane, typed at as a person
// does: a shell on the container's terminal of the pane's size, a resize
// followed (ResizePty), ^C interrupting sleep with the shell still there,
// and its exit code passed through ctr; then `ctr task exec -t` into a
// running container, at its pane's size, its exit code passed through.
func containerdTerminal(t *testing.T, e *containerdEnv, ref string) {
	tm := tmuxServer(t)
	pane := fmt.Sprintf("%s --address %s --namespace capsa-test run -t --rm --snapshotter native --runtime io.containerd.capsa.v2 %s ctty sh; echo ctr-exit-$?; sleep 3600",
		e.ctr, e.address, ref)
	seen, keys, _ := shellPane(t, tm, "ctr", pane, 2*time.Minute)
	startSleep(seen, keys)
	keys("C-c")
	keys("echo alive-$?", "Enter")
	seen("alive-130")
	keys("exit 3", "Enter")
	seen("ctr-exit-3")

	// An exec on a terminal in a running container: ctr task exec -t.
	e.ctrWant(0, "", append(ctrRun, "-d", ref, "cttyexec", "sleep", "1000")...)
	pane = fmt.Sprintf("%s --address %s --namespace %s task exec -t --exec-id tty cttyexec sh; echo exec-exit-$?; sleep 3600",
		e.ctr, e.address, e.ns)
	tm("new-session", "-d", "-s", "exec", "-x", "90", "-y", "25", pane)
	eseen, ekeys, _ := paneDriver(t, tm, "exec", 2*time.Minute)
	eseen("#")
	ekeys("stty size", "Enter")
	eseen("25 90")
	ekeys("exit 5", "Enter")
	eseen("exec-exit-5")
	e.ctrWant(0, "", "task", "kill", "--signal", "SIGKILL", "cttyexec")
	e.deleteOnceStopped("cttyexec", "SIGKILL")
}
