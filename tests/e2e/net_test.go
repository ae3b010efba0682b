package e2e

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// serveEnv makes the test binary an HTTP server instead of a test run: the
// network tests start it in a network namespace on this machine, and copy
// it into a guest to serve from there.
const serveEnv = "CAPSA_E2E_SERVE_HTTP"

func TestMain(m *testing.M) {
	if os.Getenv(probeEnv) != "" {
		os.Exit(probe(os.Args[1:]))
	}
	if job := os.Getenv(netBenchEnv); job != "" {
		if err := netBenchClient(job); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if addr := os.Getenv(serveEnv); addr != "" {
		body := os.Getenv("CAPSA_E2E_SERVE_BODY")
		err := http.ListenAndServe(addr, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, body)
		}))
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	stop := traceShutdowns(os.Stderr)
	code := m.Run()
	stop(code != 0)
	os.Exit(code)
}

// netBenchEnv makes the test binary, copied into a guest, the guest end of
// the network benchmarks: "send ADDR BYTES" writes BYTES to ADDR, "recv
// ADDR" reads ADDR to its end, "connect ADDR N" opens and closes N
// connections one after another, "get URL N WORKERS" makes N HTTP GETs,
// each on a new connection, from WORKERS goroutines, and prints how many
// answered (its exit is 0 whatever they did).
const netBenchEnv = "CAPSA_E2E_NETBENCH"

func netBenchClient(job string) error {
	f := strings.Fields(job)
	if len(f) == 4 && f[0] == "get" {
		return netGets(f[1], f[2], f[3])
	}
	if len(f) >= 2 && (f[0] == "lookup" || f[0] == "dial" || f[0] == "udp") {
		return netProbe(f)
	}
	if len(f) >= 2 && (f[0] == "rate" || f[0] == "diskwrite") {
		return rateProbe(f)
	}
	if len(f) != 3 && !(len(f) == 2 && f[0] == "recv") {
		return fmt.Errorf("%s=%q: bad job", netBenchEnv, job)
	}
	switch f[0] {
	case "send":
		n, err := strconv.ParseInt(f[2], 10, 64)
		if err != nil {
			return err
		}
		c, err := net.Dial("tcp", f[1])
		if err != nil {
			return err
		}
		buf := make([]byte, 256<<10)
		for n > 0 {
			k, err := c.Write(buf[:min(int64(len(buf)), n)])
			if err != nil {
				return err
			}
			n -= int64(k)
		}
		c.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, c) // the host closes once it has it all
		return c.Close()
	case "recv":
		c, err := net.Dial("tcp", f[1])
		if err != nil {
			return err
		}
		_, err = io.Copy(io.Discard, c)
		c.Close()
		return err
	case "connect":
		n, err := strconv.Atoi(f[2])
		if err != nil {
			return err
		}
		for range n {
			c, err := net.Dial("tcp", f[1])
			if err != nil {
				return err
			}
			c.Close()
		}
		return nil
	}
	return fmt.Errorf("%s=%q: bad job", netBenchEnv, job)
}

// netProbe does one of the egress audit test's steps and prints what
// came of it (its exit is 0 whatever that was): "lookup NAME" resolves
// NAME, "dial ADDR" opens and closes a TCP connection, "udp ADDR MSG"
// sends MSG and waits 10 s for a reply.
func netProbe(f []string) error {
	switch {
	case f[0] == "lookup" && len(f) == 2:
		addrs, err := net.LookupHost(f[1])
		if err != nil {
			fmt.Println("lookup failed:", err)
			return nil
		}
		fmt.Println("addresses:", strings.Join(addrs, " "))
	case f[0] == "dial" && len(f) == 2:
		c, err := net.DialTimeout("tcp", f[1], 20*time.Second)
		if err != nil {
			fmt.Println("dial failed:", err)
			return nil
		}
		c.Close()
		fmt.Println("connected")
	case f[0] == "udp" && len(f) == 3:
		c, err := net.Dial("udp", f[1])
		if err != nil {
			return err
		}
		defer c.Close()
		if _, err := c.Write([]byte(f[2])); err != nil {
			return err
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 1500)
		n, err := c.Read(buf)
		if err != nil {
			fmt.Println("no reply:", err)
			return nil
		}
		fmt.Printf("reply: %s\n", buf[:n])
	default:
		return fmt.Errorf("%s=%q: bad job", netBenchEnv, strings.Join(f, " "))
	}
	return nil
}

