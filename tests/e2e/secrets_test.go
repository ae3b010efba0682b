package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/tlsproxy"
)

// serveTLSEnv makes the test binary the HTTPS server of the secrets tests
// (in the stand-in public host's network namespace, or on loopback):
// "ADDR CERT KEY LOG". It appends each request's Host and Authorization
// to LOG and answers with the Authorization it got, in its body and an
// X-Echo header: an upstream that echoes the secret back.
const serveTLSEnv = "CAPSA_E2E_SERVE_TLS"

// tlsBenchEnv makes the test binary, copied into a guest, the client of
// BenchmarkSecrets: "URL N keepalive|newconn CAFILE".
const tlsBenchEnv = "CAPSA_E2E_TLSBENCH"

func init() {
	// Before TestMain: these modes are no test run.
	if v := os.Getenv(serveTLSEnv); v != "" {
		fmt.Fprintln(os.Stderr, serveTLS(v))
		os.Exit(1)
	}
	if v := os.Getenv(tlsBenchEnv); v != "" {
		if err := tlsBenchClient(v); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
}

func serveTLS(spec string) error {
	f := strings.Fields(spec)
	if len(f) != 4 {
		return fmt.Errorf("%s=%q: want ADDR CERT KEY LOG", serveTLSEnv, spec)
	}
	logf, err := os.OpenFile(f[3], os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	var mu sync.Mutex
	srv := &http.Server{Addr: f[0], Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		fmt.Fprintf(logf, "%s %s %s\n", r.Host, r.URL.Path, r.Header.Get("Authorization"))
		mu.Unlock()
		echoAuth(w, r)
	})}
	return srv.ListenAndServeTLS(f[1], f[2])
}

// echoAuth answers with the Authorization it got, in its body and an
// X-Echo header: an upstream that echoes a secret back.
func echoAuth(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	auth := r.Header.Get("Authorization")
	w.Header().Set("X-Echo", auth)
	fmt.Fprintf(w, "auth=%s", auth)
}

// testPKI is a CA of the test's own and a server certificate from it for
// some names, as PEM files.
type testPKI struct {
	caFile, certFile, keyFile string
	pool                      *x509.CertPool
}

func newTestPKI(tb testing.TB, dir string, names ...string) testPKI {
	tb.Helper()
	now := time.Now()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "capsa e2e upstream CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		tb.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		tb.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	p := testPKI{caFile: filepath.Join(dir, "ca.pem"), certFile: filepath.Join(dir, "cert.pem"), keyFile: filepath.Join(dir, "key.pem"), pool: x509.NewCertPool()}
	p.pool.AddCert(ca)
	for path, blk := range map[string]*pem.Block{
		p.caFile: {Type: "CERTIFICATE", Bytes: caDER}, p.certFile: {Type: "CERTIFICATE", Bytes: der}, p.keyFile: {Type: "EC PRIVATE KEY", Bytes: kb},
	} {
		if err := os.WriteFile(path, pem.EncodeToMemory(blk), 0o644); err != nil {
			tb.Fatal(err)
		}
	}
	return p
}

// servePublicTLS starts the HTTPS server of the secrets tests in the
// stand-in public host of w (serveTLSEnv), with pki's certificate,
// logging to logPath, and waits until api.example.test answers there
// (which logs one request).
func servePublicTLS(t *testing.T, w *netWorld, pki testPKI, logPath string) {
	t.Helper()
	srv := exec.Command("nsenter", "-t", strconv.Itoa(w.serverPID), "-n", os.Args[0])
	srv.Env = append(os.Environ(), serveTLSEnv+"=:443 "+pki.certFile+" "+pki.keyFile+" "+logPath)
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		t.Fatalf("start the HTTPS server: %v", err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	waitHTTPS(t, "https://api.example.test/", pki.pool, func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, publicIP+":443")
	})
}

// waitHTTPS waits until url answers 200, trusting pool.
func waitHTTPS(tb testing.TB, url string, pool *x509.CertPool, dial func(context.Context, string, string) (net.Conn, error)) {
	tb.Helper()
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, DialContext: dial}}
	var last error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		resp, err := c.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
			err = fmt.Errorf("status %s", resp.Status)
		}
		last = err
	}
	tb.Fatalf("%s: %v", url, last)
}

// secretValue is unique to the run, so that its only way into anything is
// this test.
func secretValue() string {
	b := make([]byte, 8)
	rand.Read(b)
	return "s3cr3t-value-" + hex.EncodeToString(b)
}

