package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/confine"
)

// TestJail: as root (the nested host), every VMM process is jailed: a
// mount namespace whose root holds only the paths it uses, and with
// --jail-user another user. A detached sandbox run as 65534 keeps its
// share, the NAT and a published port; its supervisor runs as 65534 and
// sees only its paths (a host file outside is not there at all); an image
// sandbox runs jailed in the foreground and detached with --rm, and no
// temporary directory is left behind; rm removes what remains.
func TestJail(t *testing.T) {
	dir, cli := detachedState(t)
	w := setupNetWorld(t) // skips unless root
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("not for the VMM"), 0o600); err != nil {
		t.Fatal(err)
	}
	share := t.TempDir()
	if err := os.Chmod(share, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(share, "in.txt"), []byte("from the host"), 0o644); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("CAPSA_CACHE", t.TempDir())
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // the CLI's: what is left in it, it leaves behind
	tarPath := filepath.Join(t.TempDir(), "probe.tar")
	probeImage(t, tarPath, "capsa.test/probe:1")
	if r := cli(2*time.Minute, "image", "import", tarPath); r.code != 0 {
		t.Fatalf("capsa image import: exit %d, stderr %q", r.code, r.stderr)
	}

	// Bad flags are refused before anything starts.
	if r := cli(time.Minute, "run", "--jail-user", "nobody", "--", "true"); r.code != 2 || !strings.Contains(r.stderr, "--jail-user") {
		t.Errorf("capsa run --jail-user nobody = exit %d, stderr %q; want 2 naming the flag", r.code, r.stderr)
	}

	// Detached with --rm, from an image: it runs jailed, and when it ends
	// its record goes; its directory, which the jailed supervisor cannot
	// remove, goes at the next start, once a minute old.
	if r := cli(3*time.Minute, "run", "-d", "--rm", "--name", "r", "--jail-user", "65534", "--image", "capsa.test/probe:1"); r.code != 0 {
		t.Fatalf("capsa run -d --rm --jail-user --image = exit %d, stderr %q", r.code, r.stderr)
	}
	rdir := filepath.Join(dir, "sandboxes", "r")
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
		if _, ok := psAll(t, cli)["r"]; !ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the --rm sandbox r is still recorded after 2m")
		}
	}
	ents, _ := os.ReadDir(rdir)
	t.Logf("the --rm sandbox's directory holds %v when its record is gone", ents)
	old := time.Now().Add(-2 * time.Minute)
	os.Chtimes(rdir, old, old)

	// Detached as 65534, with a share, the NAT and a published port.
	// The probe reads the secret and the records' database.
	db := filepath.Join(dir, "state.db")
	t.Setenv(confine.ProbeEnv, secret+string(filepath.ListSeparator)+db)
	r := cli(3*time.Minute, "run", "-d", "--name", "j", "--jail-user", "65534:65534", "--net", "--dns-server", w.dns, "-p", "0:8080",
		"-v", share+":/mnt/share", "-v", filepath.Dir(self)+":/probe:ro",
		"-e", serveEnv+"=:8080", "-e", "CAPSA_E2E_SERVE_BODY=served jailed\n", "--", "/probe/"+filepath.Base(self))
	if r.code != 0 {
		t.Fatalf("capsa run -d --jail-user = exit %d, stderr %q", r.code, r.stderr)
	}
	if _, err := os.Stat(rdir); err == nil {
		t.Errorf("%s is still there after the next start swept", rdir)
	}
	rec := inspectConfined(t, cli, "j")
	l := rec.Confinement
	if !strings.HasPrefix(l.Namespaces, "on (mount namespace") || !strings.HasSuffix(l.Namespaces, "uid 65534 gid 65534)") {
		t.Errorf("the namespaces layer = %q, want on, as uid 65534 gid 65534", l.Namespaces)
	}
	// The jail pivots its root away, as on every host whose root is a
	// real file system; only on an initial ramfs does it move over it.
	if initramfs := rootIsInitramfs(t); initramfs != strings.Contains(l.Namespaces, "moved over the initial ramfs") {
		t.Errorf("the namespaces layer = %q on a host whose root is the initial ramfs: %v", l.Namespaces, initramfs)
	}
	pid := rec.PID
	status, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	if m := regexp.MustCompile(`(?m)^Uid:\s+(.*)$`).FindSubmatch(status); m == nil || strings.Join(strings.Fields(string(m[1])), " ") != "65534 65534 65534 65534" {
		t.Errorf("the supervisor's Uid line = %q, want 65534 four times", m)
	}
	checkCapabilities(t, l, pid, capsNone) // the jail's user holds none
	// What its root holds: the system files a VMM reads and the first
	// directories of its own paths, nothing else.
	ents, err = os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "root"))
	if err != nil {
		t.Fatal(err)
	}
	allowed := []string{"dev", "proc", "sys", "etc", "usr", first(dir), first(share), first(self)}
	var top []string
	for _, e := range ents {
		top = append(top, e.Name())
		if !slices.Contains(allowed, e.Name()) {
			t.Errorf("the jailed supervisor's root holds /%s, want only %v", e.Name(), allowed)
		}
	}
	t.Logf("the jailed supervisor's root: %v", top)
	probe := probeLine(t, dir, "j")
	if !strings.Contains(probe, `open="open `+secret+`: no such file or directory"`) || !strings.Contains(probe, `execve="operation not permitted"`) {
		t.Errorf("the jailed supervisor's probe: %q; want %s not there and execve refused", probe, secret)
	}
	// Its run is reported in its own directory (its status), not written
	// into the records: the database is not in its jail.
	if !strings.Contains(probe, `open2="open `+db+`: no such file or directory"`) {
		t.Errorf("the jailed supervisor's probe: %q; want the records' database %s not there", probe, db)
	}

	if r := cli(time.Minute, "exec", "j", "--", "sh", "-c", "cat /mnt/share/in.txt && echo out > /mnt/share/out.txt"); r.code != 0 || r.stdout != "from the host" {
		t.Errorf("the share, jailed: exit %d, %q (stderr %q)", r.code, r.stdout, r.stderr)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(share, "out.txt"), &st); err != nil || st.Uid != 65534 {
		t.Errorf("the file the guest wrote to the share: owner %d, %v; want 65534", st.Uid, err)
	}
	checkNATAndPort(t, cli, "j", rec.Ports, "served jailed\n", "jailed")
	// Suspended to disk by its jailed supervisor, as 65534, and resumed
	// by root into a new one, jailed as the same user: its memory and
	// files come back, and the snapshot goes.
	if r := cli(time.Minute, "exec", "j", "--", "sh", "-c", "echo before-suspend > /tmp/mark"); r.code != 0 {
		t.Errorf("capsa exec j: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "suspend", "j"); r.code != 0 {
		t.Errorf("capsa suspend j (jailed as 65534) = exit %d, stderr %q", r.code, r.stderr)
	} else if r := cli(3*time.Minute, "resume", "j"); r.code != 0 {
		t.Errorf("capsa resume j (suspended as 65534) = exit %d, stderr %q", r.code, r.stderr)
	} else {
		if r := cli(time.Minute, "exec", "j", "--", "cat", "/tmp/mark"); r.code != 0 || r.stdout != "before-suspend\n" {
			t.Errorf("after suspend and resume, jailed: exit %d, %q (stderr %q); want the guest's file", r.code, r.stdout, r.stderr)
		}
		if l := inspectConfined(t, cli, "j").Confinement; !strings.HasSuffix(l.Namespaces, "uid 65534 gid 65534)") {
			t.Errorf("the resumed supervisor's namespaces layer = %q; want jailed as 65534 again", l.Namespaces)
		}
		if _, err := os.Stat(filepath.Join(dir, "sandboxes", "j", "suspended")); !os.IsNotExist(err) {
			t.Errorf("the suspension's snapshot after the resume: %v; want it gone", err)
		}
	}
	if r := cli(time.Minute, "rm", "-f", "j"); r.code != 0 {
		t.Errorf("capsa rm -f j = exit %d, stderr %q", r.code, r.stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "sandboxes", "j")); err == nil {
		t.Error("capsa rm -f j left its directory")
	}
	t.Run("layer over another user's snapshot", func(t *testing.T) { layerOverAnotherUsers(t, dir, cli) })

	// In the foreground: capsa run starts itself again in a namespace of
	// its own; the probe's open finds nothing; an image runs as 65534.
	r = cli(3*time.Minute, "run", "--verbose", "--jail-user", "65534", "-v", share+":/mnt/share", "--", "cat", "/mnt/share/in.txt")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "from the host") || !strings.Contains(r.stderr, `open="open `+secret+`: no such file or directory"`) {
		t.Errorf("capsa run --jail-user, with the probe = exit %d, %q; want the share read and %s not there", r.code, r.stdout, secret)
	}
	if m := regexp.MustCompile(`capsa run: confined.*namespaces: on \(mount namespace[^)]*uid 65534 gid 65534\).* took=(\S+)`).FindStringSubmatch(r.stderr); m == nil {
		t.Errorf("capsa run --verbose --jail-user: no confined line with the namespaces layer on as 65534")
	} else {
		t.Logf("confining with the jail took %s", m[1])
	}
	t.Setenv(confine.ProbeEnv, "")
	r = cli(3*time.Minute, "run", "--jail-user", "65534", "--image", "capsa.test/probe:1")
	if want := "uid=1000 gid=1000 cwd=/home/app greeting=from-image home=/home/app hosts=true gone=true kept=kept\n"; r.code != 0 || r.stdout != want {
		t.Errorf("capsa run --jail-user --image: exit %d, stdout %q, want %q", r.code, r.stdout, want)
	}
	if r := cli(time.Minute, "run", "--", "sh", "-c", "exit 7"); r.code != 7 {
		t.Errorf("capsa run, jailed, of exit 7 = exit %d", r.code)
	}
	if ents, _ := os.ReadDir(tmp); len(ents) > 0 {
		t.Errorf("the runs left %v in their TMPDIR", ents)
	}
}

