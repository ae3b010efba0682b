package netstack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
)

// PortMapping publishes a host port: connections (TCP) or datagrams (UDP)
// arriving at HostIP:HostPort are forwarded to the guest's GuestPort. The
// guest sees them coming from the gateway address.
type PortMapping struct {
	Proto     string     // "tcp" (default) or "udp"
	HostIP    netip.Addr // default 127.0.0.1
	HostPort  uint16     // 0 picks a free port; see Stack.Published
	GuestPort uint16
}

func (m PortMapping) String() string {
	proto := m.Proto
	if proto == "" {
		proto = "tcp"
	}
	host := "127.0.0.1"
	if m.HostIP.IsValid() {
		host = m.HostIP.String()
	}
	return net.JoinHostPort(host, strconv.Itoa(int(m.HostPort))) + ":" + strconv.Itoa(int(m.GuestPort)) + "/" + proto
}

func (m PortMapping) validate() error {
	switch m.Proto {
	case "", "tcp", "udp":
	default:
		return fmt.Errorf("protocol %q: want tcp or udp", m.Proto)
	}
	if m.GuestPort == 0 {
		return errors.New("guest port 0: want 1-65535")
	}
	if m.HostIP.IsValid() && m.HostIP.Zone() != "" {
		return fmt.Errorf("host IP %s: zones are not supported", m.HostIP)
	}
	return nil
}

// ParsePublish parses "[HOSTIP:]HOSTPORT:GUESTPORT[/udp|/tcp]", e.g.
// "8080:80", "0.0.0.0:8443:443", "[::1]:5353:53/udp". HOSTIP defaults to
// 127.0.0.1; HOSTPORT 0 picks a free port.
func ParsePublish(s string) (PortMapping, error) {
	m := PortMapping{Proto: "tcp", HostIP: hostLoopback}
	fail := func(format string, args ...any) (PortMapping, error) {
		return PortMapping{}, fmt.Errorf("netstack: publish %q: "+format, append([]any{s}, args...)...)
	}
	rest := strings.TrimSpace(s)
	if i := strings.LastIndexByte(rest, '/'); i >= 0 {
		switch p := strings.ToLower(rest[i+1:]); p {
		case "tcp", "udp":
			m.Proto = p
		default:
			return fail("protocol %q: want tcp or udp", rest[i+1:])
		}
		rest = rest[:i]
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 0 {
		return fail("want [HOSTIP:]HOSTPORT:GUESTPORT")
	}
	guest, rest := rest[i+1:], rest[:i]
	gp, err := strconv.ParseUint(guest, 10, 16)
	if err != nil || gp == 0 {
		return fail("guest port %q: want 1-65535", guest)
	}
	m.GuestPort = uint16(gp)

	hostPort := rest
	if j := strings.LastIndexByte(rest, ':'); j >= 0 {
		ip, port := rest[:j], rest[j+1:]
		if strings.HasPrefix(ip, "[") && strings.HasSuffix(ip, "]") {
			ip = ip[1 : len(ip)-1]
		} else if strings.Contains(ip, ":") {
			return fail("host IP %q: put IPv6 addresses in brackets, as [::1]", ip)
		}
		a, err := netip.ParseAddr(ip)
		if err != nil {
			return fail("host IP %q: not an IP address", ip)
		}
		if a.Zone() != "" {
			return fail("host IP %q: zones are not supported", ip)
		}
		m.HostIP = a.Unmap()
		hostPort = port
	}
	hp, err := strconv.ParseUint(hostPort, 10, 16)
	if err != nil {
		return fail("host port %q: want 0-65535", hostPort)
	}
	m.HostPort = uint16(hp)
	return m, nil
}

// Published is an opened port mapping and the host address it listens on.
type Published struct {
	Mapping PortMapping
	Addr    net.Addr // *net.TCPAddr or *net.UDPAddr
}

// Published lists the opened port mappings, in Config.Publish order.
func (s *Stack) Published() []Published {
	return append([]Published(nil), s.published...)
}

func (s *Stack) startPublish() error {
	for _, m := range s.cfg.Publish {
		ip := m.HostIP
		if !ip.IsValid() {
			ip = hostLoopback
		}
		addr := netip.AddrPortFrom(ip, m.HostPort).String()
		if !ip.IsLoopback() {
			s.log.Warn("publishing a guest port beyond loopback", "host", addr, "guest_port", m.GuestPort)
		}
		var lc net.ListenConfig
		if m.Proto == "udp" {
			pc, err := lc.ListenPacket(s.ctx, "udp", addr)
			if err != nil {
				return fmt.Errorf("netstack: publish %s: %w", m, err)
			}
			if !s.track(pc) {
				return ErrClosed
			}
			s.published = append(s.published, Published{Mapping: m, Addr: pc.LocalAddr()})
			s.goroutine(func() { s.servePublishedUDP(pc, m.GuestPort) })
			continue
		}
		l, err := lc.Listen(s.ctx, "tcp", addr)
		if err != nil {
			return fmt.Errorf("netstack: publish %s: %w", m, err)
		}
		if !s.track(l) {
			return ErrClosed
		}
		s.published = append(s.published, Published{Mapping: m, Addr: l.Addr()})
		s.goroutine(func() { s.servePublishedTCP(l, m.GuestPort) })
	}
	return nil
}

func (s *Stack) guestAddr(port uint16) tcpip.FullAddress {
	return tcpip.FullAddress{NIC: nicID, Addr: toTCPIP(s.cfg.GuestIP), Port: port}
}

func (s *Stack) servePublishedTCP(l net.Listener, guestPort uint16) {
	for {
		hc, err := l.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if !errors.Is(err, net.ErrClosed) {
				s.log.Warn("published port accept failed", "addr", l.Addr(), "err", err)
			}
			return
		}
		if s.tcpConns.Add(1) > int64(s.cfg.MaxConns) {
			s.tcpConns.Add(-1)
			s.logDenied("published connection dropped", "reason", "connection limit reached")
			hc.Close()
			continue
		}
		if !s.goroutine(func() {
			defer s.tcpConns.Add(-1)
			ctx, cancel := context.WithTimeout(s.ctx, s.cfg.DialTimeout)
			gc, err := gonet.DialContextTCP(ctx, s.stack, s.guestAddr(guestPort), ipv4.ProtocolNumber)
			cancel()
			if err != nil {
				s.log.Debug("published connection: guest dial failed", "guest_port", guestPort, "err", err)
				if tc, ok := hc.(*net.TCPConn); ok {
					_ = tc.SetLinger(0) // RST: the guest refused
				}
				hc.Close()
				return
			}
			s.stats.publishedTCP.Add(1)
			s.splice(gc, hc, nil)
		}) {
			s.tcpConns.Add(-1)
			hc.Close()
			return
		}
	}
}