// pyRequest sends GET URL with "Authorization: Bearer $API_KEY" (and Host
// HOST if given) and prints [status, body] as JSON.
const pyRequest = `import json, os, sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + os.environ["API_KEY"]})
if len(sys.argv) > 2:
    req.add_header("Host", sys.argv[2])
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
`

// pyPlain reaches HOST:443 trusting only CAFILE (the upstream's CA) and
// prints the status, the issuer of the certificate it got and the body.
const pyPlain = `import http.client, os, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[2])
c = http.client.HTTPSConnection(sys.argv[1], 443, context=ctx, timeout=60)
c.request("GET", "/plain", headers={"Authorization": "Bearer " + os.environ["API_KEY"]})
r = c.getresponse()
issuer = dict(x[0] for x in c.sock.getpeercert()["issuer"])
print(r.status, issuer["commonName"], r.read().decode())
`

// pyResult is what pyRequest printed.
func pyResult(t *testing.T, out *sandbox.Output, err error) (int, string) {
	t.Helper()
	if err != nil || out.Code != 0 {
		t.Fatalf("python: %v, %+v", err, out)
	}
	var res [2]any
	if err := json.Unmarshal(out.Stdout, &res); err != nil {
		t.Fatalf("python printed %q: %v", out.Stdout, err)
	}
	code, _ := res[0].(float64)
	body, _ := res[1].(string)
	return int(code), body
}

// countInFile counts needle in a file, read in pieces.
func countInFile(t *testing.T, path string, needle []byte) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n, tail := 0, []byte(nil)
	buf := make([]byte, 4<<20)
	for {
		k, err := f.Read(buf)
		chunk := append(tail, buf[:k]...)
		n += bytes.Count(chunk, needle)
		// Keep what could start a match across the boundary.
		keep := min(len(chunk), len(needle)-1)
		tail = append([]byte(nil), chunk[len(chunk)-keep:]...)
		if err != nil {
			return n
		}
	}
}

// treeHolds lists the files under dir that hold needle (skipping skip).
func treeHolds(t *testing.T, dir string, needle []byte, skip string) []string {
	t.Helper()
	var found []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && filepath.Base(p) != skip && countInFile(t, p, needle) > 0 {
			found = append(found, p)
		}
		return nil
	})
	return found
}

