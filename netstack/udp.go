package netstack

import (
	"context"
	"errors"
	"fmt"
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
		if c == nil {
			s.stats.udpRefused.Add(1)
		} else if !s.goroutine(func() { s.serveDNSFlow(c) }) {
			s.udpFlows.Add(-1)
			s.untrack(c)
			c.Close()
		}
		return true
	}
	dstAP, srcAP := netip.AddrPortFrom(dst, port), netip.AddrPortFrom(fromTCPIP(id.RemoteAddress), id.RemotePort)
	refuse := func(rec Flow, rule, reason string) {
		s.stats.udpRefused.Add(1)
		s.audit.count("udp", false, rule)
		rec.Event, rec.Rule, rec.Reason = "refused", rule, reason
		s.audit.refused(rec)
	}
	host, ok := s.hostTarget(dst)
	if !ok {
		refuse(flowRecord("udp", srcAP, dstAP, netip.Addr{}, nil), "no host-side destination", "the address is in the guest's subnet or not unicast")
		return false
	}
	v, names := s.decide("udp", dst, host, port)
	rec := flowRecord("udp", srcAP, dstAP, host, names)
	rec.Rule, rec.Reason = v.Rule, v.Reason
	if !v.Allowed {
		s.logDenied("UDP flow refused by policy", "dst", dstAP,
			"host", host, "names", names, "reason", v.Reason)
		refuse(rec, v.Rule, v.Reason)
		return false
	}
	c := s.createUDPFlow(r)
	if c == nil {
		refuse(rec, "flow limit", fmt.Sprintf("%d UDP flows open, the most a sandbox may have, or the guest's side failed", s.cfg.MaxUDPFlows))
		return true
	}
	s.stats.udpForwarded.Add(1)
	s.audit.count("udp", true, v.Rule)
	hostAddr := netip.AddrPortFrom(host, port).String()
	if !s.goroutine(func() { s.relayUDPFlow(c, hostAddr, rec) }) {
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

// relayUDPFlow relays the flow whose record is rec (Rule set) until it
// goes idle, logging its open and close.
func (s *Stack) relayUDPFlow(gc *gonet.UDPConn, hostAddr string, rec Flow) {
	defer s.udpFlows.Add(-1)
	defer s.untrack(gc)
	defer gc.Close()

	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.DialTimeout)
	hc, err := s.cfg.Dial(ctx, "udp", hostAddr)
	cancel()
	if err != nil {
		s.log.Debug("UDP dial failed", "addr", hostAddr, "err", err)
		rec.Event, rec.Error = "failed", err.Error()
		s.audit.refused(rec)
		return
	}
	if !s.track(hc) {
		return
	}
	defer s.untrack(hc)
	defer hc.Close()
	counted, closed := s.audit.opened(rec, gc)
	defer closed()
	relayDatagrams(counted, hc, s.cfg.UDPIdleTimeout)
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
