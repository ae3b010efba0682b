package netstack

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/network/arp"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
)

const nicID tcpip.NICID = 1

// hostLoopback is what the gateway address stands for on the host side:
// the guest reaches host services on 127.0.0.1 through the gateway address,
// subject to the policy (which sees 127.0.0.1, refused under public-only
// unless allowed by a rule such as "127.0.0.1:8080").
var hostLoopback = netip.MustParseAddr("127.0.0.1")

// Stack is a user-mode NAT for one guest NIC: it terminates the guest's
// TCP and UDP flows in a gVisor network stack and re-originates them from
// the host with Config.Dial, subject to Config.Policy. It also serves DNS,
// answers ARP for the gateway, DNS and every off-subnet address, and
// forwards published host ports into the guest.
type Stack struct {
	cfg    Config
	log    *slog.Logger
	stack  *stack.Stack
	link   *linkEndpoint
	names  *nameCache
	hosts  *hostAddrs
	denLog logLimiter
	audit  *auditor
	// policy is Config.Policy until SetPolicy replaces it.
	policy atomic.Pointer[Policy]

	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	closed  bool
	wg      sync.WaitGroup
	closers map[io.Closer]struct{}

	published []Published

	tcpConns atomic.Int64
	udpFlows atomic.Int64
	stats    counters
}

type counters struct {
	framesIn, droppedIn          atomic.Uint64
	tcpForwarded, tcpRefused     atomic.Uint64
	udpForwarded, udpRefused     atomic.Uint64
	dnsQueries, dnsRefused       atomic.Uint64
	publishedTCP, publishedUDPIn atomic.Uint64
}

// Stats are cumulative counters, plus current flow counts.
type Stats struct {
	FramesIn    uint64 // frames accepted from the guest
	DroppedIn   uint64 // frames from the guest dropped (malformed or filtered)
	FramesOut   uint64 // frames queued for the guest
	DroppedOut  uint64 // frames for the guest dropped on a full queue
	TCPForward  uint64 // guest TCP connections forwarded to the host
	TCPRefused  uint64 // guest TCP connections refused (policy, dial failure, limits)
	UDPForward  uint64 // guest UDP flows forwarded
	UDPRefused  uint64 // guest UDP flows refused
	DNSQueries  uint64
	DNSRefused  uint64 // queries answered NXDOMAIN by policy
	PublishedIn uint64 // host connections/flows forwarded into the guest
	TCPActive   int64
	UDPActive   int64
}

// New builds the stack and opens the published host listeners. ctx bounds
// the stack's background work; Close releases everything.
func New(ctx context.Context, c Config) (*Stack, error) {
	cfg, err := c.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Stack{
		cfg:     cfg,
		log:     cfg.Logger.With("component", "netstack"),
		names:   newNameCache(4096),
		hosts:   newHostAddrs(),
		audit:   newAuditor(cfg.Audit),
		closers: make(map[io.Closer]struct{}),
	}
	s.policy.Store(cfg.Policy)
	s.ctx, s.cancel = context.WithCancel(ctx)
	s.link = newLinkEndpoint(tcpip.LinkAddress(cfg.GatewayMAC), cfg.MTU, cfg.QueueLen)

	s.stack = stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, arp.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol},
	})
	if err := s.setupStack(); err != nil {
		s.stack.Destroy()
		s.cancel()
		return nil, err
	}
	if err := s.startDNS(); err != nil {
		s.Close()
		return nil, err
	}
	if err := s.startPublish(); err != nil {
		s.Close()
		return nil, err
	}
	if cfg.Audit != nil {
		s.goroutine(s.flushAudit)
	}
	s.log.Info("netstack up", "guest", netip.PrefixFrom(cfg.GuestIP, cfg.Subnet.Bits()),
		"gateway", cfg.Gateway, "dns", cfg.DNS, "mtu", cfg.MTU, "policy", cfg.Policy.String())
	return s, nil
}