// serverLog is what the upstream server recorded: "HOST PATH AUTH" lines.
func serverLog(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

// TestSecrets: an image sandbox holds only a placeholder for API_KEY; python
// with urllib sends it to the stand-in public host's HTTPS server (a CA of
// the test's own, trusted on the host side only), which gets the real
// value and echoes it back, and python sees the placeholder; the same
// request to another intercepted host is refused, as is a Host other than
// the TLS name; a host not intercepted is reached with its own
// certificate; then no copy of the value is in the guest's memory, nor in
// a snapshot of it, whose restore keeps the placeholder working. Then the
// CLI: run -d with --secret-env, exec, logs --net, and no value in the
// state directory but its 0600 secrets file.
func TestSecrets(t *testing.T) {
	kernel, initrd := artifact(t, "vmlinux"), artifact(t, "initramfs.cpio")
	w := setupNetWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	value := secretValue()
	dir := t.TempDir()
	pki := newTestPKI(t, dir, "api.example.test", "other.example.test", "plain.example.test")
	logPath := filepath.Join(dir, "requests.log")
	servePublicTLS(t, w, pki, logPath)
	if err := os.Truncate(logPath, 0); err != nil { // the wait's request
		t.Fatal(err)
	}
	dns := startDNS(t, map[string]string{
		"api.example.test.":   publicIP,
		"other.example.test.": publicIP,
		"plain.example.test.": publicIP,
	})
	startRegistry(t)
	ref := registryAddr + "/capsa-test/python:3.11"
	pushPythonImage(t, ref)
	cache := t.TempDir()

	wl := sandbox.New().Memory(512).Kernel(kernel).Initrd(initrd).ImageStore(filepath.Join(cache, "images")).
		Network(netstack.PublicOnly()).DNSServer(dns).
		Secret("API_KEY", value, "api.example.test").TLSIntercept("other.example.test").UpstreamCA(pki.caFile).
		Entrypoint("sleep").OCI(ref, "100000")
	spec, err := wl.Spec()
	if err != nil {
		t.Fatal(err)
	}
	placeholder := spec.Network.Secrets[0].Placeholder
	if b, _ := json.Marshal(spec); bytes.Contains(b, []byte(value)) {
		t.Fatalf("the sandbox's spec holds the value: %s", b)
	}
	start := time.Now()
	sb, err := wl.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { sb.Close() }()
	t.Logf("image sandbox with interception up in %v", time.Since(start).Round(time.Millisecond))

	out, err := sb.Exec(ctx, sandbox.Shell("echo $API_KEY"))
	if err != nil || strings.TrimSpace(string(out.Stdout)) != placeholder || !strings.HasPrefix(placeholder, tlsproxy.PlaceholderPrefix) {
		t.Fatalf("echo $API_KEY = %q, %v; want the placeholder %q", out.Stdout, err, placeholder)
	}
	py := func(sb *sandbox.Sandbox, args ...string) (int, string) {
		t.Helper()
		out, err := sb.Exec(ctx, sandbox.ExecOptions{Argv: append([]string{"python3", "-c", pyRequest}, args...), Timeout: 2 * time.Minute})
		return pyResult(t, out, err)
	}

	// Substituted on the way out, scrubbed on the way back.
	if code, body := py(sb, "https://api.example.test/v1/models"); code != 200 || body != "auth=Bearer "+placeholder {
		t.Errorf("GET https://api.example.test/v1/models = %d %q, want 200 and the echo with the placeholder", code, body)
	}
	if want := "api.example.test /v1/models Bearer " + value + "\n"; serverLog(t, logPath) != want {
		t.Errorf("the server got %q, want %q", serverLog(t, logPath), want)
	}
	// Another intercepted host: refused, never sent.
	if code, body := py(sb, "https://other.example.test/v1/models"); code != 403 || !strings.Contains(body, "API_KEY") {
		t.Errorf("the placeholder to other.example.test = %d %q, want 403 naming API_KEY", code, body)
	}
	// Domain fronting: the TLS name allowed, the Host another.
	if code, _ := py(sb, "https://api.example.test/v1/front", "other.example.test"); code != 421 {
		t.Errorf("SNI api.example.test with Host other.example.test = %d, want 421", code)
	}
	if log := serverLog(t, logPath); strings.Count(log, "\n") != 1 {
		t.Errorf("the server got more than the one allowed request:\n%s", log)
	}
	// Not intercepted: the server's own certificate, the placeholder as
	// it is.
	if err := sb.WriteFile(ctx, "/tmp/upstream-ca.pem", mustRead(t, pki.caFile), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = sb.Exec(ctx, sandbox.ExecOptions{Argv: []string{"python3", "-c", pyPlain, "plain.example.test", "/tmp/upstream-ca.pem"}, Timeout: 2 * time.Minute})
	if want := "200 capsa e2e upstream CA auth=Bearer " + placeholder + "\n"; err != nil || string(out.Stdout) != want {
		t.Errorf("plain.example.test, not intercepted: %q %q, %v; want %q", out.Stdout, out.Stderr, err, want)
	}

	recs := sb.NetAudit()
	if len(recs) != 3 || recs[0].Status != 200 || len(recs[0].Substituted) != 1 || recs[0].Host != "api.example.test" ||
		!recs[1].Blocked || recs[1].Status != 403 || !recs[2].Blocked || recs[2].Status != 421 {
		t.Errorf("NetAudit() = %+v, want the substituted, the refused and the fronted request", recs)
	}

	// The guest's whole memory: the placeholder, never the value.
	if err := sb.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	nValue, err1 := sb.CountInMemory([]byte(value))
	nPlaceholder, err2 := sb.CountInMemory([]byte(placeholder))
	if err := sb.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if err1 != nil || err2 != nil || nValue != 0 || nPlaceholder == 0 {
		t.Fatalf("guest memory holds the value %d times and the placeholder %d times (%v, %v); want 0 and some", nValue, nPlaceholder, err1, err2)
	}
	t.Logf("guest memory: the placeholder %d times, the value never", nPlaceholder)

	// A snapshot holds no value (its memory, disk and manifest), and its
	// restore needs the value given again; the placeholder works on.
	snap := filepath.Join(t.TempDir(), "snap")
	if err := sb.Snapshot(ctx, snap); err != nil {
		t.Fatal(err)
	}
	sb.Close()
	if files := treeHolds(t, snap, []byte(value), ""); len(files) != 0 {
		t.Errorf("the snapshot's %v hold the value", files)
	}
	if fi, err := os.Stat(filepath.Join(snap, "tls-ca.pem")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the snapshot's CA: %v, %v; want a 0600 file", fi, err)
	}
	// Where the secret may go, the network and the image store are the
	// restorer's to give (the snapshot's are never used): the spec the
	// sandbox was made from, as a fork's come from its source's record.
	settings := sandbox.RestoreOptions{Settings: &spec}
	if _, err := sandbox.Restore(ctx, snap, settings); err == nil || !strings.Contains(err.Error(), "API_KEY") {
		t.Errorf("restoring without the value: %v, want an error naming API_KEY", err)
	}
	settings.Secrets = map[string]string{"API_KEY": value}
	restored, err := sandbox.Restore(ctx, snap, settings)
	if err != nil {
		t.Fatal(err)
	}
	defer restored.Close()
	if code, body := py(restored, "https://api.example.test/v1/restored"); code != 200 || body != "auth=Bearer "+placeholder {
		t.Errorf("after a restore: %d %q, want 200 and the echo with the placeholder", code, body)
	}
	if log := serverLog(t, logPath); !strings.HasSuffix(log, "api.example.test /v1/restored Bearer "+value+"\n") {
		t.Errorf("after a restore the server got:\n%s", log)
	}
	restored.Close()

	// The CLI, detached: the value from the host's environment.
	state := t.TempDir()
	env := func(c *exec.Cmd) {
		c.Env = append(os.Environ(), "CAPSA_STATE="+state, "CAPSA_CACHE="+cache, "E2E_API_TOKEN="+value)
	}
	r := capsaWith(t, 5*time.Minute, env, "run", "-d", "--name", "sec", "--net", "--dns-server", dns,
		"--secret-env", "API_KEY=E2E_API_TOKEN@api.example.test", "--tls-upstream-ca", pki.caFile,
		"--image", ref, "--entrypoint", "sleep", "--", "100000")
	if r.code != 0 {
		t.Fatalf("capsa run -d --secret-env ...: exit %d %s", r.code, r.stderr)
	}
	defer capsaWith(t, time.Minute, env, "rm", "-f", "sec")
	r = capsaWith(t, time.Minute, env, "exec", "sec", "--", "sh", "-c", "echo $API_KEY")
	cliPlaceholder := strings.TrimSpace(r.stdout)
	if r.code != 0 || !strings.HasPrefix(cliPlaceholder, tlsproxy.PlaceholderPrefix) || cliPlaceholder == placeholder {
		t.Errorf("capsa exec sec -- sh -c 'echo $API_KEY': exit %d %q %s; want a placeholder of its own", r.code, r.stdout, r.stderr)
	}
	r = capsaWith(t, 2*time.Minute, env, "exec", "sec", "--", "python3", "-c", pyRequest, "https://api.example.test/v1/cli")
	if want := fmt.Sprintf("[200, %q]\n", "auth=Bearer "+cliPlaceholder); r.code != 0 || r.stdout != want {
		t.Errorf("capsa exec sec -- python3 ...: exit %d %q %s; want %q", r.code, r.stdout, r.stderr, want)
	}
	if log := serverLog(t, logPath); !strings.HasSuffix(log, "api.example.test /v1/cli Bearer "+value+"\n") {
		t.Errorf("from the detached sandbox the server got:\n%s", log)
	}
	// The audit log: the NAT's flows (DNS, the connection) and the one
	// intercepted request.
	r = capsaWith(t, time.Minute, env, "logs", "--net", "sec")
	var reqs []tlsproxy.Record
	for line := range strings.Lines(r.stdout) {
		var rec tlsproxy.Record
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Errorf("capsa logs --net sec: %q is not JSON: %v", line, err)
		}
		if rec.Kind == "http" {
			reqs = append(reqs, rec)
		}
	}
	if r.code != 0 || len(reqs) != 1 || reqs[0].Path != "/v1/cli" || reqs[0].Status != 200 ||
		len(reqs[0].Substituted) != 1 || reqs[0].Substituted[0] != "API_KEY" {
		t.Errorf("capsa logs --net sec: exit %d %q %s; want one intercepted request, /v1/cli, API_KEY substituted", r.code, r.stdout, r.stderr)
	}
	if files := treeHolds(t, state, []byte(value), "secrets.json"); len(files) != 0 {
		t.Errorf("the state directory's %v hold the value", files)
	}
	if fi, err := os.Stat(filepath.Join(state, "sandboxes", "sec", "secrets.json")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the sandbox's secrets file: %v, %v; want a 0600 file", fi, err)
	}
}

func mustRead(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