// rateProbe measures a rate in the guest and prints "N bytes in S
// seconds": "rate ADDR [BYTES]" reads a TCP connection to ADDR to its end
// or for BYTES,
// "diskwrite PATH BYTES" writes BYTES to PATH (a disk) in 256 KiB
// synchronous writes.
func rateProbe(f []string) error {
	start := time.Now()
	var n int64
	switch {
	case f[0] == "rate" && (len(f) == 2 || len(f) == 3):
		limit := int64(math.MaxInt64)
		if len(f) == 3 {
			var err error
			if limit, err = strconv.ParseInt(f[2], 10, 64); err != nil {
				return err
			}
		}
		c, err := net.Dial("tcp", f[1])
		if err != nil {
			return err
		}
		defer c.Close()
		if n, err = io.Copy(io.Discard, io.LimitReader(c, limit)); err != nil {
			return err
		}
	case f[0] == "diskwrite" && len(f) == 3:
		total, err := strconv.ParseInt(f[2], 10, 64)
		if err != nil {
			return err
		}
		d, err := os.OpenFile(f[1], os.O_WRONLY|os.O_SYNC, 0)
		if err != nil {
			return err
		}
		defer d.Close()
		buf := make([]byte, 256<<10)
		for n < total {
			k, err := d.Write(buf[:min(int64(len(buf)), total-n)])
			if err != nil {
				return err
			}
			n += int64(k)
		}
	default:
		return fmt.Errorf("%s=%q: bad job", netBenchEnv, strings.Join(f, " "))
	}
	fmt.Printf("%d bytes in %.3f seconds\n", n, time.Since(start).Seconds())
	return nil
}

// netGets makes n GETs of url, each on a new connection, from workers
// goroutines, each with 20 s to get its whole answer, and prints "answered
// A of N" and the first errors. It stops early after 20 failures.
func netGets(url, n, workers string) error {
	total, err1 := strconv.Atoi(n)
	w, err2 := strconv.Atoi(workers)
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	var next, answered, failed atomic.Int64
	var mu sync.Mutex
	var errs []string
	var wg sync.WaitGroup
	for range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(total) && failed.Load() < 20 {
				resp, err := client.Get(url)
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if err == nil && resp.StatusCode != http.StatusOK {
						err = fmt.Errorf("status %s", resp.Status)
					}
				}
				if err != nil {
					failed.Add(1)
					mu.Lock()
					if len(errs) < 5 {
						errs = append(errs, err.Error())
					}
					mu.Unlock()
					continue
				}
				answered.Add(1)
			}
		}()
	}
	wg.Wait()
	fmt.Printf("answered %d of %d\n", answered.Load(), total)
	for _, e := range errs {
		fmt.Println("error:", e)
	}
	return nil
}

// natConns and natTLSConns are how many connections TestNATConnectionLoad
// makes, plain and over TLS (each of its two TLS variants; a handshake
// costs the nested host about three plain connections): make test's 2,000
// and 500, make soak's 50,000 and 5,000.
var (
	natConns    = flag.Int("nat.conns", 2000, "new plain connections TestNATConnectionLoad makes through the NAT")
	natTLSConns = flag.Int("nat.tls-conns", 500, "new TLS connections each TLS variant of TestNATConnectionLoad makes through the NAT")
)

