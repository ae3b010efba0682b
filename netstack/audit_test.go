package netstack

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// flowLog collects a Stack's audit records (Config.Audit).
type flowLog struct {
	mu    sync.Mutex
	flows []Flow
}

func (l *flowLog) add(f Flow) {
	l.mu.Lock()
	l.flows = append(l.flows, f)
	l.mu.Unlock()
}

// wait returns the first record match accepts, waiting up to 5 s for it.
func (l *flowLog) wait(t *testing.T, what string, match func(Flow) bool) Flow {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		l.mu.Lock()
		i := slices.IndexFunc(l.flows, match)
		var f Flow
		if i >= 0 {
			f = l.flows[i]
		}
		all := slices.Clone(l.flows)
		l.mu.Unlock()
		if i >= 0 {
			return f
		}
		if time.Now().After(deadline) {
			t.Fatalf("no audit record of %s in:\n%s", what, flowLines(all))
		}
	}
}

func flowLines(fs []Flow) string {
	var b strings.Builder
	for _, f := range fs {
		fmt.Fprintf(&b, "%+v\n", f)
	}
	return b.String()
}

func (l *flowLog) count(match func(Flow) bool) (n int, suppressed uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, f := range l.flows {
		if match(f) {
			n++
		}
		suppressed += f.Suppressed
	}
	return n, suppressed
}

func countFor(counts []FlowCount, kind string, allowed bool, rule string) uint64 {
	for _, c := range counts {
		if c.Kind == kind && c.Allowed == allowed && c.Rule == rule {
			return c.Count
		}
	}
	return 0
}

// TestAuditTCP: an allowed connection is logged when it opens and when it
// closes, with the rule that allowed it and the bytes each way; a refused
// one with the rule that refused it; a connection to a port nobody
// listens on as failed. FlowCounts sums them by rule.
func TestAuditTCP(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, strings.Repeat("x", 1000))
	}))
	defer srv.Close()
	port := loopbackPort(t, srv.Listener.Addr())
	allow := fmt.Sprintf("tcp/127.0.0.1:%d", port)
	pol, err := ParsePolicy("public-only", []string{allow, "tcp/127.0.0.1:1"}, []string{"tcp/127.0.0.1:2"})
	if err != nil {
		t.Fatal(err)
	}
	var log flowLog
	g := newTestNAT(t, Config{Policy: pol, Audit: log.add})

	resp, err := httpClient(g).Get(fmt.Sprintf("http://%s/", gatewayPort(g, port)))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if len(body) != 1000 {
		t.Fatalf("body of %d bytes", len(body))
	}
	dst := gatewayPort(g, port).String()
	wantRule := `allow "` + allow + `"`
	open := log.wait(t, "the open", func(f Flow) bool { return f.Kind == "tcp" && f.Event == "open" && f.Dst == dst })
	if open.Rule != wantRule || open.Host != fmt.Sprintf("127.0.0.1:%d", port) || !strings.HasPrefix(open.Src, "10.0.2.15:") {
		t.Errorf("open = %+v; want rule %s, host 127.0.0.1:%d, the guest's source", open, wantRule, port)
	}
	closed := log.wait(t, "the close", func(f Flow) bool { return f.Kind == "tcp" && f.Event == "close" && f.Dst == dst })
	if closed.Src != open.Src || closed.Rule != wantRule || closed.BytesIn < 1000 || closed.BytesOut < 20 || closed.Time.Before(open.Time) {
		t.Errorf("close = %+v; want the open's source and rule, at least 1000 bytes in and the request out", closed)
	}

	expectRefused(t, g, gatewayPort(g, 2))
	refused := log.wait(t, "the refusal", func(f Flow) bool { return f.Kind == "tcp" && f.Event == "refused" })
	if refused.Rule != `deny "tcp/127.0.0.1:2"` || refused.Dst != gatewayPort(g, 2).String() || refused.Reason == "" {
		t.Errorf("refused = %+v; want the deny rule", refused)
	}
	expectRefused(t, g, gatewayPort(g, 3))
	byMode := log.wait(t, "the refusal by mode", func(f Flow) bool { return f.Kind == "tcp" && f.Event == "refused" && f.Rule == "public-only" })
	if !strings.Contains(byMode.Reason, "loopback") {
		t.Errorf("refused by the mode: %+v; want it to say loopback", byMode)
	}
	expectRefused(t, g, gatewayPort(g, 1)) // allowed, nobody listens
	failed := log.wait(t, "the failure", func(f Flow) bool { return f.Kind == "tcp" && f.Event == "failed" })
	if failed.Rule != `allow "tcp/127.0.0.1:1"` || failed.Error == "" {
		t.Errorf("failed = %+v; want its rule and the dial's error", failed)
	}

	counts := g.nat.FlowCounts()
	if countFor(counts, "tcp", true, wantRule) != 1 || countFor(counts, "tcp", false, `deny "tcp/127.0.0.1:2"`) != 1 ||
		countFor(counts, "tcp", false, "public-only") != 1 || countFor(counts, "tcp", true, `allow "tcp/127.0.0.1:1"`) != 1 {
		t.Errorf("FlowCounts = %+v", counts)
	}
}

