package netstack

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
)

func httpClient(g *guest) *http.Client {
	return &http.Client{
		Transport: &http.Transport{DialContext: g.dialContext, DisableKeepAlives: true},
		Timeout:   10 * time.Second,
	}
}

func loopbackPort(t testing.TB, addr net.Addr) int {
	t.Helper()
	ap, err := netip.ParseAddrPort(addr.String())
	if err != nil {
		t.Fatal(err)
	}
	return int(ap.Port())
}

func TestHTTPThroughNATAllowAll(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s from the host", r.URL.Path)
	}))
	defer srv.Close()
	g := newTestNAT(t, Config{Policy: AllowAll()})

	url := fmt.Sprintf("http://%s/guest", gatewayPort(g, loopbackPort(t, srv.Listener.Addr())))
	resp, err := httpClient(g).Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(body), "hello /guest from the host"; got != want {
		t.Fatalf("body = %q, want %q", got, want)
	}
	if st := g.nat.Stats(); st.TCPForward != 1 {
		t.Errorf("TCPForward = %d, want 1", st.TCPForward)
	}
}

// A refused connection must fail fast with RST, not time out.
func expectRefused(t *testing.T, g *guest, ap netip.AddrPort) {
	t.Helper()
	ctx := testCtx(t, 5*time.Second)
	start := time.Now()
	c, err := g.dialTCP(ctx, ap)
	if err == nil {
		c.Close()
		t.Fatalf("dial %s from guest succeeded, want refusal", ap)
	}
	if ctx.Err() != nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("dial %s: %v after %v, want prompt connection refused", ap, err, time.Since(start))
	}
}

func TestPublicOnlyRefusesLoopbackAndPrivate(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer srv.Close()
	dial := &countingDial{}
	g := newTestNAT(t, Config{Dial: dial.Dial}) // nil Policy = public-only

	expectRefused(t, g, gatewayPort(g, loopbackPort(t, srv.Listener.Addr()))) // host loopback
	for _, dst := range []string{"10.1.2.3:80", "192.168.1.1:443", "172.16.0.1:22", "100.64.0.1:80", "169.254.169.254:80"} {
		expectRefused(t, g, netip.MustParseAddrPort(dst))
	}
	if n := dial.n.Load(); n != 0 {
		t.Errorf("%d host dials for refused connections, want 0", n)
	}
	if st := g.nat.Stats(); st.TCPRefused < 6 {
		t.Errorf("TCPRefused = %d, want >= 6", st.TCPRefused)
	}

	// The same HTTP fetch as the allow-all test fails.
	if _, err := httpClient(g).Get(fmt.Sprintf("http://%s/", gatewayPort(g, loopbackPort(t, srv.Listener.Addr())))); err == nil {
		t.Fatal("GET through public-only NAT to host loopback succeeded")
	}
}

