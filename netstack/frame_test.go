package netstack

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// newBareNAT is a NAT with no guest stack: the test drives frames by hand.
func newBareNAT(t testing.TB, cfg Config) *Stack {
	t.Helper()
	if cfg.GuestMAC == nil {
		cfg.GuestMAC = testGuestMAC
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	s, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func arpFrame(srcMAC net.HardwareAddr, sender, target netip.Addr, dstMAC net.HardwareAddr) []byte {
	b := make([]byte, header.EthernetMinimumSize+header.ARPSize)
	header.Ethernet(b).Encode(&header.EthernetFields{
		SrcAddr: tcpip.LinkAddress(srcMAC), DstAddr: tcpip.LinkAddress(dstMAC), Type: header.ARPProtocolNumber,
	})
	a := header.ARP(b[header.EthernetMinimumSize:])
	a.SetIPv4OverEthernet()
	a.SetOp(header.ARPRequest)
	copy(a.HardwareAddressSender(), srcMAC)
	s4, t4 := sender.As4(), target.As4()
	copy(a.ProtocolAddressSender(), s4[:])
	copy(a.ProtocolAddressTarget(), t4[:])
	return b
}

// udpFrame builds a checksummed guest UDP datagram.
func udpFrame(srcMAC, dstMAC net.HardwareAddr, src, dst netip.AddrPort, payload []byte) []byte {
	ipLen := header.IPv4MinimumSize + header.UDPMinimumSize + len(payload)
	b := make([]byte, header.EthernetMinimumSize+ipLen)
	header.Ethernet(b).Encode(&header.EthernetFields{
		SrcAddr: tcpip.LinkAddress(srcMAC), DstAddr: tcpip.LinkAddress(dstMAC), Type: header.IPv4ProtocolNumber,
	})
	ip := header.IPv4(b[header.EthernetMinimumSize:])
	ip.Encode(&header.IPv4Fields{
		TotalLength: uint16(ipLen), TTL: 64, Protocol: uint8(header.UDPProtocolNumber),
		SrcAddr: toTCPIP(src.Addr()), DstAddr: toTCPIP(dst.Addr()),
	})
	ip.SetChecksum(^ip.CalculateChecksum())
	u := header.UDP(ip[header.IPv4MinimumSize:])
	u.Encode(&header.UDPFields{SrcPort: src.Port(), DstPort: dst.Port(), Length: uint16(header.UDPMinimumSize + len(payload))})
	copy(u.Payload(), payload)
	xsum := header.PseudoHeaderChecksum(header.UDPProtocolNumber, toTCPIP(src.Addr()), toTCPIP(dst.Addr()), uint16(len(u)))
	xsum = checksum.Checksum(payload, xsum)
	u.SetChecksum(^u.CalculateChecksum(xsum))
	return b
}

func readFrameWithin(s *Stack, d time.Duration) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return s.ReadFrame(ctx)
}

func TestARP(t *testing.T) {
	s := newBareNAT(t, Config{})
	guestIP := s.Addrs().GuestIP.Addr()
	for _, tc := range []struct {
		target string
		answer bool
	}{
		{"10.0.2.2", true},      // gateway
		{"10.0.2.3", true},      // DNS
		{"93.184.216.34", true}, // off-subnet: answered as the gateway
		{"10.0.2.15", false},    // the guest itself: never (would look like a conflict)
		{"10.0.2.99", false},    // other on-link hosts do not exist
	} {
		t.Run(tc.target, func(t *testing.T) {
			target := netip.MustParseAddr(tc.target)
			bcast := net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
			if err := s.DeliverFrame(arpFrame(testGuestMAC, guestIP, target, bcast)); err != nil {
				t.Fatal(err)
			}
			wait := 200 * time.Millisecond
			if tc.answer {
				wait = 5 * time.Second
			}
			f, err := readFrameWithin(s, wait)
			if !tc.answer {
				if err == nil {
					t.Fatalf("unexpected reply frame % x", f)
				}
				return
			}
			if err != nil {
				t.Fatalf("no ARP reply: %v", err)
			}
			eth := header.Ethernet(f)
			if eth.Type() != header.ARPProtocolNumber || string(eth.DestinationAddress()) != string(testGuestMAC) {
				t.Fatalf("reply %x is not ARP to the guest", f)
			}
			a := header.ARP(f[header.EthernetMinimumSize:])
			if a.Op() != header.ARPReply || netip.AddrFrom4([4]byte(a.ProtocolAddressSender())) != target ||
				string(a.HardwareAddressSender()) != string(DefaultGatewayMAC) {
				t.Fatalf("bad ARP reply %x", f)
			}
		})
	}
}

func TestSpoofedFramesDropped(t *testing.T) {
	s := newBareNAT(t, Config{Policy: AllowAll()})
	gw := s.Addrs().Gateway
	guest := s.Addrs().GuestIP.Addr()
	otherMAC := net.HardwareAddr{0x52, 0x54, 0, 0, 0, 0x99}
	gwMAC := DefaultGatewayMAC
	for name, f := range map[string][]byte{
		"foreign source MAC": udpFrame(otherMAC, gwMAC, netip.AddrPortFrom(guest, 1000), netip.AddrPortFrom(gw, 53), []byte("x")),
		"spoofed source IP":  udpFrame(testGuestMAC, gwMAC, netip.MustParseAddrPort("10.0.2.77:1000"), netip.AddrPortFrom(gw, 9), []byte("x")),
		"not for our MAC":    udpFrame(testGuestMAC, otherMAC, netip.AddrPortFrom(guest, 1000), netip.AddrPortFrom(gw, 9), []byte("x")),
		"ARP spoofed sender": arpFrame(testGuestMAC, netip.MustParseAddr("10.0.2.77"), gw, gwMAC),
		"ARP probe":          arpFrame(testGuestMAC, netip.IPv4Unspecified(), gw, gwMAC),
	} {
		before := s.Stats().DroppedIn
		if err := s.DeliverFrame(f); err != nil {
			t.Errorf("%s: DeliverFrame = %v, want silent drop", name, err)
		}
		if s.Stats().DroppedIn != before+1 {
			t.Errorf("%s: not counted as dropped", name)
		}
	}
	if f, err := readFrameWithin(s, 200*time.Millisecond); err == nil {
		t.Fatalf("spoofed frames produced a reply: % x", f)
	}
}

func TestDeliverFrameGarbage(t *testing.T) {
	s := newBareNAT(t, Config{Policy: AllowAll()})
	gw := s.Addrs().Gateway
	guest := s.Addrs().GuestIP.Addr()
	valid := udpFrame(testGuestMAC, DefaultGatewayMAC, netip.AddrPortFrom(guest, 1000), netip.AddrPortFrom(gw, 9), []byte("payload"))
	ethOnly := func(typ tcpip.NetworkProtocolNumber, rest ...byte) []byte {
		b := make([]byte, header.EthernetMinimumSize, header.EthernetMinimumSize+len(rest))
		header.Ethernet(b).Encode(&header.EthernetFields{
			SrcAddr: tcpip.LinkAddress(testGuestMAC), DstAddr: tcpip.LinkAddress(DefaultGatewayMAC), Type: typ,
		})
		return append(b, rest...)
	}
	cases := map[string]struct {
		frame     []byte
		malformed bool
	}{
		"nil":            {nil, true},
		"one byte":       {[]byte{1}, true},
		"13 bytes":       {make([]byte, 13), true},
		"oversized":      {make([]byte, 1515), true},
		"arp truncated":  {ethOnly(header.ARPProtocolNumber, 0, 1, 8, 0), true},
		"arp not ipv4":   {ethOnly(header.ARPProtocolNumber, make([]byte, header.ARPSize)...), true},
		"ipv4 truncated": {ethOnly(header.IPv4ProtocolNumber, 0x45, 0, 0), true},
		"ipv4 bad ihl":   {ethOnly(header.IPv4ProtocolNumber, append([]byte{0x4f}, make([]byte, 30)...)...), true},
		"ipv4 bad len":   {func() []byte { f := append([]byte(nil), valid...); f[16], f[17] = 0xff, 0xff; return f }(), true},
		"udp truncated":  {valid[:header.EthernetMinimumSize+header.IPv4MinimumSize+3], true},
		"udp bad length": {func() []byte { f := append([]byte(nil), valid...); f[39] = 0xff; return f }(), false},
		"ipv6":           {ethOnly(header.IPv6ProtocolNumber, make([]byte, 60)...), false},
		"unknown type":   {ethOnly(0x88b5, 1, 2, 3), false},
	}
	for name, tc := range cases {
		err := s.DeliverFrame(tc.frame)
		if tc.malformed != errors.Is(err, ErrMalformedFrame) {
			t.Errorf("%s: DeliverFrame = %v, malformed %v", name, err, tc.malformed)
		}
	}
	// Every truncation of a valid frame, and every single-byte corruption.
	for i := range valid {
		s.DeliverFrame(valid[:i])
		for _, v := range []byte{0, 0xff, valid[i] ^ 0x80} {
			f := append([]byte(nil), valid...)
			f[i] = v
			s.DeliverFrame(f)
		}
	}
	for {
		if _, ok := s.TryReadFrame(); !ok {
			break
		}
	}
}

func FuzzDeliverFrame(f *testing.F) {
	gw := DefaultGateway
	guest := DefaultGuestIP
	f.Add(udpFrame(testGuestMAC, DefaultGatewayMAC, netip.AddrPortFrom(guest, 1000), netip.AddrPortFrom(gw, 9), []byte("hi")))
	f.Add(udpFrame(testGuestMAC, DefaultGatewayMAC, netip.AddrPortFrom(guest, 1000), netip.AddrPortFrom(DefaultDNS, 53), []byte{0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 'a', 0, 0, 1, 0, 1}))
	f.Add(arpFrame(testGuestMAC, guest, gw, net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}))
	f.Add([]byte{})
	f.Add(make([]byte, 60))
	// deny-all and a resolver and dialer that go nowhere: fuzzed flows must
	// not reach anything outside the process.
	nowhere := func(context.Context, string, string) (net.Conn, error) { return nil, errors.New("fuzzing") }
	s, err := New(context.Background(), Config{
		GuestMAC: testGuestMAC, Policy: mustPolicy(f, "deny-all"),
		Resolver: &net.Resolver{PreferGo: true, Dial: nowhere}, Dial: nowhere,
	})
	if err != nil {
		f.Fatal(err)
	}
	defer s.Close()
	f.Fuzz(func(t *testing.T, frame []byte) {
		_ = s.DeliverFrame(frame)
		for {
			if _, ok := s.TryReadFrame(); !ok {
				return
			}
		}
	})
}

