package netstack

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/link/channel"
	"gvisor.dev/gvisor/pkg/tcpip/link/ethernet"
	"gvisor.dev/gvisor/pkg/tcpip/network/arp"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
)

var testGuestMAC = net.HardwareAddr{0x52, 0x54, 0x00, 0x12, 0x34, 0x56}

// guest is a second gVisor stack playing the VM: its NIC is an Ethernet
// channel endpoint whose frames are pumped to and from the NAT under test.
type guest struct {
	st  *stack.Stack
	nat *Stack
}

// countingDial wraps a dialer and counts host dials, to prove refused flows
// never reach the host.
type countingDial struct {
	n atomic.Int64
	d net.Dialer
}

func (c *countingDial) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c.n.Add(1)
	return c.d.DialContext(ctx, network, addr)
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// newTestNAT starts a NAT with cfg (logger, guest MAC defaulted) and a
// guest stack wired to it. Both are closed at cleanup.
func newTestNAT(t testing.TB, cfg Config) *guest {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	if cfg.GuestMAC == nil {
		cfg.GuestMAC = testGuestMAC
	}
	ctx, cancel := context.WithCancel(context.Background())
	nat, err := New(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatalf("New: %v", err)
	}
	g := &guest{nat: nat}
	addrs := nat.Addrs()

	ch := channel.New(1024, addrs.MTU+header.EthernetMinimumSize, tcpip.LinkAddress(cfg.GuestMAC))
	g.st = stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, arp.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol},
	})
	must := func(what string, err tcpip.Error) {
		if err != nil {
			t.Fatalf("guest %s: %s", what, err)
		}
	}
	must("create NIC", g.st.CreateNIC(1, ethernet.New(ch)))
	must("add address", g.st.AddProtocolAddress(1, tcpip.ProtocolAddress{
		Protocol: ipv4.ProtocolNumber,
		AddressWithPrefix: tcpip.AddressWithPrefix{
			Address: toTCPIP(addrs.GuestIP.Addr()), PrefixLen: addrs.GuestIP.Bits(),
		},
	}, stack.AddressProperties{}))
	sub, serr := tcpip.NewSubnet(toTCPIP(addrs.GuestIP.Masked().Addr()),
		tcpip.MaskFromBytes(net.CIDRMask(addrs.GuestIP.Bits(), 32)))
	if serr != nil {
		t.Fatal(serr)
	}
	g.st.SetRouteTable([]tcpip.Route{
		{Destination: sub, NIC: 1},
		{Destination: header.IPv4EmptySubnet, Gateway: toTCPIP(addrs.Gateway), NIC: 1},
	})
	sack := tcpip.TCPSACKEnabled(true)
	g.st.SetTransportProtocolOption(tcp.ProtocolNumber, &sack)

	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // guest → NAT
		defer wg.Done()
		for {
			pkt := ch.ReadContext(ctx)
			if pkt == nil {
				return
			}
			frame := pkt.ToView().AsSlice()
			pkt.DecRef()
			if err := nat.DeliverFrame(frame); errors.Is(err, ErrClosed) {
				return
			} else if err != nil {
				t.Errorf("DeliverFrame rejected a guest stack frame: %v", err)
			}
		}
	}()
	go func() { // NAT → guest
		defer wg.Done()
		for {
			frame, err := nat.ReadFrame(ctx)
			if err != nil {
				return
			}
			pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithData(frame)})
			ch.InjectInbound(0, pkt)
			pkt.DecRef()
		}
	}()
	t.Cleanup(func() {
		g.st.Close()
		if err := nat.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		cancel()
		ch.Close()
		wg.Wait()
		g.st.Wait()
	})
	return g
}

func (g *guest) fullAddr(ap netip.AddrPort) tcpip.FullAddress {
	return tcpip.FullAddress{NIC: 1, Addr: toTCPIP(ap.Addr()), Port: ap.Port()}
}

// dialTCP connects from the guest.
func (g *guest) dialTCP(ctx context.Context, ap netip.AddrPort) (*gonet.TCPConn, error) {
	return gonet.DialContextTCP(ctx, g.st, g.fullAddr(ap), ipv4.ProtocolNumber)
}

