package netstack

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
	"gvisor.dev/gvisor/pkg/waiter"
)

const maxDatagram = 65535

// handleUDP runs synchronously for the first datagram of each guest UDP
// flow (4-tuple) no endpoint claims. It creates a connected endpoint that
// owns the flow (queuing that first datagram) and relays it to a host
// socket in a goroutine. Returning false makes gVisor answer with ICMP port
// unreachable, which is how policy refusals surface.
func (s *Stack) handleUDP(r *udp.ForwarderRequest) bool {
	id := r.ID()
	dst, port := fromTCPIP(id.LocalAddress), id.LocalPort
	if fromTCPIP(id.RemoteAddress) != s.cfg.GuestIP {
		return true // drop
	}
	if port == dnsPort {
		// Plain DNS to any server is answered by our DNS server, so the
		// policy's domain rules and rebinding protection apply to it.
		c := s.createUDPFlow(r)
		if c != nil && !s.goroutine(func() { s.serveDNSFlow(c) }) {
			s.udpFlows.Add(-1)
			s.untrack(c)
			c.Close()
		}
		return true
	}
	host, ok := s.hostTarget(dst)
	if !ok {
		s.stats.udpRefused.Add(1)
		return false
	}
	v, names := s.decide("udp", dst, host, port)
	if !v.Allowed {
		s.stats.udpRefused.Add(1)
		s.logDenied("UDP flow refused by policy", "dst", netip.AddrPortFrom(dst, port),
			"host", host, "names", names, "reason", v.Reason)
		return false
	}
	c := s.createUDPFlow(r)
	if c == nil {
		return true
	}
	s.stats.udpForwarded.Add(1)
	hostAddr := netip.AddrPortFrom(host, port).String()
	if !s.goroutine(func() { s.relayUDPFlow(c, hostAddr) }) {
		s.udpFlows.Add(-1)
		s.untrack(c)
		c.Close()
	}
	return true
}

// createUDPFlow claims the flow with a connected endpoint, counted in
// udpFlows and tracked for Close; nil if over the limit or failed.
func (s *Stack) createUDPFlow(r *udp.ForwarderRequest) *gonet.UDPConn {
	if s.udpFlows.Add(1) > int64(s.cfg.MaxUDPFlows) {
		s.udpFlows.Add(-1)
		s.stats.udpRefused.Add(1)
		s.logDenied("UDP flow dropped", "reason", "flow limit reached")
		return nil
	}
	var wq waiter.Queue
	ep, err := r.CreateEndpoint(&wq)
	if err != nil {
		s.udpFlows.Add(-1)
		s.log.Debug("UDP flow", "err", tcpipErr("create endpoint", err))
		return nil
	}
	c := gonet.NewUDPConn(&wq, ep)
	if !s.track(c) {
		s.udpFlows.Add(-1)
		return nil
	}
	return c
}

func (s *Stack) relayUDPFlow(gc *gonet.UDPConn, hostAddr string) {
	defer s.udpFlows.Add(-1)
	defer s.untrack(gc)
	defer gc.Close()

	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.DialTimeout)
	hc, err := s.cfg.Dial(ctx, "udp", hostAddr)
	cancel()
	if err != nil {
		s.log.Debug("UDP dial failed", "addr", hostAddr, "err", err)
		return
	}
	if !s.track(hc) {
		return
	}
	defer s.untrack(hc)
	defer hc.Close()
	relayDatagrams(gc, hc, s.cfg.UDPIdleTimeout)
}

// relayDatagrams copies datagrams both ways between two connected sockets
// until neither side has sent anything for idle, or one fails.
func relayDatagrams(a, b net.Conn, idle time.Duration) {
	var last atomic.Int64
	last.Store(time.Now().UnixNano())
	done := make(chan struct{}, 2)
	one := func(dst, src net.Conn) {
		defer func() { done <- struct{}{} }()
		buf := make([]byte, maxDatagram)
		for {
			_ = src.SetReadDeadline(time.Now().Add(idle))
			n, err := src.Read(buf)
			if err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					if time.Since(time.Unix(0, last.Load())) < idle {
						continue
					}
					return
				}
				if errors.Is(err, syscall.ECONNREFUSED) {
					continue // ICMP unreachable from an earlier datagram
				}
				return
			}
			last.Store(time.Now().UnixNano())
			if _, err := dst.Write(buf[:n]); err != nil && !errors.Is(err, syscall.ECONNREFUSED) {
				return
			}
		}
	}
	go one(b, a)
	go one(a, b)
	<-done
	a.Close()
	b.Close()
	<-done
}