// TestNATConnectionLoad: thousands of new connections from a guest through
// the NAT, from four workers, each answered: plain HTTP, HTTPS passed
// through (the guest trusts the server's CA), and HTTPS intercepted (the
// NAT terminates the guest's TLS with the sandbox's CA and opens its own to
// the server). The guest's ports are held to a range of 1,000, so each is
// used again within the minute, as a busy guest's are: before the NAT kept
// no TIME_WAIT of its own, a SYN from a port whose last connection the
// server had closed first got no answer (netstack.TestPortReuseAfterServerClose
// is the unit test).
func TestNATConnectionLoad(t *testing.T) {
	artifact(t, "vmlinux")
	dir := t.TempDir()
	pki := newTestPKI(t, dir, "load.example.test")
	dns := startDNS(t, map[string]string{"load.example.test.": "10.0.2.2"}) // the host's loopback
	for _, tc := range []struct {
		name      string
		tls       bool
		intercept bool
	}{{"plain", false, false}, {"tls", true, false}, {"tls-intercepted", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
			defer cancel()
			// Interception looks at port 443 alone (tlsproxy.Port).
			addr := "127.0.0.1:0"
			if tc.intercept {
				addr = "127.0.0.1:443"
			}
			l, err := net.Listen("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			var served atomic.Int64
			hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				served.Add(1)
				io.WriteString(w, "answer\n")
			})}
			scheme := "http"
			if tc.tls {
				scheme = "https"
				go hs.ServeTLS(l, pki.certFile, pki.keyFile)
			} else {
				go hs.Serve(l)
			}
			t.Cleanup(func() { hs.Close() })
			sb := netSandbox(t, ctx, func(b *sandbox.Builder) {
				b.Network(netstack.AllowAll()).DNSServer(dns)
				if tc.intercept {
					b.TLSIntercept("load.example.test").UpstreamCA(pki.caFile)
				}
			})
			copySelf(t, ctx, sb, "/tmp/netbench")
			if r, err := sb.Exec(ctx, sandbox.Shell("echo 40000 40999 > /proc/sys/net/ipv4/ip_local_port_range")); err != nil || r.Code != 0 {
				t.Fatalf("narrow the guest's port range: %+v, %v", r, err)
			}
			conns := *natConns
			if tc.tls {
				conns = *natTLSConns
			}
			env := []string{netBenchEnv + "=" + fmt.Sprintf("get %s://load.example.test:%d/ %d 4", scheme, l.Addr().(*net.TCPAddr).Port, conns)}
			if tc.tls && !tc.intercept {
				// Passed through: the guest checks the server's own
				// certificate.
				if err := sb.WriteFile(ctx, "/tmp/upstream-ca.pem", mustRead(t, pki.caFile), 0o644); err != nil {
					t.Fatal(err)
				}
				env = append(env, "SSL_CERT_FILE=/tmp/upstream-ca.pem")
			}
			start := time.Now()
			r, err := sb.Exec(ctx, sandbox.ExecOptions{Argv: []string{"/tmp/netbench"}, Env: env, Timeout: 25 * time.Minute})
			if err != nil || r.Code != 0 {
				t.Fatalf("the guest's GETs: %+v, %v\nthe sandbox's state:\n%s", r, err, sb.Debug(ctx))
			}
			t.Logf("%s in %v; the host served %d", strings.TrimSpace(string(r.Stdout)), time.Since(start).Round(time.Millisecond), served.Load())
			if want := fmt.Sprintf("answered %d of %d\n", conns, conns); string(r.Stdout) != want {
				t.Errorf("the guest's GETs through the NAT: %q; want every one answered", r.Stdout)
			}
			if tc.intercept {
				if st, ok := sb.InterceptStats(); !ok || st.Requests < uint64(conns) {
					t.Errorf("the NAT's interception: %+v, %v; want every request intercepted", st, ok)
				}
			}
		})
	}
}

// The stand-in public server's address, from a documentation range. It
// lives in its own network namespace behind a veth pair, so it is not one
// of this machine's addresses.
const (
	publicIP   = "203.0.113.10"
	publicPeer = "203.0.113.1"
)

// netWorld is what the network tests reach: a public server in a network
// namespace, a server on this machine's loopback, and a DNS server that
// names them.
type netWorld struct {
	dns       string // IP:PORT of the DNS server
	loopPort  int    // the loopback HTTP server's port
	serverPID int    // the public server's, in the public host's network namespace
}