func (s *Stack) setupStack() error {
	st, cfg := s.stack, s.cfg
	if err := tcpipErr("create NIC", st.CreateNICWithOptions(nicID, s.link, stack.NICOptions{Name: "guest0"})); err != nil {
		return err
	}
	// Promiscuous: accept packets for any destination address. Spoofing:
	// send from any source address. Together the stack terminates flows to
	// arbitrary destinations (the NAT) and ARP answers for any target; the
	// frame filter in DeliverFrame restricts ARP to the gateway, DNS and
	// off-subnet addresses.
	if err := tcpipErr("set promiscuous mode", st.SetPromiscuousMode(nicID, true)); err != nil {
		return err
	}
	if err := tcpipErr("set spoofing", st.SetSpoofing(nicID, true)); err != nil {
		return err
	}
	for _, a := range []netip.Addr{cfg.Gateway, cfg.DNS} {
		pa := tcpip.ProtocolAddress{
			Protocol:          ipv4.ProtocolNumber,
			AddressWithPrefix: tcpip.AddressWithPrefix{Address: toTCPIP(a), PrefixLen: cfg.Subnet.Bits()},
		}
		if err := st.AddProtocolAddress(nicID, pa, stack.AddressProperties{}); err != nil {
			if _, dup := err.(*tcpip.ErrDuplicateAddress); dup && a == cfg.DNS {
				continue // DNS == Gateway
			}
			return tcpipErr("add address "+a.String(), err)
		}
	}
	sub, err := tcpip.NewSubnet(toTCPIP(cfg.Subnet.Addr()), tcpip.MaskFromBytes(net.CIDRMask(cfg.Subnet.Bits(), 32)))
	if err != nil {
		return fmt.Errorf("netstack: subnet %s: %v", cfg.Subnet, err)
	}
	st.SetRouteTable([]tcpip.Route{{Destination: sub, NIC: nicID}})
	if cfg.GuestMAC != nil {
		if err := tcpipErr("add guest neighbor", st.AddStaticNeighbor(nicID, ipv4.ProtocolNumber, toTCPIP(cfg.GuestIP), tcpip.LinkAddress(cfg.GuestMAC))); err != nil {
			return err
		}
	}
	sack := tcpip.TCPSACKEnabled(true)
	if err := tcpipErr("enable TCP SACK", st.SetTransportProtocolOption(tcp.ProtocolNumber, &sack)); err != nil {
		return err
	}
	// Every endpoint's buffers are bounded (Config.TCPBuffer); receive
	// moderation grows them only up to that.
	snd := tcpip.TCPSendBufferSizeRangeOption{Min: 4 << 10, Default: min(64<<10, cfg.TCPBuffer), Max: cfg.TCPBuffer}
	if err := tcpipErr("bound TCP send buffers", st.SetTransportProtocolOption(tcp.ProtocolNumber, &snd)); err != nil {
		return err
	}
	rcv := tcpip.TCPReceiveBufferSizeRangeOption(snd)
	if err := tcpipErr("bound TCP receive buffers", st.SetTransportProtocolOption(tcp.ProtocolNumber, &rcv)); err != nil {
		return err
	}
	moderate := tcpip.TCPModerateReceiveBufferOption(true)
	if err := tcpipErr("enable TCP receive buffer moderation", st.SetTransportProtocolOption(tcp.ProtocolNumber, &moderate)); err != nil {
		return err
	}

	// No TIME_WAIT on the guest's side. When the host's server closes
	// first, the NAT's endpoint ends in TIME_WAIT, and gVisor's default
	// keeps it 60 s, dropping without a word a SYN for that 4-tuple (it
	// reopens one only for a listener, and the forwarder is none). The
	// guest closed second and holds no TIME_WAIT, so it may use the port
	// again at once: that connection hung until the guest gave up (about
	// one in a thousand new connections under load). TIME_WAIT guards
	// against old segments of a path that reorders; the guest's link is a
	// virtio queue, in order, with no old segments. A FIN the guest sends
	// again after a lost ACK gets a RST, which ends its LAST_ACK as well.
	tw := tcpip.TCPTimeWaitTimeoutOption(0)
	if err := tcpipErr("turn off TCP TIME_WAIT", st.SetTransportProtocolOption(tcp.ProtocolNumber, &tw)); err != nil {
		return err
	}
	tcpFwd := tcp.NewForwarder(st, 0, 512, s.handleTCP)
	st.SetTransportProtocolHandler(tcp.ProtocolNumber, tcpFwd.HandlePacket)
	udpFwd := udp.NewForwarder(st, s.handleUDP)
	st.SetTransportProtocolHandler(udp.ProtocolNumber, udpFwd.HandlePacket)
	return nil
}

// Addrs reports what the guest must configure.
func (s *Stack) Addrs() Addrs {
	return Addrs{
		GuestIP:    netip.PrefixFrom(s.cfg.GuestIP, s.cfg.Subnet.Bits()),
		Gateway:    s.cfg.Gateway,
		DNS:        s.cfg.DNS,
		MTU:        s.cfg.MTU,
		GatewayMAC: append(net.HardwareAddr(nil), s.cfg.GatewayMAC...),
	}
}