func TestExplicitAllowOpensLoopbackPort(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	defer srv.Close()
	port := loopbackPort(t, srv.Listener.Addr())
	pol, err := ParsePolicy("public-only", []string{fmt.Sprintf("tcp/127.0.0.1:%d", port)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := newTestNAT(t, Config{Policy: pol})
	resp, err := httpClient(g).Get(fmt.Sprintf("http://%s/", gatewayPort(g, port)))
	if err != nil {
		t.Fatalf("GET allowed port: %v", err)
	}
	resp.Body.Close()
	expectRefused(t, g, gatewayPort(g, port+1))
}

// TestSetPolicy: a policy set while the NAT runs decides every new flow
// from then on, both ways: a port it opens is reached, and one it closes
// again is refused, while a connection the old policy let through goes
// on.
func TestSetPolicy(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	defer srv.Close()
	port := loopbackPort(t, srv.Listener.Addr())
	g := newTestNAT(t, Config{}) // public-only
	url := fmt.Sprintf("http://%s/", gatewayPort(g, port))
	if _, err := httpClient(g).Get(url); err == nil {
		t.Fatal("GET the host's loopback under public-only succeeded")
	}
	open, err := ParsePolicy("public-only", []string{fmt.Sprintf("tcp/127.0.0.1:%d", port)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	g.nat.SetPolicy(open)
	if g.nat.Policy() != open {
		t.Errorf("Policy() = %v; want the policy set", g.nat.Policy())
	}
	resp, err := httpClient(g).Get(url)
	if err != nil {
		t.Fatalf("GET the port the new policy opens: %v", err)
	}
	resp.Body.Close()
	conn, err := g.dialContext(context.Background(), "tcp", gatewayPort(g, port).String())
	if err != nil {
		t.Fatalf("a connection under the new policy: %v", err)
	}
	defer conn.Close()
	g.nat.SetPolicy(nil)
	if g.nat.Policy().String() != PublicOnly().String() {
		t.Errorf("SetPolicy(nil) put %v in force; want public-only", g.nat.Policy())
	}
	expectRefused(t, g, gatewayPort(g, port))
	// The connection made under the old policy goes on.
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, "GET / HTTP/1.0\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(conn); err != nil || !strings.HasSuffix(string(b), "ok") {
		t.Errorf("the connection opened before the change: %q, %v; want the answer", b, err)
	}
}

func TestDialFailureResets(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := loopbackPort(t, l.Addr())
	l.Close() // nothing listens there now
	g := newTestNAT(t, Config{Policy: AllowAll()})
	expectRefused(t, g, gatewayPort(g, port))
}

func TestTCPHalfClose(t *testing.T) {
	// The host server reads the whole request (until the guest's FIN), then
	// answers with its length and closes.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b, _ := io.ReadAll(c)
		fmt.Fprintf(c, "got %d bytes", len(b))
	}()
	g := newTestNAT(t, Config{Policy: AllowAll()})
	c, err := g.dialTCP(testCtx(t, 10*time.Second), gatewayPort(g, loopbackPort(t, l.Addr())))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	payload := bytes.Repeat([]byte("x"), 200_000)
	if _, err := c.Write(payload); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if want := "got 200000 bytes"; string(got) != want {
		t.Fatalf("reply = %q, want %q", got, want)
	}
}

func TestDNS(t *testing.T) {
	dns := startFakeDNS(t, map[string][]string{
		"public.test":        {"93.184.216.34", "2606:2800:220:1::1"},
		"rebind.test":        {"10.1.2.3"},
		"local.test":         {"127.0.0.1"},
		"mixed.test":         {"10.1.2.3", "93.184.216.34"},
		"blocked.test":       {"93.184.216.35"},
		"deep.blocked2.test": {"93.184.216.36"},
	})
	pol, err := ParsePolicy("public-only",
		[]string{"rebind.test"}, // a domain allow never opens a private address
		[]string{"blocked.test", "*.blocked2.test"})
	if err != nil {
		t.Fatal(err)
	}
	dial := &countingDial{}
	g := newTestNAT(t, Config{Policy: pol, Resolver: dns.resolver(), Dial: dial.Dial})
	dnsAddr := netip.AddrPortFrom(g.nat.Addrs().DNS, 53)
	ctx := testCtx(t, 20*time.Second)

	lookup := func(r *net.Resolver, name string) ([]netip.Addr, error) {
		return r.LookupNetIP(ctx, "ip4", name+".")
	}
	for _, tc := range []struct {
		name   string
		server netip.AddrPort
		tcp    bool
	}{
		{"udp", dnsAddr, false},
		{"tcp", dnsAddr, true},
		// Plain DNS to any other server is intercepted and answered by the
		// NAT (the fake upstream is only reachable as Config.Resolver).
		{"intercepted", netip.MustParseAddrPort("8.8.8.8:53"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := g.resolver(tc.server, tc.tcp)
			ips, err := lookup(r, "public.test")
			if err != nil {
				t.Fatalf("lookup public.test: %v", err)
			}
			if len(ips) != 1 || ips[0] != netip.MustParseAddr("93.184.216.34") {
				t.Fatalf("public.test = %v, want [93.184.216.34]", ips)
			}
			// AAAA: the guest network is IPv4 only, so no data.
			if ips, err := r.LookupNetIP(ctx, "ip6", "public.test."); err == nil && len(ips) > 0 {
				t.Errorf("AAAA public.test = %v, want none", ips)
			}
			// Unknown name: NXDOMAIN passes through.
			var de *net.DNSError
			if _, err := lookup(r, "nonexistent.test"); !errors.As(err, &de) || !de.IsNotFound {
				t.Errorf("lookup nonexistent.test: %v, want not found", err)
			}
			// Blocked names: NXDOMAIN without asking upstream.
			for _, name := range []string{"blocked.test", "deep.blocked2.test"} {
				if _, err := lookup(r, name); !errors.As(err, &de) || !de.IsNotFound {
					t.Errorf("lookup %s: %v, want NXDOMAIN", name, err)
				}
				if n := dns.count(name); n != 0 {
					t.Errorf("%s reached upstream %d times, want 0", name, n)
				}
			}
			// DNS rebinding: private and loopback answers are dropped.
			for _, name := range []string{"rebind.test", "local.test"} {
				if ips, err := lookup(r, name); err == nil && len(ips) > 0 {
					t.Errorf("lookup %s = %v, want no addresses under public-only", name, ips)
				}
			}
			if ips, err := lookup(r, "mixed.test"); err != nil || len(ips) != 1 || ips[0] != netip.MustParseAddr("93.184.216.34") {
				t.Errorf("lookup mixed.test = %v, %v; want only the public address", ips, err)
			}
		})
	}
	// Connect-time: even though "rebind.test" is allowed by name and the
	// guest knows its address, 10.1.2.3 is refused.
	expectRefused(t, g, netip.MustParseAddrPort("10.1.2.3:80"))
	if n := dial.n.Load(); n != 0 {
		t.Errorf("%d host dials, want 0 (8.8.8.8:53 must be intercepted)", n)
	}
	if st := g.nat.Stats(); st.DNSRefused == 0 || st.DNSQueries == 0 {
		t.Errorf("stats %+v: want DNS queries and refusals counted", st)
	}
}

func TestDNSAllowedPrivateCIDR(t *testing.T) {
	dns := startFakeDNS(t, map[string][]string{"db.internal.test": {"10.1.2.3"}})
	pol, err := ParsePolicy("public-only", []string{"10.1.2.0/24:5432"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := newTestNAT(t, Config{Policy: pol, Resolver: dns.resolver()})
	ips, err := g.resolver(netip.AddrPortFrom(g.nat.Addrs().DNS, 53), false).LookupNetIP(testCtx(t, 10*time.Second), "ip4", "db.internal.test.")
	if err != nil || len(ips) != 1 || ips[0] != netip.MustParseAddr("10.1.2.3") {
		t.Fatalf("lookup = %v, %v; want [10.1.2.3] (opened by CIDR allow rule)", ips, err)
	}
}

func TestDenyAllDomainAllow(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	defer srv.Close()
	port := loopbackPort(t, srv.Listener.Addr())
	dns := startFakeDNS(t, map[string][]string{"ok.test": {"93.184.216.34"}, "other.test": {"93.184.216.35"}})
	pol, err := ParsePolicy("deny-all", []string{fmt.Sprintf("*.ok.test:%d", port), "ok.test"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The host dialer redirects the public test address to the loopback
	// server, standing in for the internet.
	var d net.Dialer
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		if strings.HasPrefix(addr, "93.184.216.34:") {
			return d.DialContext(ctx, network, srv.Listener.Addr().String())
		}
		return nil, errors.New("no internet in tests")
	}
	g := newTestNAT(t, Config{Policy: pol, Resolver: dns.resolver(), Dial: dial})
	r := g.resolver(netip.AddrPortFrom(g.nat.Addrs().DNS, 53), false)
	ctx := testCtx(t, 10*time.Second)

	expectRefused(t, g, netip.MustParseAddrPort(fmt.Sprintf("93.184.216.34:%d", port))) // not resolved yet
	if _, err := r.LookupNetIP(ctx, "ip4", "other.test."); err == nil {
		t.Fatal("deny-all resolved a name no rule allows")
	}
	if n := dns.count("other.test"); n != 0 {
		t.Errorf("other.test reached upstream %d times under deny-all, want 0", n)
	}
	ips, err := r.LookupNetIP(ctx, "ip4", "ok.test.")
	if err != nil || len(ips) != 1 {
		t.Fatalf("lookup ok.test = %v, %v", ips, err)
	}
	resp, err := httpClient(g).Get(fmt.Sprintf("http://%s/", netip.AddrPortFrom(ips[0], uint16(port))))
	if err != nil {
		t.Fatalf("GET ok.test after resolving: %v", err)
	}
	resp.Body.Close()
}

func startUDPEcho(t testing.TB) net.PacketConn {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		buf := make([]byte, 65535)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(append([]byte("echo:"), buf[:n]...), from)
		}
	}()
	t.Cleanup(func() { pc.Close() })
	return pc
}

func TestUDPRoundTrip(t *testing.T) {
	echo := startUDPEcho(t)
	g := newTestNAT(t, Config{Policy: AllowAll()})
	c, err := g.dialUDP(gatewayPort(g, loopbackPort(t, echo.LocalAddr())))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 70000)
	for i, msg := range []string{"ping", "pong", strings.Repeat("big", 3000)} { // the last is fragmented
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("datagram %d: %v", i, err)
		}
		if got := string(buf[:n]); got != "echo:"+msg {
			t.Fatalf("datagram %d: got %d bytes %.20q, want echo of %d bytes", i, n, got, len(msg))
		}
	}
	if st := g.nat.Stats(); st.UDPForward != 1 || st.UDPActive != 1 {
		t.Errorf("UDPForward = %d, UDPActive = %d; want one flow", st.UDPForward, st.UDPActive)
	}
}

func TestUDPRefusedUnderPublicOnly(t *testing.T) {
	echo := startUDPEcho(t)
	g := newTestNAT(t, Config{})
	c, err := g.dialUDP(gatewayPort(g, loopbackPort(t, echo.LocalAddr())))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("ping"))
	// The refusal surfaces as ICMP port unreachable (gonet does not report
	// it from Read, so look at the guest stack's counters).
	unreach := g.st.Stats().ICMP.V4.PacketsReceived.DstUnreachable
	deadline := time.Now().Add(5 * time.Second)
	for unreach.Value() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("guest got no ICMP destination unreachable for a refused UDP flow")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if st := g.nat.Stats(); st.UDPRefused != 1 || st.UDPActive != 0 {
		t.Errorf("UDPRefused = %d, UDPActive = %d; want 1, 0", st.UDPRefused, st.UDPActive)
	}
}