// TestAuditDNSAndUDP: DNS queries are logged with their answers (and what
// the policy left out of them) or their refusal; a UDP flow when it opens
// and, once idle, when it closes, with its bytes.
func TestAuditDNSAndUDP(t *testing.T) {
	dns := startFakeDNS(t, map[string][]string{
		"public.test": {"93.184.216.34"},
		"mixed.test":  {"10.1.2.3", "93.184.216.35"},
		"denied.test": {"93.184.216.36"},
	})
	echo := startUDPEcho(t)
	port := loopbackPort(t, echo.LocalAddr())
	pol, err := ParsePolicy("public-only", []string{fmt.Sprintf("udp/127.0.0.1:%d", port)}, []string{"denied.test"})
	if err != nil {
		t.Fatal(err)
	}
	var log flowLog
	g := newTestNAT(t, Config{Policy: pol, Resolver: dns.resolver(), Audit: log.add, UDPIdleTimeout: 200 * time.Millisecond})
	ctx := testCtx(t, 20*time.Second)
	r := g.resolver(netip.AddrPortFrom(g.nat.Addrs().DNS, 53), false)
	if _, err := r.LookupNetIP(ctx, "ip4", "public.test."); err != nil {
		t.Fatal(err)
	}
	a := log.wait(t, "public.test", func(f Flow) bool { return f.Kind == "dns" && f.Name == "public.test" })
	if a.Event != "answer" || a.QType != "A" || a.RCode != "Success" || !slices.Equal(a.Answers, []string{"93.184.216.34"}) ||
		a.Rule != "public-only" || !strings.HasPrefix(a.Src, "10.0.2.15:") || a.Dst != "10.0.2.3:53" {
		t.Errorf("the answer for public.test: %+v", a)
	}
	r.LookupNetIP(ctx, "ip4", "mixed.test.")
	m := log.wait(t, "mixed.test", func(f Flow) bool { return f.Kind == "dns" && f.Name == "mixed.test" })
	if !slices.Equal(m.Answers, []string{"93.184.216.35"}) || !strings.Contains(m.Reason, "1 address") {
		t.Errorf("the answer for mixed.test: %+v; want the public address only, and the other's leaving out said", m)
	}
	if _, err := r.LookupNetIP(ctx, "ip4", "denied.test."); err == nil {
		t.Error("denied.test resolved")
	}
	d := log.wait(t, "denied.test", func(f Flow) bool { return f.Kind == "dns" && f.Name == "denied.test" })
	if d.Event != "refused" || d.Rule != `deny "denied.test"` || d.RCode != "NameError" {
		t.Errorf("the refusal of denied.test: %+v", d)
	}

	c, err := g.dialUDP(gatewayPort(g, port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("ping"))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	dst := gatewayPort(g, port).String()
	log.wait(t, "the UDP flow's open", func(f Flow) bool { return f.Kind == "udp" && f.Event == "open" && f.Dst == dst })
	closed := log.wait(t, "the UDP flow's close", func(f Flow) bool { return f.Kind == "udp" && f.Event == "close" && f.Dst == dst })
	if closed.BytesOut != 4 || closed.BytesIn != int64(len("echo:ping")) || closed.Rule != fmt.Sprintf(`allow "udp/127.0.0.1:%d"`, port) {
		t.Errorf("the UDP flow's close: %+v; want 4 bytes out, 9 in and its rule", closed)
	}
	counts := g.nat.FlowCounts()
	if countFor(counts, "dns", true, "public-only") != 2 || countFor(counts, "dns", false, `deny "denied.test"`) != 1 {
		t.Errorf("FlowCounts = %+v", counts)
	}
}

// TestAuditSummarisesRefusalFloods: however fast a guest opens refused
// connections, each is accounted for, on a line of its own or in a
// summary's count.
func TestAuditSummarisesRefusalFloods(t *testing.T) {
	var log flowLog
	g := newTestNAT(t, Config{Audit: log.add})
	const n = 300
	ctx := testCtx(t, time.Minute)
	for i := range n {
		if c, err := g.dialTCP(ctx, netip.AddrPortFrom(netip.MustParseAddr("10.9.9.9"), uint16(1000+i))); err == nil {
			c.Close()
			t.Fatal("a private address was reached under public-only")
		}
	}
	refused := func(f Flow) bool { return f.Kind == "tcp" && f.Event == "refused" }
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		lines, suppressed := log.count(refused)
		if lines+int(suppressed) == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d refusal lines and %d summarised; want %d in all", lines, suppressed, n)
		}
	}
	if c := countFor(g.nat.FlowCounts(), "tcp", false, "public-only"); c != n {
		t.Errorf("FlowCounts counts %d refusals, want %d", c, n)
	}
}

