package egressproxy

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
)

func TestCheck(t *testing.T) {
	for _, c := range []struct {
		p    Proxy
		want string // "" passes
	}{
		{Proxy{Address: "proxy.example.com:1080"}, ""},
		{Proxy{Address: "192.0.2.1:1080", Username: "u", Password: "p"}, ""},
		{Proxy{Address: "[2001:db8::1]:1080", Username: "u"}, ""},
		{Proxy{Address: "proxy.example.com"}, "HOST:PORT"},
		{Proxy{Address: ":1080"}, "HOST:PORT"},
		{Proxy{Address: "p.example:0"}, "port"},
		{Proxy{Address: "p.example:65536"}, "port"},
		{Proxy{Address: "p.example:http"}, "port"},
		{Proxy{Address: "bad host:1080"}, "neither"},
		{Proxy{Address: "-x.example:1080"}, "neither"},
		{Proxy{Address: "p.example:1080", Password: "pw-secret"}, "password without a username"},
		{Proxy{Address: "p.example:1080", Username: strings.Repeat("u", 256)}, "255 bytes"},
		{Proxy{Address: "p.example:1080", Username: "u", Password: strings.Repeat("p", 256)}, "255 bytes"},
	} {
		err := c.p.Check()
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%+v: %v; want %q", c.p, err, c.want)
		}
		if err != nil && c.p.Password != "" && strings.Contains(err.Error(), c.p.Password) {
			t.Errorf("%+v: the error %q holds the password", c.p, err)
		}
	}
	if s := (Proxy{Address: "p.example:1080", Username: "u", Password: "secret"}).String(); strings.Contains(s, "secret") || s != "socks5://u@p.example:1080" {
		t.Errorf("String = %q; want the address and username alone", s)
	}
}

// socksPeer is the proxy's side of RFC 1928 and 1929, as much as the
// client's part needs checking here (the end-to-end test, TestE2BSDK,
// runs a real SOCKS5 server): it takes CONNECT to an IPv4 address,
// checks the credentials it was made with, reports each request, and
// relays to the destination.
type socksPeer struct {
	user, pass string
	got        chan string // "user:pass dst" per CONNECT
}

func startPeer(t *testing.T, user, pass string) (string, *socksPeer) {
	t.Helper()
	p := &socksPeer{user: user, pass: pass, got: make(chan string, 16)}
	return serveEach(t, p.serve), p
}

