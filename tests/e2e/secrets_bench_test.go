package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// tlsBenchClient is the guest end of BenchmarkSecrets: N GETs of URL with
// "Authorization: Bearer $API_KEY", on one kept-alive connection or a new
// one each, trusting the bundle SSL_CERT_FILE names (the sandbox's CA)
// and CAFILE (the server's own); it prints each request's time in µs.
func tlsBenchClient(job string) error {
	f := strings.Fields(job)
	if len(f) != 4 {
		return fmt.Errorf("%s=%q: want URL N keepalive|newconn CAFILE", tlsBenchEnv, job)
	}
	n, err := strconv.Atoi(f[1])
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	for _, p := range []string{os.Getenv("SSL_CERT_FILE"), f[3]} {
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		pool.AppendCertsFromPEM(b)
	}
	c := &http.Client{Timeout: time.Minute, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool}, DisableKeepAlives: f[2] == "newconn"}}
	auth := "Bearer " + os.Getenv("API_KEY")
	var times []string
	for range n {
		start := time.Now()
		req, err := http.NewRequest("GET", f[0], nil)
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", auth)
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("GET %s: %s", f[0], resp.Status)
		}
		times = append(times, strconv.FormatInt(time.Since(start).Microseconds(), 10))
	}
	fmt.Println(strings.Join(times, " "))
	return nil
}

// BenchmarkSecrets measures HTTPS requests from a guest program to a host
// server (on loopback, port 443, reached through the gateway): to a name
// intercepted with a secret substituted in its Authorization header and
// the echo scrubbed on the way back, beside a name passed through
// untouched, on one kept-alive connection and on a new connection each
// (a TLS handshake with the NAT's minted certificate and one upstream).
// Each row reports the requests' time (min, median, max) and their rate.
func BenchmarkSecrets(b *testing.B) {
	ctx := context.Background()
	dir := b.TempDir()
	pki := newTestPKI(b, dir, "api.bench.test", "plain.bench.test")
	cert, err := tls.LoadX509KeyPair(pki.certFile, pki.keyFile)
	if err != nil {
		b.Fatal(err)
	}
	l, err := tls.Listen("tcp", "127.0.0.1:443", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		b.Skipf("listen on 127.0.0.1:443 (needs root, as in the nested host): %v", err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(echoAuth)}
	go srv.Serve(l)
	defer srv.Close()

	policy, err := netstack.ParsePolicy("public-only", []string{"127.0.0.1:443"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	sb, err := sandbox.New().Memory(512).Kernel(artifactB(b, "vmlinux")).Initrd(artifactB(b, "initramfs.cpio")).
		Network(policy).Secret("API_KEY", secretValue(), "api.bench.test").UpstreamCA(pki.caFile).
		Run("sleep", "100000").Start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	copySelf(b, ctx, sb, "/tmp/tlsbench")
	if err := sb.WriteFile(ctx, "/tmp/upstream-ca.pem", mustRead(b, pki.caFile), 0o644); err != nil {
		b.Fatal(err)
	}
	// The names stand for the gateway, which stands for the host.
	if err := sb.WriteFile(ctx, "/etc/hosts", []byte("127.0.0.1 localhost\n10.0.2.2 api.bench.test plain.bench.test\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	for _, row := range []struct {
		name, url, mode string
		n               int
	}{
		{"intercepted/keepalive", "https://api.bench.test/v1", "keepalive", 200},
		{"passthrough/keepalive", "https://plain.bench.test/v1", "keepalive", 200},
		{"intercepted/newconn", "https://api.bench.test/v1", "newconn", 100},
		{"passthrough/newconn", "https://plain.bench.test/v1", "newconn", 100},
	} {
		b.Run(row.name, func(b *testing.B) {
			var samples []time.Duration
			var total time.Duration
			for b.Loop() {
				job := fmt.Sprintf("%s %d %s /tmp/upstream-ca.pem", row.url, row.n, row.mode)
				r, err := sb.Exec(ctx, sandbox.ExecOptions{Argv: []string{"/tmp/tlsbench"}, Env: []string{tlsBenchEnv + "=" + job}, Timeout: 5 * time.Minute})
				if err != nil || r.Code != 0 {
					b.Fatalf("guest %s: %v %+v", job, err, r)
				}
				for _, f := range strings.Fields(string(r.Stdout)) {
					us, err := strconv.Atoi(f)
					if err != nil {
						b.Fatalf("guest printed %q", r.Stdout)
					}
					samples = append(samples, time.Duration(us)*time.Microsecond)
					total += time.Duration(us) * time.Microsecond
				}
			}
			reportSpread(b, samples)
			b.ReportMetric(float64(len(samples))/total.Seconds(), "req/s")
		})
	}
	st, _ := sb.InterceptStats()
	b.Logf("interception: %+v", st)
}