// Stats returns a snapshot of the counters.
func (s *Stack) Stats() Stats {
	return Stats{
		FramesIn:    s.stats.framesIn.Load(),
		DroppedIn:   s.stats.droppedIn.Load(),
		FramesOut:   s.link.framesOut.Load(),
		DroppedOut:  s.link.droppedOut.Load(),
		TCPForward:  s.stats.tcpForwarded.Load(),
		TCPRefused:  s.stats.tcpRefused.Load(),
		UDPForward:  s.stats.udpForwarded.Load(),
		UDPRefused:  s.stats.udpRefused.Load(),
		DNSQueries:  s.stats.dnsQueries.Load(),
		DNSRefused:  s.stats.dnsRefused.Load(),
		PublishedIn: s.stats.publishedTCP.Load() + s.stats.publishedUDPIn.Load(),
		TCPActive:   s.tcpConns.Load(),
		UDPActive:   s.udpFlows.Load(),
	}
}

// ReadFrame returns the next Ethernet frame for the guest, blocking until
// one is queued, ctx is done or the stack is closed (ErrClosed). The frame
// is the caller's.
func (s *Stack) ReadFrame(ctx context.Context) ([]byte, error) {
	return s.link.read(ctx)
}

// TryReadFrame returns a queued frame for the guest without blocking.
func (s *Stack) TryReadFrame() ([]byte, bool) {
	return s.link.tryRead()
}

// DeliverFrame hands the stack an Ethernet frame (no FCS, no virtio header)
// sent by the guest. The frame is copied; the caller may reuse it. Frames
// that are not for the stack or violate the guest's identity (source MAC or
// IP) are dropped silently and counted; unparsable frames are dropped and
// reported with an error wrapping ErrMalformedFrame, which the caller should
// count, not treat as fatal. After Close it returns ErrClosed.
func (s *Stack) DeliverFrame(frame []byte) error {
	select {
	case <-s.link.done:
		return ErrClosed
	default:
	}
	ok, err := s.filterFrame(frame)
	if err != nil || !ok {
		s.stats.droppedIn.Add(1)
		return err
	}
	if !s.link.deliver(append([]byte(nil), frame...)) {
		return ErrClosed
	}
	s.stats.framesIn.Add(1)
	return nil
}

// filterFrame validates a guest frame. It reports whether to deliver it.
func (s *Stack) filterFrame(frame []byte) (bool, error) {
	if len(frame) < header.EthernetMinimumSize {
		return false, malformed("%d bytes, shorter than an Ethernet header", len(frame))
	}
	if len(frame) > header.EthernetMinimumSize+int(s.cfg.MTU) {
		return false, malformed("%d bytes, longer than MTU %d plus Ethernet header", len(frame), s.cfg.MTU)
	}
	eth := header.Ethernet(frame)
	src, dst := eth.SourceAddress(), eth.DestinationAddress()
	if header.IsMulticastEthernetAddress(src) {
		return false, nil
	}
	if s.cfg.GuestMAC != nil && string(src) != string(s.cfg.GuestMAC) {
		return false, nil
	}
	if dst != header.EthernetBroadcastAddress && dst != s.link.mac {
		return false, nil // multicast (IPv6 ND, mDNS...) or another host
	}
	payload := frame[header.EthernetMinimumSize:]
	switch eth.Type() {
	case header.ARPProtocolNumber:
		if len(payload) < header.ARPSize {
			return false, malformed("ARP packet of %d bytes", len(payload))
		}
		a := header.ARP(payload)
		if !a.IsValid() {
			return false, malformed("ARP packet is not IPv4 over Ethernet")
		}
		sender := netip.AddrFrom4([4]byte(a.ProtocolAddressSender()))
		target := netip.AddrFrom4([4]byte(a.ProtocolAddressTarget()))
		if sender != s.cfg.GuestIP {
			return false, nil // includes ARP probes (sender 0.0.0.0)
		}
		if string(a.HardwareAddressSender()) != string(src) {
			return false, nil
		}
		// Answer for the stack's own addresses and for anything off the
		// subnet; never for the guest's own address (that would look like
		// an address conflict) or other on-link addresses.
		if a.Op() == header.ARPRequest && target != s.cfg.Gateway && target != s.cfg.DNS && s.cfg.Subnet.Contains(target) {
			return false, nil
		}
		return true, nil
	case header.IPv4ProtocolNumber:
		if dst == header.EthernetBroadcastAddress {
			return false, nil // no DHCP or other broadcast services
		}
		if len(payload) < header.IPv4MinimumSize {
			return false, malformed("IPv4 packet of %d bytes", len(payload))
		}
		ip := header.IPv4(payload)
		if !ip.IsValid(len(payload)) {
			return false, malformed("invalid IPv4 header")
		}
		if netip.AddrFrom4(ip.SourceAddress().As4()) != s.cfg.GuestIP {
			return false, nil // spoofed source
		}
		ipDst := netip.AddrFrom4(ip.DestinationAddress().As4())
		if ipDst.IsMulticast() || ipDst == netip.AddrFrom4([4]byte{255, 255, 255, 255}) || ipDst == s.subnetBroadcast() {
			return false, nil
		}
		// Ping is answered only for the stack's own addresses; answering
		// for every destination would fake reachability.
		if ip.TransportProtocol() == header.ICMPv4ProtocolNumber && ipDst != s.cfg.Gateway && ipDst != s.cfg.DNS {
			if hl := int(ip.HeaderLength()); len(payload) > hl && header.ICMPv4Type(payload[hl]) == header.ICMPv4Echo {
				return false, nil
			}
		}
		return true, nil
	default:
		return false, nil // IPv6 and the rest: not supported
	}
}