func (g *guest) dialUDP(ap netip.AddrPort) (*gonet.UDPConn, error) {
	fa := g.fullAddr(ap)
	return gonet.DialUDP(g.st, nil, &fa, ipv4.ProtocolNumber)
}

// dialContext is a net.Dialer-like DialContext through the guest stack.
func (g *guest) dialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	switch network {
	case "tcp", "tcp4":
		return g.dialTCP(ctx, ap)
	case "udp", "udp4":
		return g.dialUDP(ap)
	}
	return nil, errors.New("unsupported network " + network)
}

// resolver resolves names from inside the guest through server (normally
// the NAT's DNS address). forceTCP makes it speak DNS over TCP.
func (g *guest) resolver(server netip.AddrPort, forceTCP bool) *net.Resolver {
	return &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			if forceTCP {
				network = "tcp"
			}
			return g.dialContext(ctx, network, server.String())
		},
	}
}

// hostServer is a TCP server on the host's loopback that runs serve for
// each connection (in its own goroutine) until the test ends.
func hostServer(t testing.TB, serve func(net.Conn)) net.Listener {
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
			go serve(c)
		}
	}()
	return l
}

func gatewayPort(g *guest, port int) netip.AddrPort {
	return netip.AddrPortFrom(g.nat.Addrs().Gateway, uint16(port))
}

// fakeDNS is a real DNS server on loopback answering A queries from a table.
type fakeDNS struct {
	pc      net.PacketConn
	records map[string][]netip.Addr // lower-case FQDN with trailing dot
	mu      sync.Mutex
	queries map[string]int
}

func startFakeDNS(t testing.TB, records map[string][]string) *fakeDNS {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeDNS{pc: pc, records: map[string][]netip.Addr{}, queries: map[string]int{}}
	for name, ips := range records {
		for _, ip := range ips {
			f.records[name+"."] = append(f.records[name+"."], netip.MustParseAddr(ip))
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if resp := f.answer(buf[:n]); resp != nil {
				pc.WriteTo(resp, from)
			}
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return f
}

func (f *fakeDNS) answer(q []byte) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(q)
	if err != nil {
		return nil
	}
	qu, err := p.Question()
	if err != nil {
		return nil
	}
	name := qu.Name.String()
	f.mu.Lock()
	f.queries[name]++
	f.mu.Unlock()
	ips, ok := f.records[name]
	rcode := dnsmessage.RCodeSuccess
	if !ok {
		rcode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RCode: rcode})
	b.EnableCompression()
	b.StartQuestions()
	b.Question(qu)
	b.StartAnswers()
	for _, ip := range ips {
		rh := dnsmessage.ResourceHeader{Name: qu.Name, Class: dnsmessage.ClassINET, TTL: 300}
		switch {
		case qu.Type == dnsmessage.TypeA && ip.Is4():
			rh.Type = dnsmessage.TypeA
			b.AResource(rh, dnsmessage.AResource{A: ip.As4()})
		case qu.Type == dnsmessage.TypeAAAA && ip.Is6():
			rh.Type = dnsmessage.TypeAAAA
			b.AAAAResource(rh, dnsmessage.AAAAResource{AAAA: ip.As16()})
		}
	}
	msg, _ := b.Finish()
	return msg
}

func (f *fakeDNS) count(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.queries[name+"."]
}

// resolver is the host-side resolver the NAT uses, pointed at the fake.
func (f *fakeDNS) resolver() *net.Resolver {
	addr := f.pc.LocalAddr().String()
	return &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "udp", addr)
		},
	}
}

func testCtx(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// gonetListen listens for TCP inside the guest on its address.
func gonetListen(g *guest, port uint16) (*gonet.TCPListener, error) {
	return gonet.ListenTCP(g.st, g.fullAddr(netip.AddrPortFrom(g.nat.Addrs().GuestIP.Addr(), port)), ipv4.ProtocolNumber)
}

// gonetListenUDP binds a UDP socket inside the guest on its address.
func gonetListenUDP(g *guest, port uint16) (*gonet.UDPConn, error) {
	fa := g.fullAddr(netip.AddrPortFrom(g.nat.Addrs().GuestIP.Addr(), port))
	return gonet.DialUDP(g.st, &fa, nil, ipv4.ProtocolNumber)
}