func setupNetWorld(t *testing.T) *netWorld {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the network tests build a network namespace: run as root (the nested host does)")
	}
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	run("ip", "link", "set", "lo", "up")

	// The public server: this binary in serve mode, in a new network
	// namespace, joined to this one by a veth pair.
	srv := exec.Command("unshare", "-n", os.Args[0])
	srv.Env = append(os.Environ(), serveEnv+"=:80", "CAPSA_E2E_SERVE_BODY=public page\n")
	if err := srv.Start(); err != nil {
		t.Fatalf("start the public server: %v", err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	// unshare makes its namespace after it starts: a link moved to its
	// pid before that stays in this one (seen once in make test).
	self, _ := os.Readlink("/proc/self/ns/net")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", srv.Process.Pid))
		if err == nil && ns != self {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the public server's process has no network namespace of its own after 10 s (%s, %v)", ns, err)
		}
	}
	host := fmt.Sprintf("capsapub%d", os.Getpid()%1000)
	run("ip", "link", "add", host, "type", "veth")
	t.Cleanup(func() { exec.Command("ip", "link", "del", host).Run() })
	peer := vethPeer(t, host)
	pid := strconv.Itoa(srv.Process.Pid)
	run("ip", "link", "set", peer, "netns", pid)
	run("nsenter", "-t", pid, "-n", "ip", "addr", "add", publicIP+"/24", "dev", peer)
	run("nsenter", "-t", pid, "-n", "ip", "link", "set", peer, "up")
	run("ip", "addr", "add", publicPeer+"/24", "dev", host)
	run("ip", "link", "set", host, "up")
	waitHTTP(t, "http://"+publicIP+"/", "public page\n")

	// The loopback server.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "loopback secret\n")
	})}
	go hs.Serve(l)
	t.Cleanup(func() { hs.Close() })

	// DNS: names for both, one of them a rebinding attempt.
	dns := startDNS(t, map[string]string{
		"public.example.test.":  publicIP,
		"blocked.example.test.": publicIP,
		"rebind.example.test.":  "127.0.0.1",
	})
	return &netWorld{dns: dns, loopPort: l.Addr().(*net.TCPAddr).Port, serverPID: srv.Process.Pid}
}

// vethPeer finds the other end of veth dev (busybox's ip cannot name it).
func vethPeer(t *testing.T, dev string) string {
	t.Helper()
	b, err := os.ReadFile("/sys/class/net/" + dev + "/iflink")
	if err != nil {
		t.Fatal(err)
	}
	want := strings.TrimSpace(string(b))
	ifs, _ := filepath.Glob("/sys/class/net/*/ifindex")
	for _, f := range ifs {
		if b, err := os.ReadFile(f); err == nil && strings.TrimSpace(string(b)) == want {
			return filepath.Base(filepath.Dir(f))
		}
	}
	t.Fatalf("no peer of %s (ifindex %s)", dev, want)
	return ""
}

func waitHTTP(t *testing.T, url, want string) {
	t.Helper()
	var last error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		resp, err := http.Get(url)
		if err != nil {
			last = err
			continue
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) == want {
			return
		}
		last = fmt.Errorf("got %q", b)
	}
	t.Fatalf("%s: %v", url, last)
}

// udpServer answers each datagram to a loopback UDP port with what answer
// makes of it (nil: nothing), until the test ends, and returns its
// address.
func udpServer(t *testing.T, answer func([]byte) []byte) *net.UDPAddr {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if msg := answer(buf[:n]); msg != nil {
				pc.WriteTo(msg, from)
			}
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr)
}

// startDNS serves A records for names on a loopback UDP port.
func startDNS(t *testing.T, names map[string]string) string {
	t.Helper()
	return udpServer(t, func(query []byte) []byte {
		var p dnsmessage.Parser
		h, err := p.Start(query)
		if err != nil {
			return nil
		}
		q, err := p.Question()
		if err != nil {
			return nil
		}
		rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true}
		ip, ok := names[strings.ToLower(q.Name.String())]
		if !ok {
			rh.RCode = dnsmessage.RCodeNameError
		}
		b := dnsmessage.NewBuilder(nil, rh)
		b.StartQuestions()
		b.Question(q)
		b.StartAnswers()
		if ok && q.Type == dnsmessage.TypeA {
			b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60},
				dnsmessage.AResource{A: netip.MustParseAddr(ip).As4()})
		}
		msg, _ := b.Finish()
		return msg
	}).String()
}