func (s *Stack) subnetBroadcast() netip.Addr {
	b := s.cfg.Subnet.Addr().As4()
	bits := s.cfg.Subnet.Bits()
	for i := range 4 {
		keep := min(max(bits-8*i, 0), 8)
		b[i] |= byte(0xff >> keep)
	}
	return netip.AddrFrom4(b)
}

// Close stops the stack: closes the published listeners and every forwarded
// connection, then the gVisor stack. ReadFrame and DeliverFrame return
// ErrClosed afterwards. It is safe to call more than once.
func (s *Stack) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	closers := s.closers
	s.closers = nil
	s.mu.Unlock()

	s.cancel()
	for c := range closers {
		_ = c.Close()
	}
	s.stack.Close()
	s.wg.Wait()
	s.stack.Wait()
	s.link.Close()
	s.log.Info("netstack closed")
	return nil
}

// track registers c to be closed by Close. It returns false (and closes c)
// if the stack is already closed.
func (s *Stack) track(c io.Closer) bool {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = c.Close()
		return false
	}
	s.closers[c] = struct{}{}
	s.mu.Unlock()
	return true
}

func (s *Stack) untrack(c io.Closer) {
	s.mu.Lock()
	if s.closers != nil {
		delete(s.closers, c)
	}
	s.mu.Unlock()
}

// enter registers a goroutine Close must wait for (the caller defers
// s.wg.Done()); false if the stack is closed.
func (s *Stack) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

// goroutine runs f in a goroutine Close waits for; false if closed.
func (s *Stack) goroutine(f func()) bool {
	if !s.enter() {
		return false
	}
	go func() {
		defer s.wg.Done()
		f()
	}()
	return true
}

// hostTarget maps a guest-visible destination to the host-side address:
// the gateway stands for the host's loopback; other on-subnet addresses and
// non-unicast destinations have no host side.
func (s *Stack) hostTarget(dst netip.Addr) (netip.Addr, bool) {
	switch {
	case dst == s.cfg.Gateway:
		return hostLoopback, true
	case s.cfg.Subnet.Contains(dst), !dst.IsValid(), dst.IsMulticast(), dst.IsUnspecified():
		return netip.Addr{}, false
	}
	return dst, true
}

// decide checks the policy for a guest flow to dst (guest-visible) with
// host-side address host.
func (s *Stack) decide(proto string, dst, host netip.Addr, port uint16) (Verdict, []string) {
	names := s.names.lookup(dst, time.Now())
	return s.policy.Load().check(&request{proto: proto, addr: host, port: port, names: names}, s.hosts.contains), names
}

// Policy is the policy in force.
func (s *Stack) Policy() *Policy { return s.policy.Load() }

// SetPolicy puts p in force (nil: PublicOnly) for every flow and DNS
// query from now on. Flows under way go on: a TCP connection or UDP flow
// the old policy let through is not cut.
func (s *Stack) SetPolicy(p *Policy) {
	if p == nil {
		p = PublicOnly()
	}
	s.policy.Store(p)
	s.log.Info("netstack: policy set", "policy", p.String())
}

// logDenied logs refused flows, rate limited so a guest cannot flood logs.
func (s *Stack) logDenied(msg string, args ...any) {
	if s.denLog.allow(time.Now()) {
		s.log.Info(msg, args...)
	}
}

func toTCPIP(a netip.Addr) tcpip.Address {
	if a.Is4() {
		return tcpip.AddrFrom4(a.As4())
	}
	return tcpip.AddrFrom16(a.As16())
}

func fromTCPIP(a tcpip.Address) netip.Addr {
	switch a.Len() {
	case 4:
		return netip.AddrFrom4(a.As4())
	case 16:
		return netip.AddrFrom16(a.As16()).Unmap()
	}
	return netip.Addr{}
}

// logLimiter admits at most logBurst messages per second.
type logLimiter struct {
	mu     sync.Mutex
	window time.Time
	n      int
}

const logBurst = 20

func (l *logLimiter) allow(now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.window) >= time.Second {
		l.window, l.n = now, 0
	}
	l.n++
	return l.n <= logBurst
}