// layerOverAnotherUsers: a layer over a snapshot that a supervisor
// jailed as 65534 wrote (its files 65534's, mode 0600), asked of a
// supervisor run by root that serves no host files and so holds no
// capability to read them: the CLI lends it the parent's files, and the
// layer restores to what both held.
func layerOverAnotherUsers(t *testing.T, dir string, cli func(time.Duration, ...string) result) {
	t.Helper()
	if r := cli(3*time.Minute, "run", "-d", "--name", "js", "--jail-user", "65534", "--", "sleep", "100000"); r.code != 0 {
		t.Fatalf("capsa run -d --jail-user 65534 = exit %d, stderr %q", r.code, r.stderr)
	}
	defer cli(time.Minute, "rm", "-f", "js", "jr", "jl")
	if r := cli(time.Minute, "exec", "js", "--", "sh", "-c", "echo in-parent > /tmp/p"); r.code != 0 {
		t.Fatalf("capsa exec js = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "snapshot", "create", "js", "jsnap"); r.code != 0 {
		t.Fatalf("capsa snapshot create js jsnap (jailed as 65534) = exit %d, stderr %q", r.code, r.stderr)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(dir, "snapshots", "jsnap", "memory"), &st); err != nil || st.Uid != 65534 || st.Mode&0o077 != 0 {
		t.Errorf("jsnap's memory: owner %d, mode %04o, %v; want 65534's alone", st.Uid, st.Mode&0o7777, err)
	}
	if r := cli(3*time.Minute, "snapshot", "restore", "jsnap", "--name", "jr"); r.code != 0 {
		t.Fatalf("capsa snapshot restore jsnap, as root = exit %d, stderr %q", r.code, r.stderr)
	}
	rec := inspectConfined(t, cli, "jr")
	checkCapabilities(t, rec.Confinement, rec.PID, capsNone)
	if r := cli(time.Minute, "exec", "jr", "--", "sh", "-c", "echo in-layer > /tmp/l"); r.code != 0 {
		t.Fatalf("capsa exec jr = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "snapshot", "create", "--parent", "jsnap", "jr", "jlayer"); r.code != 0 {
		t.Fatalf("capsa snapshot create --parent jsnap jr jlayer = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "snapshot", "restore", "jlayer", "--name", "jl"); r.code != 0 {
		t.Fatalf("capsa snapshot restore jlayer = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "jl", "--", "cat", "/tmp/p", "/tmp/l"); r.code != 0 || r.stdout != "in-parent\nin-layer\n" {
		t.Errorf("the layer over another user's snapshot, restored: exit %d, %q (stderr %q); want both files", r.code, r.stdout, r.stderr)
	}
}

// first is the first element of an absolute path.
func first(p string) string {
	p = strings.TrimPrefix(filepath.Clean(p), "/")
	f, _, _ := strings.Cut(p, "/")
	return f
}

// rootIsInitramfs says whether this host's root is the initial ramfs
// (rootfs in /proc/self/mountinfo), which pivot_root cannot move.
func rootIsInitramfs(t *testing.T) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == "/" {
			_, post, _ := strings.Cut(line, " - ")
			return strings.HasPrefix(post, "rootfs ")
		}
	}
	return false
}