func TestUDPIdleTimeout(t *testing.T) {
	echo := startUDPEcho(t)
	g := newTestNAT(t, Config{Policy: AllowAll(), UDPIdleTimeout: 100 * time.Millisecond})
	c, err := g.dialUDP(gatewayPort(g, loopbackPort(t, echo.LocalAddr())))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("ping"))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for g.nat.Stats().UDPActive != 0 {
		if time.Now().After(deadline) {
			t.Fatal("UDP flow not reclaimed after idle timeout")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestPublishTCP(t *testing.T) {
	pub, err := ParsePublish("127.0.0.1:0:8080")
	if err != nil {
		t.Fatal(err)
	}
	g := newTestNAT(t, Config{Publish: []PortMapping{pub}})
	// A server inside the guest.
	l, err := gonetListen(g, 8080)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	peers := make(chan string, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		peers <- c.RemoteAddr().String()
		b, _ := io.ReadAll(c)
		c.Write(append([]byte("guest got: "), b...))
	}()

	published := g.nat.Published()
	if len(published) != 1 {
		t.Fatalf("Published() = %v", published)
	}
	c, err := net.DialTimeout("tcp", published[0].Addr.String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("hello guest"))
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "guest got: hello guest" {
		t.Fatalf("reply = %q", got)
	}
	if peer := <-peers; !strings.HasPrefix(peer, g.nat.Addrs().Gateway.String()+":") {
		t.Errorf("guest saw peer %s, want the gateway address", peer)
	}
}

func TestPublishTCPNoGuestListener(t *testing.T) {
	pub, _ := ParsePublish("0:9999")
	g := newTestNAT(t, Config{Publish: []PortMapping{pub}})
	c, err := net.DialTimeout("tcp", g.nat.Published()[0].Addr.String(), 5*time.Second)
	if err != nil {
		return // reset before connect returned: fine
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("read %d bytes from a published port nobody listens on", n)
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("published connection to a closed guest port was not closed")
	}
}

func TestPublishUDP(t *testing.T) {
	pub, err := ParsePublish("0:5353/udp")
	if err != nil {
		t.Fatal(err)
	}
	g := newTestNAT(t, Config{Publish: []PortMapping{pub}})
	gc, err := gonetListenUDP(g, 5353)
	if err != nil {
		t.Fatal(err)
	}
	defer gc.Close()
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := gc.ReadFrom(buf)
			if err != nil {
				return
			}
			gc.WriteTo(append([]byte("guest:"), buf[:n]...), from)
		}
	}()
	c, err := net.Dial("udp", g.nat.Published()[0].Addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 1500)
	for _, msg := range []string{"one", "two"} {
		c.Write([]byte(msg))
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := c.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		if got := string(buf[:n]); got != "guest:"+msg {
			t.Fatalf("got %q", got)
		}
	}
}