// TestAuditCountsWithoutLog: with no Config.Audit the counts are kept all
// the same.
func TestAuditCountsWithoutLog(t *testing.T) {
	g := newTestNAT(t, Config{})
	expectRefused(t, g, netip.MustParseAddrPort("10.1.2.3:80"))
	if c := countFor(g.nat.FlowCounts(), "tcp", false, "public-only"); c != 1 {
		t.Errorf("FlowCounts = %+v", g.nat.FlowCounts())
	}
}

// TestAuditorRate: past auditRefusals refusals in a second the rest are
// counted, and the next flush writes one summary with their number;
// allowed flows are never held back.
func TestAuditorRate(t *testing.T) {
	var log flowLog
	a := newAuditor(log.add)
	const n = 300
	for range n {
		a.refused(Flow{Kind: "tcp", Event: "refused"})
		a.log(Flow{Kind: "tcp", Event: "open"})
	}
	a.flush()
	lines, suppressed := log.count(func(f Flow) bool { return f.Event == "refused" && f.Kind == "tcp" })
	opens, _ := log.count(func(f Flow) bool { return f.Event == "open" })
	summaries, _ := log.count(func(f Flow) bool { return f.Kind == "summary" })
	// 300 calls take far less than a second: at most two windows.
	if lines+int(suppressed) != n || lines < auditRefusals || lines > 2*auditRefusals || summaries < 1 || summaries > 2 || opens != n {
		t.Errorf("%d refusal lines, %d summarised in %d summaries, %d opens; want %d refusals in all, %d to %d lines, every open",
			lines, suppressed, summaries, opens, n, auditRefusals, 2*auditRefusals)
	}
	a.flush()
	if again, _ := log.count(func(f Flow) bool { return f.Kind == "summary" }); again != summaries {
		t.Error("a flush with nothing left out wrote a summary")
	}
}

// viaConn is a host connection that says it went through a proxy, as
// package egressproxy's do.
type viaConn struct{ net.Conn }

func (viaConn) Via() string { return "socks5://agent@192.0.2.1:1080" }

// TestAuditVia: a connection Config.Dial made through a proxy is logged
// with the proxy it went through.
func TestAuditVia(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	defer srv.Close()
	port := loopbackPort(t, srv.Listener.Addr())
	pol, err := ParsePolicy("allow-all", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	var log flowLog
	var d net.Dialer
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return viaConn{c}, nil
	}
	g := newTestNAT(t, Config{Policy: pol, Audit: log.add, Dial: dial})
	resp, err := httpClient(g).Get(fmt.Sprintf("http://%s/", gatewayPort(g, port)))
	if err != nil {
		t.Fatal(err)
	}
	io.ReadAll(resp.Body)
	resp.Body.Close()
	dst := gatewayPort(g, port).String()
	for _, ev := range []string{"open", "close"} {
		f := log.wait(t, "the "+ev, func(f Flow) bool { return f.Kind == "tcp" && f.Event == ev && f.Dst == dst })
		if f.Via != "socks5://agent@192.0.2.1:1080" {
			t.Errorf("%s = %+v; want it via the proxy", ev, f)
		}
	}
}
