package e2e

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	_ "embed"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/store"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// e2bClientScript drives `capsa serve` with E2B's JS SDK (TestE2BSDK).
//
//go:embed testdata/e2b-client.mjs
var e2bClientScript []byte

// e2bImage pushes an image for E2B's conventions to the test registry and
// returns its reference: Debian's python root with a user "user" (1000,
// home /home/user, bash), as E2B's own templates have.
func e2bImage(t testing.TB) string {
	t.Helper()
	startRegistry(t)
	base := artifact(t, "testimages/python.tar.gz")
	passwd, group := rootFile(t, base, "etc/passwd"), rootFile(t, base, "etc/group")
	passwd = append(passwd, "user:x:1000:1000::/home/user:/bin/bash\n"...)
	group = append(group, "user:x:1000:\n"...)
	root, err := tarball.LayerFromFile(base)
	if err != nil {
		t.Fatal(err)
	}
	users := tarLayer(t,
		layerEntry{h: tar.Header{Name: "etc/passwd", Typeflag: tar.TypeReg, Mode: 0o644}, data: passwd},
		layerEntry{h: tar.Header{Name: "etc/group", Typeflag: tar.TypeReg, Mode: 0o644}, data: group},
		layerEntry{h: tar.Header{Name: "home/user/", Typeflag: tar.TypeDir, Mode: 0o755, Uid: 1000, Gid: 1000}},
	)
	ref := registryAddr + "/capsa-test/e2b:1"
	pushImage(t, ref, v1.Config{Env: []string{"PATH=" + imagePath}}, root, users)
	t.Setenv("CAPSA_CACHE", t.TempDir())
	return ref
}

// rootFile returns the file name from the gzipped tar root.
func rootFile(t testing.TB, root, name string) []byte {
	t.Helper()
	f, err := os.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s: no %s in it: %v", root, name, err)
		}
		if strings.TrimPrefix(h.Name, "./") == name {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			return b
		}
	}
}

// e2bServer is a running `capsa serve` of a test.
type e2bServer struct {
	t    testing.TB
	dir  string
	addr string
	cmd  *exec.Cmd
	log  *bytes.Buffer
}