func TestPublishPortInUse(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	m := PortMapping{HostIP: netip.MustParseAddr("127.0.0.1"), HostPort: uint16(loopbackPort(t, l.Addr())), GuestPort: 80}
	s, err := New(context.Background(), Config{Publish: []PortMapping{m}})
	if err == nil {
		s.Close()
		t.Fatal("New succeeded publishing a port in use")
	}
	if !strings.Contains(err.Error(), "publish") {
		t.Errorf("error %q does not name the mapping", err)
	}
}

func TestCloseAndAddrs(t *testing.T) {
	s, err := New(context.Background(), Config{})
	if err != nil {
		t.Fatal(err)
	}
	a := s.Addrs()
	if a.GuestIP.String() != "10.0.2.15/24" || a.Gateway.String() != "10.0.2.2" || a.DNS.String() != "10.0.2.3" || a.MTU != 1500 {
		t.Errorf("Addrs() = %+v", a)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := s.DeliverFrame(make([]byte, 60)); !errors.Is(err, ErrClosed) {
		t.Errorf("DeliverFrame after Close = %v, want ErrClosed", err)
	}
	if _, err := s.ReadFrame(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("ReadFrame after Close = %v, want ErrClosed", err)
	}
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"ipv6 subnet", Config{Subnet: netip.MustParsePrefix("fd00::/64")}, "only IPv4"},
		{"gateway outside", Config{Gateway: netip.MustParseAddr("192.168.0.1")}, "gateway 192.168.0.1"},
		{"guest is gateway", Config{GuestIP: netip.MustParseAddr("10.0.2.2")}, "collides"},
		{"tiny mtu", Config{MTU: 100}, "MTU 100"},
		{"bad mac", Config{GuestMAC: net.HardwareAddr{1, 2, 3}}, "guest MAC"},
		{"publish guest port 0", Config{Publish: []PortMapping{{HostPort: 1}}}, "guest port 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := New(context.Background(), tc.cfg)
			if err == nil {
				s.Close()
				t.Fatal("New succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
		})
	}
	// A custom subnet derives the stack's addresses.
	s, err := New(context.Background(), Config{Subnet: netip.MustParsePrefix("192.168.77.0/24")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if a := s.Addrs(); a.Gateway.String() != "192.168.77.2" || a.DNS.String() != "192.168.77.3" || a.GuestIP.String() != "192.168.77.15/24" {
		t.Errorf("Addrs() = %+v", a)
	}
}

// After Close every goroutine the NAT started is gone, including those of
// forwarded connections still open at Close.
func TestCloseReleasesGoroutines(t *testing.T) {
	l := hostServer(t, func(c net.Conn) { io.Copy(io.Discard, c); c.Close() })
	echo := startUDPEcho(t)
	runtime.GC()
	before := runtime.NumGoroutine()
	t.Run("session", func(t *testing.T) {
		pub, _ := ParsePublish("0:80")
		g := newTestNAT(t, Config{Policy: AllowAll(), Publish: []PortMapping{pub}})
		for range 3 {
			c, err := g.dialTCP(testCtx(t, 5*time.Second), gatewayPort(g, loopbackPort(t, l.Addr())))
			if err != nil {
				t.Fatal(err)
			}
			c.Write([]byte("left open"))
		}
		u, err := g.dialUDP(gatewayPort(g, loopbackPort(t, echo.LocalAddr())))
		if err != nil {
			t.Fatal(err)
		}
		u.Write([]byte("x"))
		u.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := u.Read(make([]byte, 10)); err != nil {
			t.Fatal(err)
		}
	})
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= before {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines after Close, %d before:\n%s", n, before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An answer too big for a 512-byte UDP reply is truncated, and the guest's
// resolver retries over TCP.
func TestDNSTruncatedRetriesOverTCP(t *testing.T) {
	label := strings.Repeat("x", 60)
	name := label + "." + label + "." + label + "." + label + ".test" // 248 bytes
	var ips []string
	for i := range 20 {
		ips = append(ips, fmt.Sprintf("93.184.216.%d", i+1))
	}
	dns := startFakeDNS(t, map[string][]string{name: ips})
	g := newTestNAT(t, Config{Resolver: dns.resolver()})
	got, err := g.resolver(netip.AddrPortFrom(g.nat.Addrs().DNS, 53), false).LookupNetIP(testCtx(t, 10*time.Second), "ip4", name+".")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != dnsMaxAnswers {
		t.Fatalf("got %d addresses, want %d", len(got), dnsMaxAnswers)
	}
}

// TestTCPBuffersAreBounded: the NAT's TCP endpoints get Config.TCPBuffer
// as their buffers' ceiling, not gVisor's 4 MiB default.
func TestTCPBuffersAreBounded(t *testing.T) {
	for _, tc := range []struct{ set, want int }{{0, DefaultTCPBuffer}, {100 << 10, 100 << 10}, {1, 16 << 10}} {
		g := newTestNAT(t, Config{TCPBuffer: tc.set})
		var snd tcpip.TCPSendBufferSizeRangeOption
		var rcv tcpip.TCPReceiveBufferSizeRangeOption
		if err := g.nat.stack.TransportProtocolOption(tcp.ProtocolNumber, &snd); err != nil {
			t.Fatal(err)
		}
		if err := g.nat.stack.TransportProtocolOption(tcp.ProtocolNumber, &rcv); err != nil {
			t.Fatal(err)
		}
		if snd.Max != tc.want || rcv.Max != tc.want {
			t.Errorf("TCPBuffer %d: send max %d, receive max %d; want %d", tc.set, snd.Max, rcv.Max, tc.want)
		}
	}
}

// TestPortReuseAfterServerClose: a guest connection that the server closes
// first (as an HTTP server answering Connection: close does) leaves the
// guest's port free at once, since the guest closed second; a new
// connection from that port must get through. The NAT's side of the old
// connection held the 4-tuple in TIME_WAIT for 60 s and dropped the new
// SYN without an answer, so the guest's request hung (about one in a
// thousand new connections under load, as the guest reused ports).
func TestPortReuseAfterServerClose(t *testing.T) {
	l := hostServer(t, func(c net.Conn) { c.Write([]byte("bye")); c.Close() })
	g := newTestNAT(t, Config{Policy: AllowAll()})
	server := g.fullAddr(gatewayPort(g, loopbackPort(t, l.Addr())))
	local := tcpip.FullAddress{NIC: 1, Addr: toTCPIP(g.nat.Addrs().GuestIP.Addr()), Port: 40000}
	for i := range 3 {
		ctx := testCtx(t, 5*time.Second)
		c, err := gonet.DialTCPWithBind(ctx, g.st, local, server, ipv4.ProtocolNumber)
		if err != nil {
			t.Fatalf("connection %d from guest port %d: %v (the NAT kept the last one's 4-tuple)", i, local.Port, err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if got, err := io.ReadAll(c); err != nil || string(got) != "bye" {
			t.Fatalf("connection %d read %q, %v; want \"bye\"", i, got, err)
		}
		c.Close()
		// The guest's close (its FIN after the server's) is acknowledged
		// before the next SYN, as a guest kernel's would be.
		time.Sleep(100 * time.Millisecond)
	}
}