// servePublishedUDP forwards datagrams from each host peer to the guest
// over a per-peer flow (its own source port on the gateway address), and
// the guest's replies back to that peer.
func (s *Stack) servePublishedUDP(pc net.PacketConn, guestPort uint16) {
	type flow struct {
		c    *gonet.UDPConn
		last atomic.Int64 // unix nanoseconds of the last datagram either way
	}
	var mu sync.Mutex
	flows := make(map[string]*flow)
	buf := make([]byte, maxDatagram)
	dst := s.guestAddr(guestPort)
	for {
		n, peer, err := pc.ReadFrom(buf)
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.log.Warn("published UDP port read failed", "addr", pc.LocalAddr(), "err", err)
			}
			return
		}
		key := peer.String()
		mu.Lock()
		f := flows[key]
		mu.Unlock()
		if f == nil {
			if s.udpFlows.Add(1) > int64(s.cfg.MaxUDPFlows) {
				s.udpFlows.Add(-1)
				continue
			}
			c, err := gonet.DialUDP(s.stack, nil, &dst, ipv4.ProtocolNumber)
			if err != nil {
				s.udpFlows.Add(-1)
				s.log.Debug("published UDP flow", "err", err)
				continue
			}
			if !s.track(c) {
				s.udpFlows.Add(-1)
				return
			}
			f = &flow{c: c}
			f.last.Store(time.Now().UnixNano())
			mu.Lock()
			flows[key] = f
			mu.Unlock()
			s.stats.publishedUDPIn.Add(1)
			started := s.goroutine(func() {
				defer s.udpFlows.Add(-1)
				defer s.untrack(c)
				defer c.Close()
				defer func() {
					mu.Lock()
					delete(flows, key)
					mu.Unlock()
				}()
				rbuf := make([]byte, maxDatagram)
				for {
					_ = c.SetReadDeadline(time.Now().Add(s.cfg.UDPIdleTimeout))
					n, err := c.Read(rbuf)
					if err != nil {
						var ne net.Error
						if errors.As(err, &ne) && ne.Timeout() &&
							time.Since(time.Unix(0, f.last.Load())) < s.cfg.UDPIdleTimeout {
							continue
						}
						return
					}
					f.last.Store(time.Now().UnixNano())
					if _, err := pc.WriteTo(rbuf[:n], peer); err != nil && errors.Is(err, net.ErrClosed) {
						return
					}
				}
			})
			if !started {
				s.udpFlows.Add(-1)
				s.untrack(c)
				c.Close()
				return
			}
		}
		f.last.Store(time.Now().UnixNano())
		_, _ = f.c.Write(buf[:n])
	}
}