func mustPolicy(t testing.TB, mode string, allowDeny ...[]string) *Policy {
	t.Helper()
	var allow, deny []string
	if len(allowDeny) > 0 {
		allow = allowDeny[0]
	}
	if len(allowDeny) > 1 {
		deny = allowDeny[1]
	}
	p, err := ParsePolicy(mode, allow, deny)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func icmpEchoFrame(dst netip.Addr) []byte {
	ipLen := header.IPv4MinimumSize + header.ICMPv4MinimumSize + 4
	b := make([]byte, header.EthernetMinimumSize+ipLen)
	header.Ethernet(b).Encode(&header.EthernetFields{
		SrcAddr: tcpip.LinkAddress(testGuestMAC), DstAddr: tcpip.LinkAddress(DefaultGatewayMAC), Type: header.IPv4ProtocolNumber,
	})
	ip := header.IPv4(b[header.EthernetMinimumSize:])
	ip.Encode(&header.IPv4Fields{
		TotalLength: uint16(ipLen), TTL: 64, Protocol: uint8(header.ICMPv4ProtocolNumber),
		SrcAddr: toTCPIP(DefaultGuestIP), DstAddr: toTCPIP(dst),
	})
	ip.SetChecksum(^ip.CalculateChecksum())
	icmp := header.ICMPv4(ip[header.IPv4MinimumSize:])
	icmp.SetType(header.ICMPv4Echo)
	icmp.SetIdent(7)
	icmp.SetSequence(1)
	copy(icmp.Payload(), "ping")
	icmp.SetChecksum(^checksum.Checksum(icmp, 0))
	return b
}

func TestPing(t *testing.T) {
	s := newBareNAT(t, Config{Policy: AllowAll()})
	// The stack's own addresses answer.
	for _, dst := range []netip.Addr{DefaultGateway, DefaultDNS} {
		if err := s.DeliverFrame(icmpEchoFrame(dst)); err != nil {
			t.Fatal(err)
		}
		f, err := readFrameWithin(s, 5*time.Second)
		if err != nil {
			t.Fatalf("no echo reply from %s: %v", dst, err)
		}
		ip := header.IPv4(f[header.EthernetMinimumSize:])
		icmp := header.ICMPv4(ip.Payload())
		if fromTCPIP(ip.SourceAddress()) != dst || icmp.Type() != header.ICMPv4EchoReply || string(icmp.Payload()) != "ping" {
			t.Fatalf("bad reply from %s: % x", dst, f)
		}
	}
	// Other destinations do not: the stack must not fake reachability.
	s.DeliverFrame(icmpEchoFrame(netip.MustParseAddr("93.184.216.34")))
	if f, err := readFrameWithin(s, 200*time.Millisecond); err == nil {
		t.Fatalf("echo to an internet address answered: % x", f)
	}
}