func (p *socksPeer) serve(c net.Conn) {
	defer c.Close()
	r := bufio.NewReader(c)
	hdr := make([]byte, 2)
	if _, err := io.ReadFull(r, hdr); err != nil || hdr[0] != 5 {
		return
	}
	methods := make([]byte, hdr[1])
	io.ReadFull(r, methods)
	cred := ""
	if p.user != "" {
		c.Write([]byte{5, 2})
		var ver, n [1]byte
		io.ReadFull(r, ver[:])
		io.ReadFull(r, n[:])
		u := make([]byte, n[0])
		io.ReadFull(r, u)
		io.ReadFull(r, n[:])
		pw := make([]byte, n[0])
		io.ReadFull(r, pw)
		if string(u) != p.user || string(pw) != p.pass {
			c.Write([]byte{1, 1})
			p.got <- "refused " + string(u)
			return
		}
		c.Write([]byte{1, 0})
		cred = string(u) + ":" + string(pw)
	} else {
		c.Write([]byte{5, 0})
	}
	req := make([]byte, 4)
	if _, err := io.ReadFull(r, req); err != nil || req[1] != 1 || req[3] != 1 {
		c.Write([]byte{5, 7, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	a := make([]byte, 6)
	io.ReadFull(r, a)
	dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte(a[:4])), binary.BigEndian.Uint16(a[4:])).String()
	p.got <- cred + " " + dst
	up, err := net.Dial("tcp", dst)
	if err != nil {
		c.Write([]byte{5, 5, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	defer up.Close()
	c.Write([]byte{5, 0, 0, 1, 0, 0, 0, 0, 0, 0})
	go func() {
		io.Copy(up, r)
		up.(*net.TCPConn).CloseWrite() // the client's half-close, passed on
	}()
	io.Copy(c, up)
}

// serveEach serves each connection to a new loopback listener with
// serve, until the test ends, and returns its address.
func serveEach(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
	return l.Addr().String()
}

// echoServer answers each connection with what it read of its first line.
func echoServer(t *testing.T) string {
	return serveEach(t, func(c net.Conn) {
		line, _ := bufio.NewReader(c).ReadString('\n')
		io.WriteString(c, "echo "+line)
	})
}

// countServer reads each connection to its end, then says how much it
// read: it answers only a half-closed connection.
func countServer(t *testing.T) string {
	return serveEach(t, func(c net.Conn) {
		b, _ := io.ReadAll(c)
		fmt.Fprintf(c, "read %d bytes", len(b))
	})
}

func roundTrip(t *testing.T, c net.Conn) string {
	t.Helper()
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "hello\n")
	b, _ := io.ReadAll(c)
	return string(b)
}

func TestDialThroughProxy(t *testing.T) {
	dst := echoServer(t)
	addr, peer := startPeer(t, "agent", "s3cret")
	d, err := New(Proxy{Address: addr, Username: "agent", Password: "s3cret"}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", dst)
	if err != nil {
		t.Fatalf("dial %s through the proxy: %v", dst, err)
	}
	if got := roundTrip(t, c); got != "echo hello\n" {
		t.Errorf("through the proxy: %q", got)
	}
	if got := <-peer.got; got != "agent:s3cret "+dst {
		t.Errorf("the proxy saw %q; want the credentials and %s", got, dst)
	}

	// A half-close reaches the server through the tunnel, and its
	// answer comes back: the connection is TCP to the proxy, as a direct
	// one is to its host, and says which proxy it goes through.
	counter := countServer(t)
	c, err = d.DialContext(ctx, "tcp", counter)
	if err != nil {
		t.Fatal(err)
	}
	pc, ok := c.(*Conn)
	if !ok || pc.Via() != "socks5://agent@"+addr {
		t.Fatalf("the connection: %T; want a *Conn via socks5://agent@%s", c, addr)
	}
	pc.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(pc, "12345")
	if err := pc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(pc); string(b) != "read 5 bytes" {
		t.Errorf("after a half-close: %q; want the server's answer", b)
	}
	pc.Close()
	<-peer.got

	// A wrong password: the connection fails, and does not go direct.
	bad, _ := New(Proxy{Address: addr, Username: "agent", Password: "wrong"}, Options{})
	if c, err := bad.DialContext(ctx, "tcp", dst); err == nil {
		c.Close()
		t.Error("a proxy that refused the credentials: dial succeeded; want it to fail closed")
	} else if strings.Contains(err.Error(), "wrong") {
		t.Errorf("the error %q holds the password", err)
	}
	<-peer.got
}

func TestFailsClosed(t *testing.T) {
	dst := echoServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Nothing listens.
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	gone := l.Addr().String()
	l.Close()
	// Not SOCKS5: an HTTP server's answer.
	httpAddr := serveEach(t, func(c net.Conn) { io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n") })
	for what, addr := range map[string]string{"no proxy listening": gone, "an HTTP server": httpAddr} {
		d, err := New(Proxy{Address: addr}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		c, err := d.DialContext(ctx, "tcp", dst)
		if err == nil {
			c.Close()
			t.Errorf("%s: dial succeeded; want it to fail closed", what)
		} else if !strings.Contains(err.Error(), "egress proxy socks5://"+addr) {
			t.Errorf("%s: %v; want an error naming the proxy", what, err)
		}
	}
}

func TestPublicOnly(t *testing.T) {
	dst := echoServer(t)
	addr, peer := startPeer(t, "", "")
	_, port, _ := net.SplitHostPort(addr)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := New(Proxy{Address: addr, PublicOnly: true}, Options{}); err == nil {
		t.Error("PublicOnly without NonPublic: New passed")
	}
	// A name that resolves to loopback is refused at each dial, as an IP.
	for _, a := range []string{addr, "localhost:" + port} {
		d, err := New(Proxy{Address: a, PublicOnly: true}, Options{NonPublic: netstack.NonPublicChecker()})
		if err != nil {
			t.Fatal(err)
		}
		_, err = d.Resolve(ctx)
		if !errors.Is(err, ErrNonPublic) {
			t.Errorf("Resolve %s: %v; want ErrNonPublic", a, err)
		}
		// An address given is named for what it is; what a name
		// resolved to is the host's resolver's, and not told.
		if a == addr && !strings.Contains(err.Error(), "loopback") || a != addr && strings.Contains(err.Error(), "127.0.0.1") {
			t.Errorf("Resolve %s: %q; want loopback named for the address, no resolved address for the name", a, err)
		}
		if c, err := d.DialContext(ctx, "tcp", dst); err == nil {
			c.Close()
			t.Errorf("dial through %s: succeeded; want the proxy refused", a)
		} else if !errors.Is(err, ErrNonPublic) {
			t.Errorf("dial through %s: %v; want ErrNonPublic", a, err)
		}
	}
	select {
	case got := <-peer.got:
		t.Errorf("the refused proxy was reached: %q", got)
	default:
	}
	// Without PublicOnly the same proxy is used, by name too.
	d, err := New(Proxy{Address: "localhost:" + port}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := d.DialContext(ctx, "tcp", dst)
	if err != nil {
		t.Fatalf("dial through localhost:%s: %v", port, err)
	}
	if got := roundTrip(t, c); got != "echo hello\n" {
		t.Errorf("through the proxy by name: %q", got)
	}
}

// UDP is not tunneled: it goes straight to its destination.
func TestUDPDirect(t *testing.T) {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	d, err := New(Proxy{Address: "192.0.2.1:1080"}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := d.DialContext(context.Background(), "udp", pc.LocalAddr().String())
	if err != nil {
		t.Fatalf("dial UDP: %v", err)
	}
	defer c.Close()
	c.Write([]byte("ping"))
	pc.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 8)
	if n, _, err := pc.ReadFrom(b); err != nil || string(b[:n]) != "ping" {
		t.Errorf("UDP: %q, %v; want it delivered directly", b[:n], err)
	}
}