// startServe starts `capsa serve` on the state directory dir, listening
// on addr, and waits until it answers.
func startServe(t testing.TB, dir, addr string, args ...string) *e2bServer {
	t.Helper()
	s := &e2bServer{t: t, dir: dir, addr: addr, log: &bytes.Buffer{}}
	s.cmd = exec.Command(artifact(t, "capsa"), append([]string{"serve", "--listen", addr}, args...)...)
	s.cmd.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.kill()
		if t.Failed() {
			t.Logf("capsa serve's log:\n%s", s.log)
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("capsa serve did not listen on %s in 30 s: %v\n%s", addr, err, s.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// kill kills the server, as a crash would.
func (s *e2bServer) kill() {
	if s.cmd.ProcessState == nil {
		s.cmd.Process.Signal(syscall.SIGKILL)
		s.cmd.Wait()
	}
}

// suspendWithoutMemory: capsa suspend --no-memory (what an E2B pause
// without memory does) keeps an image sandbox's disk alone, a snapshot
// with no memory or VM state; capsa resume boots it again: a file kept, a
// new boot.
func suspendWithoutMemory(t *testing.T, dir string, cli func(time.Duration, ...string) result, ref string) {
	t.Helper()
	if r := cli(5*time.Minute, "run", "-d", "--name", "nomem", "--image", ref, "--", "sleep", "100000"); r.code != 0 {
		t.Fatalf("capsa run -d --image: exit %d, %q", r.code, r.stderr)
	}
	defer cli(time.Minute, "rm", "-f", "nomem")
	const probe = "echo kept > /root/mark && cat /proc/sys/kernel/random/boot_id"
	r := cli(time.Minute, "exec", "nomem", "--", "sh", "-c", probe)
	if r.code != 0 {
		t.Fatalf("capsa exec nomem: exit %d, %q", r.code, r.stderr)
	}
	boot := r.stdout
	if r := cli(2*time.Minute, "suspend", "--no-memory", "nomem"); r.code != 0 {
		t.Fatalf("capsa suspend --no-memory nomem: exit %d, %q", r.code, r.stderr)
	}
	st, err := store.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	snap := st.SuspendDir("nomem")
	m, _, err := snapshot.ReadManifest(snap)
	if err != nil || !m.DiskOnly {
		t.Errorf("the suspension's manifest: %+v, %v; want disk_only", m, err)
	}
	for _, name := range []string{snapshot.MemoryFile, snapshot.StateFile} {
		if _, err := os.Stat(filepath.Join(snap, name)); !os.IsNotExist(err) {
			t.Errorf("the suspension holds %s (%v); want the disk alone", name, err)
		}
	}
	if r := cli(3*time.Minute, "resume", "nomem"); r.code != 0 {
		t.Fatalf("capsa resume nomem: exit %d, %q", r.code, r.stderr)
	}
	r = cli(time.Minute, "exec", "nomem", "--", "sh", "-c", "cat /root/mark /proc/sys/kernel/random/boot_id")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "kept\n") || strings.HasSuffix(r.stdout, boot) {
		t.Errorf("after the resume: exit %d, %q (boot before: %q); want the file kept and a new boot", r.code, r.stdout, boot)
	}
}

// rulesServer is the HTTPS server of TestE2BSDK's network rules: in the
// stand-in public host (setupNetWorld), named by a DNS server of the
// test's, its certificate from a CA of the test's.
type rulesServer struct {
	dns, caFile, log string
}

func rulesUpstream(t *testing.T) rulesServer {
	t.Helper()
	w := setupNetWorld(t)
	dir := t.TempDir()
	pki := newTestPKI(t, dir, "api.example.test", "other.example.test")
	up := rulesServer{caFile: pki.caFile, log: filepath.Join(dir, "requests.log")}
	servePublicTLS(t, w, pki, up.log)
	up.dns = startDNS(t, map[string]string{"api.example.test.": publicIP, "other.example.test.": publicIP})
	return up
}

// freeAddr returns a loopback address with a free port.
func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// e2bClient runs testdata/e2b-client.mjs in mode with args, with Node and
// the SDK from the mcp-client bundle, and returns its lines; each FAIL
// line fails the test.
func e2bClient(t *testing.T, env []string, timeout time.Duration, mode string, args ...string) []string {
	t.Helper()
	node, script := nodeScript(t, "e2b-client.mjs", e2bClientScript)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, append([]string{script, mode}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	err := cmd.Run()
	t.Logf("e2b-client %s %v: %v after %v\n%s", mode, args, err, time.Since(start).Round(time.Millisecond), out.String())
	if errb.Len() > 0 {
		t.Logf("its stderr:\n%s", errb.String())
	}
	if ctx.Err() != nil {
		t.Fatalf("e2b-client %s: timed out after %v", mode, timeout)
	}
	var lines []string
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		line := sc.Text()
		lines = append(lines, line)
		if strings.HasPrefix(line, "FAIL ") {
			t.Error(line)
		}
	}
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 1) {
		t.Errorf("e2b-client %s: %v", mode, err)
	}
	return lines
}

// TestE2BSDK: E2B's official JS SDK (e2b 2.51.0 from npm, and 2.45.0,
// from before its /v2 paths) drives `capsa serve` as an agent would:
// sandboxes made from an image, from a template booted on create and from
// a pre-booted one (restored with its start command serving), forks and
// snapshots, a guest's port through the server, commands with their output,
// environment, directory, user, exit codes, stdin, a second client and
// kill, a terminal and its resize, files up to 20 MiB read back by hash,
// listing, watching, timeouts, metadata filters over pages, metrics,
// pause and resume, E2B's errors; then the server is killed and started
// again, and the SDK still reaches its sandbox. The API's sandboxes are
// ordinary detached sandboxes: capsa ps sees them.
func TestE2BSDK(t *testing.T) {
	dir, cli := detachedState(t)
	ref := e2bImage(t)
	r := cli(time.Minute, "serve", "key", "create", "--name", "e2e")
	key := strings.TrimSpace(r.stdout)
	if r.code != 0 || !strings.HasPrefix(key, "e2b_") || len(key) != 44 {
		t.Fatalf("capsa serve key create = exit %d, %q, %q; want an e2b_ key of 40 hex digits", r.code, r.stdout, r.stderr)
	}
	if r := cli(time.Minute, "serve", "key", "ls"); r.code != 0 || !strings.Contains(r.stdout, "e2e") || strings.Contains(r.stdout, key) {
		t.Errorf("capsa serve key ls = exit %d, %q; want the key's name and not the key", r.code, r.stdout)
	}
	// Two templates of the image: one pre-booted with a web server its
	// start command runs (ready once it answers), one booted on create.
	r = cli(5*time.Minute, "template", "create", "web", "--image", ref, "-e", "TEMPLATE_VAR=web", "--preboot",
		"--start-cmd", "mkdir -p /tmp/site && echo prebooted > /tmp/site/index.html && exec python3 -m http.server 8002 --bind 127.0.0.1 --directory /tmp/site",
		"--ready-cmd", `python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8002/")'`)
	if r.code != 0 {
		t.Fatalf("capsa template create web --preboot: exit %d, %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "template", "create", "plain", "--image", ref, "-e", "TEMPLATE_VAR=plain", "--start-cmd", "touch /tmp/started"); r.code != 0 {
		t.Fatalf("capsa template create plain: exit %d, %q", r.code, r.stderr)
	}
	for _, bad := range [][]string{{"base", "--image", ref}, {"x", "--image", ref, "--ready-cmd", "true"}, {"y"}, {"web", "--image", ref}} {
		if r := cli(time.Minute, append([]string{"template", "create"}, bad...)...); r.code == 0 || !strings.Contains(r.stderr, "template") {
			t.Errorf("capsa template create %v: exit %d, %q; want an error", bad, r.code, r.stderr)
		}
	}
	if r := cli(time.Minute, "template", "ls"); r.code != 0 || !strings.Contains(r.stdout, "template-web") || !strings.Contains(r.stdout, "plain") {
		t.Errorf("capsa template ls = exit %d, %q; want web pre-booted and plain", r.code, r.stdout)
	}
	r = cli(time.Minute, "serve", "key", "create", "--name", "other")
	other := strings.TrimSpace(r.stdout)
	if r.code != 0 {
		t.Fatalf("capsa serve key create --name other: exit %d, %q", r.code, r.stderr)
	}
	// The network rules' HTTPS server: api.example.test, by a CA of the
	// test's, which the server trusts for the sandboxes' interception.
	up := rulesUpstream(t)
	// --private-egress-proxy: the SOCKS5 server the client runs for
	// network.egressProxy listens on loopback.
	serveArgs := []string{"--dns-server", up.dns, "--tls-upstream-ca", up.caFile, "--private-egress-proxy"}
	addr := freeAddr(t)
	srv := startServe(t, dir, addr, serveArgs...)
	ruleValue, proxyPassword := secretValue(), secretValue()
	_, proxyPort, _ := net.SplitHostPort(freeAddr(t))
	env := []string{"E2B_API_URL=http://" + addr, "E2B_SANDBOX_URL=http://" + addr, "E2B_VOLUME_API_URL=http://" + addr,
		"E2B_API_KEY=" + key, "E2B_OTHER_KEY=" + other, "TEMPLATE=" + ref, "RULE_VALUE=" + ruleValue,
		"PROXY_PASSWORD=" + proxyPassword, "PROXY_PORT=" + proxyPort, "PUBLIC_IP=" + publicIP}

	lines := e2bClient(t, env, 8*time.Minute, "main")
	var keep string
	for _, l := range lines {
		if id, ok := strings.CutPrefix(l, "keep "); ok {
			keep = id
		}
	}
	if keep == "" {
		t.Fatal("e2b-client main left no sandbox to reach after a restart")
	}
	if ps := psAll(t, cli); ps[keep].State != "running" {
		t.Errorf("capsa ps -a: the API's sandbox %s is %+v; want running", keep, ps[keep])
	}
	// The rules' value reached the server, and is kept on the host in
	// the sandboxes' secrets files alone (0600), never in a record, a
	// snapshot or a log.
	if log := serverLog(t, up.log); !strings.Contains(log, "api.example.test /rules Bearer "+ruleValue) || !strings.Contains(log, "Bearer second") {
		t.Errorf("the rules' server saw:\n%s\nwant the rule's header, then the updated one", log)
	}
	if found := treeHolds(t, dir, []byte(ruleValue), "secrets.json"); len(found) > 0 {
		t.Errorf("the state directory holds a header rule's value in %v", found)
	}
	if found := treeHolds(t, dir, []byte(proxyPassword), "secrets.json"); len(found) > 0 {
		t.Errorf("the state directory holds the egress proxy's password in %v", found)
	}
	e2bClient(t, env, 5*time.Minute, "old")
	suspendWithoutMemory(t, dir, cli, ref)

	// A crash of the server leaves its sandboxes running; a new one
	// serves them again.
	srv.kill()
	startServe(t, dir, addr, serveArgs...)
	e2bClient(t, env, 3*time.Minute, "after-restart", keep)
	if ps := psAll(t, cli); ps[keep].State == "running" {
		t.Errorf("capsa ps -a: %s still runs after the SDK killed it", keep)
	}
}
