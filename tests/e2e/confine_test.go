package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/confine"
	"github.com/capsa-sandbox/capsa/supervisor"
	"kernel.org/pub/linux/libs/security/libcap/cap"
)

// TestConfinement: a detached sandbox's supervisor confines itself before
// its guest runs (every other end-to-end test runs confined too, which
// is what shows the allowlist is complete). A test hook makes the
// confined VMM try to run a program, read a file outside its paths and
// trace its parent: each is refused. A share, a volume, the NAT, a
// published port and a snapshot keep working; capsa run confines itself
// the same way.
func TestConfinement(t *testing.T) {
	dir, cli := detachedState(t)
	w := setupNetWorld(t)
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("not for the VMM"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The probe reads the secret and the records' database (the CLI's
	// environment is the supervisor's).
	db := filepath.Join(dir, "state.db")
	t.Setenv(confine.ProbeEnv, secret+string(filepath.ListSeparator)+db)
	share := t.TempDir()
	if err := os.WriteFile(filepath.Join(share, "in.txt"), []byte("from the host"), 0o644); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if r := cli(time.Minute, "volume", "create", "cv", "--size", "64M"); r.code != 0 {
		t.Fatalf("capsa volume create cv = exit %d, stderr %q", r.code, r.stderr)
	}
	r := cli(3*time.Minute, "run", "-d", "--name", "c", "--net", "--dns-server", w.dns, "-p", "0:8080",
		"-v", share+":/mnt/share", "-v", "cv:/vol", "-v", filepath.Dir(self)+":/probe:ro",
		"-e", serveEnv+"=:8080", "-e", "CAPSA_E2E_SERVE_BODY=served confined\n", "--", "/probe/"+filepath.Base(self))
	if r.code != 0 {
		t.Fatalf("capsa run -d --name c = exit %d, stderr %q", r.code, r.stderr)
	}

	// What it got, and what the probe found.
	rec := inspectConfined(t, cli, "c")
	l := rec.Confinement
	if !strings.HasPrefix(l.Seccomp, "on") || !strings.HasPrefix(l.Rlimits, "on") {
		t.Errorf("confinement = %s; want seccomp and rlimits on", l)
	}
	landlock := strings.HasPrefix(l.Landlock, "on")
	if !landlock && hostHasLSM("landlock") {
		t.Errorf("confinement = %s; this kernel runs Landlock, want the layer on", l)
	} else if !landlock {
		t.Logf("this kernel has no Landlock (%s): the file check is skipped", l.Landlock)
	}
	checkCgroup(t, l, rec.PID, 512)
	probe := probeLine(t, dir, "c")
	for _, want := range []string{`execve="operation not permitted"`, `ptrace="operation not permitted"`} {
		if !strings.Contains(probe, want) {
			t.Errorf("the confined supervisor's probe: %q; want %s", probe, want)
		}
	}
	// Landlock refuses the reads; the jail (as root) has no such files.
	// The supervisor reports its run in its own directory: the records
	// are not its to read or write.
	if landlock || os.Geteuid() == 0 {
		for key, path := range map[string]string{"open": secret, "open2": db} {
			refused := false
			for _, why := range []string{"permission denied", "no such file or directory"} {
				refused = refused || strings.Contains(probe, fmt.Sprintf(`%s="open %s: %s"`, key, path, why))
			}
			if !refused {
				t.Errorf("the confined supervisor's probe: %q; want the read of %s refused (%s)", probe, path, key)
			}
		}
	}
	if os.Geteuid() == 0 && !strings.HasPrefix(l.Namespaces, "on (mount namespace") {
		t.Errorf("confinement = %s; want the namespaces layer on, as root", l)
	}
	// As root it keeps only what serving others' files takes, in every
	// thread and in its bounding set.
	checkCapabilities(t, l, rec.PID, map[bool]capsHeld{true: capsFileServer, false: capsNone}[os.Geteuid() == 0])

	// Everything the sandbox uses still works.
	if r := cli(time.Minute, "exec", "c", "--", "sh", "-c", "cat /mnt/share/in.txt && echo out > /mnt/share/out.txt && echo kept > /vol/f && cat /vol/f"); r.code != 0 || r.stdout != "from the hostkept\n" {
		t.Errorf("the share and the volume, confined: exit %d, %q (stderr %q)", r.code, r.stdout, r.stderr)
	}
	if b, err := os.ReadFile(filepath.Join(share, "out.txt")); err != nil || string(b) != "out\n" {
		t.Errorf("the file the guest wrote to the share: %q, %v", b, err)
	}
	checkNATAndPort(t, cli, "c", rec.Ports, "served confined\n", "confined")
	// Its network policy changed while it runs (capsa update --net, over
	// the confined supervisor's control socket): deny-all refuses what
	// public-only let through, and public-only lets it through again.
	if r := cli(time.Minute, "update", "c", "--net", "deny-all"); r.code != 0 || !strings.Contains(r.stdout, "c: network deny-all") {
		t.Errorf("capsa update c --net deny-all = exit %d, %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	if r := cli(time.Minute, "exec", "c", "--", "sh", "-c", "wget -O /tmp/denied http://public.example.test/"); r.code == 0 {
		t.Errorf("the NAT after capsa update --net deny-all: the fetch succeeded (%q)", r.stdout)
	}
	if r := cli(time.Minute, "update", "c", "--net", "public-only"); r.code != 0 {
		t.Errorf("capsa update c --net public-only = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(2*time.Minute, "exec", "c", "--", "sh", "-c", "wget -O /tmp/again http://public.example.test/ && cat /tmp/again"); r.code != 0 || r.stdout != "public page\n" {
		t.Errorf("the NAT after capsa update --net public-only: exit %d, %q (stderr %q)", r.code, r.stdout, r.stderr)
	}
	if r := cli(3*time.Minute, "snapshot", "create", "c", "csnap"); r.code != 0 {
		t.Errorf("capsa snapshot create of a confined sandbox = exit %d, stderr %q", r.code, r.stderr)
	} else if r := cli(3*time.Minute, "snapshot", "restore", "csnap", "--name", "c2", // what it reaches, given again
		"-v", share+":/mnt/share", "-v", "cv:/vol", "-v", filepath.Dir(self)+":/probe:ro", "--net", "--dns-server", w.dns); r.code != 0 {
		t.Errorf("capsa snapshot restore = exit %d, stderr %q", r.code, r.stderr)
	} else if r := cli(time.Minute, "exec", "c2", "--", "cat", "/mnt/share/in.txt"); r.code != 0 || r.stdout != "from the host" {
		t.Errorf("the restored sandbox's share, confined: exit %d, %q (stderr %q)", r.code, r.stdout, r.stderr)
	}

	// A sandbox that serves no host files: as root, its VMM keeps no
	// capability, and still runs, answers and writes a snapshot (a layer
	// over another user's snapshot: TestJail).
	if r := cli(3*time.Minute, "run", "-d", "--name", "c0", "--", "sleep", "100000"); r.code != 0 {
		t.Fatalf("capsa run -d --name c0 = exit %d, stderr %q", r.code, r.stderr)
	}
	rec0 := inspectConfined(t, cli, "c0")
	checkCapabilities(t, rec0.Confinement, rec0.PID, capsNone)
	if r := cli(time.Minute, "exec", "c0", "--", "sh", "-c", "echo kept > /tmp/f && cat /tmp/f"); r.code != 0 || r.stdout != "kept\n" {
		t.Errorf("capsa exec c0, no file served: exit %d, %q (stderr %q)", r.code, r.stdout, r.stderr)
		// Its VM's state and console now: c0 is removed below, before
		// the end of the test would log them.
		logSandboxFiles(t, dir)
	}
	if r := cli(3*time.Minute, "snapshot", "create", "c0", "c0snap"); r.code != 0 {
		t.Errorf("capsa snapshot create of a sandbox whose VMM holds no capability = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "rm", "-f", "c0"); r.code != 0 {
		t.Errorf("capsa rm -f c0 = exit %d, stderr %q", r.code, r.stderr)
	}

	// A foreground run that serves no host files keeps no capability as
	// root: it reads no store.
	if os.Geteuid() == 0 {
		if r := cli(3*time.Minute, "run", "--verbose", "--", "true"); r.code != 0 || !strings.Contains(r.stderr, "capabilities: on (none held)") {
			t.Errorf("capsa run --verbose -- true, as root = exit %d; want its confinement to say no capability is held: %.2000q", r.code, r.stderr)
		}
	}

	// capsa run confines itself too.
	r = cli(3*time.Minute, "run", "-v", share+":/mnt/share", "--", "cat", "/mnt/share/in.txt")
	if r.code != 0 || r.stdout != "from the host" || !strings.Contains(r.stderr, `execve="operation not permitted"`) {
		t.Errorf("capsa run, confined, with the probe = exit %d, %q, stderr %q; want the share read and execve refused", r.code, r.stdout, r.stderr)
	}
}

// probeLine is the last line of the detached sandbox name's supervisor
// log (in the state directory dir) where its confined VMM reported what
// the test hook's probe (confine.ProbeEnv) tried; "" if none.
func probeLine(t *testing.T, dir, name string) string {
	t.Helper()
	logb, err := os.ReadFile(filepath.Join(dir, "sandboxes", name, supervisor.SupervisorLog))
	if err != nil {
		t.Fatal(err)
	}
	probe := ""
	for _, line := range strings.Split(string(logb), "\n") {
		if strings.Contains(line, "confine probe") {
			probe = line
		}
	}
	return probe
}

// confinedRecord is what capsa inspect says of a detached sandbox that
// the confinement tests check.
type confinedRecord struct {
	PID         int             `json:"pid"`
	Ports       []string        `json:"ports"`
	Confinement *confine.Layers `json:"confinement"`
}

// inspectConfined runs capsa inspect name and returns its record, which
// must report the sandbox's confinement; it logs the layers.
func inspectConfined(t *testing.T, cli func(time.Duration, ...string) result, name string) confinedRecord {
	t.Helper()
	r := cli(time.Minute, "inspect", name)
	var recs []confinedRecord
	if err := json.Unmarshal([]byte(r.stdout), &recs); err != nil || len(recs) != 1 || recs[0].Confinement == nil {
		t.Fatalf("capsa inspect %s = %q (%v); want its confinement", name, r.stdout, err)
	}
	t.Logf("confinement: %s", recs[0].Confinement)
	return recs[0]
}

// checkNATAndPort checks that the detached sandbox name (serving body on
// its one published port, listed in ports) reaches the test's public
// server through the NAT and answers on that port; how says in what
// state ("confined", "jailed").
func checkNATAndPort(t *testing.T, cli func(time.Duration, ...string) result, name string, ports []string, body, how string) {
	t.Helper()
	if r := cli(2*time.Minute, "exec", name, "--", "sh", "-c", "wget -O /tmp/page http://public.example.test/ && cat /tmp/page"); r.code != 0 || r.stdout != "public page\n" {
		t.Errorf("the NAT, %s: exit %d, %q (stderr %q)", how, r.code, r.stdout, r.stderr)
	}
	if len(ports) != 1 {
		t.Fatalf("the record's ports = %q, want one", ports)
	}
	addr, _, _ := strings.Cut(ports[0], "->")
	var page string
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		resp, err := http.Get("http://" + addr + "/")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if page = string(b); page == body {
				break
			}
		}
	}
	if page != body {
		t.Errorf("the published port %s, %s: %q", addr, how, page)
	}
}

// hostHasLSM says whether the running kernel has the security module
// name active (/sys/kernel/security/lsm).
func hostHasLSM(name string) bool {
	b, err := os.ReadFile("/sys/kernel/security/lsm")
	return err == nil && slices.Contains(strings.Split(strings.TrimSpace(string(b)), ","), name)
}

// checkCgroup: where this host delegates cgroup v2's memory and pids
// controllers to the test's cgroup's children, the confined VMM process
// pid must be in a cgroup of its own (capsa-NAME-PID) whose memory.max is
// its guest's memory (memMiB) plus supervisor.VMMOverhead and whose
// pids.max is confine.DefaultPids, and, where the cpu controller is
// delegated too, whose cpu.max is one CPU (its one vCPU), as
// docs/security.md says.
func checkCgroup(t *testing.T, l *confine.Layers, pid, memMiB int) {
	t.Helper()
	ctl, err := os.ReadFile("/sys/fs/cgroup/cgroup.subtree_control")
	if err != nil || !strings.Contains(string(ctl), "memory") || !strings.Contains(string(ctl), "pids") {
		t.Logf("this host delegates no cgroup v2 memory and pids controllers (%v): the cgroup check is skipped", err)
		return
	}
	if !strings.HasPrefix(l.Cgroup, "on") {
		t.Errorf("confinement = %s; this host delegates cgroup v2, want the cgroup layer on", l)
		return
	}
	self, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatalf("the VMM's cgroup: %v", err)
	}
	rel, _ := strings.CutPrefix(strings.TrimSpace(string(self)), "0::")
	if !strings.Contains(filepath.Base(rel), fmt.Sprintf("-%d", pid)) || !strings.HasPrefix(filepath.Base(rel), "capsa-") {
		t.Errorf("the VMM %d is in cgroup %q; want one of its own, capsa-NAME-%d", pid, rel, pid)
	}
	dir := filepath.Join("/sys/fs/cgroup", rel)
	want := map[string]string{
		"memory.max": strconv.FormatInt(int64(memMiB)<<20+supervisor.VMMOverhead, 10),
		"pids.max":   strconv.Itoa(confine.DefaultPids),
	}
	if slices.Contains(strings.Fields(string(ctl)), "cpu") {
		want["cpu.max"] = "100000 100000" // one vCPU: one CPU's time
	}
	for file, want := range want {
		if b, err := os.ReadFile(filepath.Join(dir, file)); err != nil || strings.TrimSpace(string(b)) != want {
			t.Errorf("the VMM's cgroup's %s = %q, %v; want %s", file, b, err, want)
		}
	}
}

// capsHeld is what a confined VMM process holds.
type capsHeld int

const (
	// capsFileServer: run by root and serving host files, only
	// confine.KeptCapabilities, permitted, effective and bounding.
	capsFileServer capsHeld = iota
	// capsNone: a jail's user, not root, or root serving no host files:
	// none permitted or effective (the bounding set emptied where it was
	// root's to drop).
	capsNone
)

// checkCapabilities checks the capabilities layer of the VMM process pid
// and each of its threads' sets in /proc against held. None inheritable
// or ambient either way.
func checkCapabilities(t *testing.T, l *confine.Layers, pid int, held capsHeld) {
	t.Helper()
	var mask uint64
	want := "on (none held)"
	kept := map[capsHeld][]cap.Value{capsFileServer: confine.KeptCapabilities}[held]
	if len(kept) > 0 {
		var names []string
		for _, v := range kept {
			mask |= 1 << uint(v)
			names = append(names, v.String())
		}
		want = "on (kept " + strings.Join(names, ",") + ")"
	}
	if l.Capabilities != want {
		t.Errorf("the capabilities layer = %q; want %q", l.Capabilities, want)
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, task.Name()))
		if err != nil {
			continue // the thread ended
		}
		for _, line := range strings.Split(string(b), "\n") {
			k, v, _ := strings.Cut(line, ":")
			want := uint64(0)
			switch k {
			case "CapPrm", "CapEff":
				want = mask
			case "CapBnd":
				if held == capsNone {
					continue // only root, which held them, could drop them
				}
				want = mask
			case "CapInh", "CapAmb":
			default:
				continue
			}
			if got, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil || got != want {
				t.Errorf("the VMM's thread %s: %s = %s; want %016x", task.Name(), k, strings.TrimSpace(v), want)
			}
		}
	}
}