// netSandbox starts a sandbox with the given network setup.
func netSandbox(t *testing.T, ctx context.Context, setup func(*sandbox.Builder)) *sandbox.Sandbox {
	t.Helper()
	b := sandbox.New().Memory(256).Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio"))
	setup(b)
	sb, err := b.Run("sleep", "100000").Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

// fetch runs wget in the guest and returns the page, or the error output.
func fetch(t *testing.T, ctx context.Context, sb *sandbox.Sandbox, url string) (string, bool) {
	t.Helper()
	r, err := sb.Exec(ctx, sandbox.ExecOptions{Shell: "rm -f /tmp/page; wget -O /tmp/page " + url + " && cat /tmp/page", Timeout: 90 * time.Second})
	if err != nil {
		t.Fatalf("exec wget: %v", err)
	}
	if r.Code != 0 {
		return string(r.Stdout) + string(r.Stderr), false
	}
	return string(r.Stdout), true
}

func TestNetworkPolicies(t *testing.T) {
	artifact(t, "vmlinux")
	w := setupNetWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	loop := fmt.Sprintf("http://10.0.2.2:%d/", w.loopPort) // the gateway stands for the host

	policy, err := netstack.ParsePolicy("public-only", nil, []string{"blocked.example.test"})
	if err != nil {
		t.Fatal(err)
	}
	pub := netSandbox(t, ctx, func(b *sandbox.Builder) { b.Network(policy).DNSServer(w.dns) })
	if page, ok := fetch(t, ctx, pub, "http://public.example.test/"); !ok || page != "public page\n" {
		t.Errorf("public-only: the public server by name (DNS over UDP, then TCP): ok=%v %q", ok, page)
	}
	if out, ok := fetch(t, ctx, pub, "http://"+publicIP+"/"); !ok || out != "public page\n" {
		t.Errorf("public-only: the public server by address: ok=%v %q", ok, out)
	}
	if out, ok := fetch(t, ctx, pub, loop); ok || strings.Contains(out, "loopback secret") {
		t.Errorf("public-only reached the host's loopback: %q", out)
	}
	rebind := fmt.Sprintf("http://rebind.example.test:%d/", w.loopPort)
	if out, ok := fetch(t, ctx, pub, rebind); ok || strings.Contains(out, "loopback secret") {
		t.Errorf("public-only reached loopback through a name resolving to 127.0.0.1: %q", out)
	}
	if out, ok := fetch(t, ctx, pub, "http://blocked.example.test/"); ok || !strings.Contains(out, "no such host") {
		t.Errorf("a blocked domain: ok=%v %q, want a DNS failure", ok, out)
	}
	if r, err := pub.Exec(ctx, sandbox.Shell("cat /etc/resolv.conf; ls /sys/class/net")); err != nil {
		t.Errorf("guest network setup: %v", err)
	} else if !strings.Contains(string(r.Stdout), "nameserver 10.0.2.3") || !strings.Contains(string(r.Stdout), "eth0") {
		t.Errorf("guest network setup: %q", r.Stdout)
	}

	all := netSandbox(t, ctx, func(b *sandbox.Builder) { b.Network(netstack.AllowAll()) })
	if out, ok := fetch(t, ctx, all, loop); !ok || out != "loopback secret\n" {
		t.Errorf("allow-all: the host's loopback: ok=%v %q", ok, out)
	}

	none := netSandbox(t, ctx, func(*sandbox.Builder) {})
	if r, err := none.Exec(ctx, sandbox.Shell("ls /sys/class/net")); err != nil {
		t.Errorf("no network: %v", err)
	} else if f := strings.Fields(string(r.Stdout)); len(f) != 1 || f[0] != "lo" {
		t.Errorf("no network: interfaces %q; want only lo", r.Stdout)
	}
}

func TestPublishedPort(t *testing.T) {
	artifact(t, "vmlinux")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sb := netSandbox(t, ctx, func(b *sandbox.Builder) { b.Network(nil).Publish("0:8080") })
	copySelf(t, ctx, sb, "/tmp/server")
	p, err := sb.Stream(ctx, sandbox.ExecOptions{
		Argv: []string{"/tmp/server"},
		Env:  []string{serveEnv + "=:8080", "CAPSA_E2E_SERVE_BODY=served from the guest\n"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Signal(context.Background(), "SIGKILL")
	pubs := sb.Published()
	if len(pubs) != 1 || !strings.HasPrefix(pubs[0].Addr.String(), "127.0.0.1:") {
		t.Fatalf("published %v, want one port on 127.0.0.1", pubs)
	}
	waitHTTP(t, "http://"+pubs[0].Addr.String()+"/", "served from the guest\n")
}
