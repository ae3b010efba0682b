package netstack

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// startTCPEcho echoes every connection on loopback until it half-closes.
func startTCPEcho(t *testing.T) net.Listener {
	t.Helper()
	return hostServer(t, func(c net.Conn) { io.Copy(c, c); c.Close() })
}

// lineInterceptor serves connections whose first byte is 'I' itself: it
// sends "via redial" to the host over a second connection (redial) and
// answers the guest with what the host echoed. Others it hands back with
// that byte.
type lineInterceptor struct{ dsts chan netip.AddrPort }

type prefixed struct {
	net.Conn
	r io.Reader
}

func (p *prefixed) Read(b []byte) (int, error) { return p.r.Read(b) }

func (li *lineInterceptor) Intercept(guest, host net.Conn, dst netip.AddrPort, redial func(context.Context) (net.Conn, error)) net.Conn {
	li.dsts <- dst
	b := make([]byte, 1)
	if n, err := io.ReadFull(guest, b); err != nil || b[0] != 'I' {
		return &prefixed{Conn: guest, r: io.MultiReader(strings.NewReader(string(b[:n])), guest)}
	}
	defer guest.Close()
	defer host.Close()
	c, err := redial(context.Background())
	if err != nil {
		fmt.Fprintf(guest, "redial: %v\n", err)
		return nil
	}
	defer c.Close()
	io.WriteString(c, "via redial\n")
	line, _ := bufio.NewReader(c).ReadString('\n')
	io.WriteString(guest, "intercepted: "+line)
	return nil
}

func TestInterceptor(t *testing.T) {
	echo := startTCPEcho(t)
	li := &lineInterceptor{dsts: make(chan netip.AddrPort, 10)}
	g := newTestNAT(t, Config{Policy: AllowAll(), Intercept: li, MaxConns: 2})
	ap := gatewayPort(g, loopbackPort(t, echo.Addr()))
	ctx := testCtx(t, 30*time.Second)

	talk := func(send string) string {
		t.Helper()
		c, err := g.dialTCP(ctx, ap)
		if err != nil {
			t.Fatalf("dial %s: %v", ap, err)
		}
		defer c.Close()
		io.WriteString(c, send)
		c.CloseWrite()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, _ := io.ReadAll(c)
		if got := <-li.dsts; got != ap {
			t.Errorf("the interceptor got dst %s, want %s", got, ap)
		}
		return string(b)
	}
	if got := talk("relayed as usual"); got != "relayed as usual" {
		t.Errorf("a connection handed back: echo %q, want %q (its first byte replayed)", got, "relayed as usual")
	}
	if got := talk("I"); got != "intercepted: via redial\n" {
		t.Errorf("an intercepted connection answered %q", got)
	}
	// MaxConns 2: the connection and its host side count one, a
	// redial a second; with one more connection open, the redial is
	// refused. The NAT lets the connections above go after they close,
	// not at once: wait for that, or one of them still counts (on a
	// loaded machine) and the limit is reached a connection early.
	waitTCPIdle(t, g)
	hold, err := g.dialTCP(ctx, ap)
	if err != nil {
		t.Fatal(err)
	}
	<-li.dsts
	if got := talk("I"); !strings.Contains(got, "connection limit reached") {
		t.Errorf("a redial past MaxConns answered %q, want the limit", got)
	}
	hold.Close()
	waitTCPIdle(t, g)
}

// waitTCPIdle waits until the NAT holds no TCP connection, for at most
// 10 s.
func waitTCPIdle(t *testing.T, g *guest) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); g.nat.Stats().TCPActive != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("TCPActive = %d after every connection closed, want 0", g.nat.Stats().TCPActive)
		}
	}
}
