package netstack

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"

	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/waiter"
)

const spliceBufSize = 32 << 10

// handleTCP runs (in its own goroutine, started by the gVisor forwarder) for
// each SYN from the guest that no local endpoint claims. The handshake with
// the guest is completed only once the host dial succeeded; any refusal or
// failure answers the SYN with RST so the guest's connect fails at once.
func (s *Stack) handleTCP(r *tcp.ForwarderRequest) {
	if !s.enter() {
		r.Complete(true)
		return
	}
	defer s.wg.Done()

	id := r.ID()
	dst, port := fromTCPIP(id.LocalAddress), id.LocalPort
	src := fromTCPIP(id.RemoteAddress)
	if src != s.cfg.GuestIP {
		s.stats.tcpRefused.Add(1)
		r.Complete(true)
		return
	}
	dstAP, srcAP := netip.AddrPortFrom(dst, port), netip.AddrPortFrom(src, id.RemotePort)
	// refuse answers the SYN with RST, logging why: rule (a Verdict's, or
	// a bound's name) decided, or err failed.
	refuse := func(rec Flow, rule, reason string, err error) {
		s.stats.tcpRefused.Add(1)
		r.Complete(true)
		rec.Event, rec.Rule, rec.Reason = "refused", rule, reason
		// A flow that failed was allowed: its host's side could not be
		// reached.
		s.audit.count("tcp", err != nil, rule)
		if err != nil {
			rec.Event, rec.Error = "failed", err.Error()
		}
		s.audit.refused(rec)
	}
	host, ok := s.hostTarget(dst)
	if !ok {
		s.logDenied("TCP connection refused", "dst", dstAP, "reason", "no host-side destination")
		refuse(flowRecord("tcp", srcAP, dstAP, netip.Addr{}, nil), "no host-side destination", "the address is in the guest's subnet or not unicast", nil)
		return
	}
	v, names := s.decide("tcp", dst, host, port)
	rec := flowRecord("tcp", srcAP, dstAP, host, names)
	if !v.Allowed {
		s.logDenied("TCP connection refused by policy", "dst", dstAP,
			"host", host, "names", names, "reason", v.Reason)
		refuse(rec, v.Rule, v.Reason, nil)
		return
	}
	if s.tcpConns.Add(1) > int64(s.cfg.MaxConns) {
		s.tcpConns.Add(-1)
		s.logDenied("TCP connection refused", "dst", dstAP, "reason", "connection limit reached")
		refuse(rec, "connection limit", fmt.Sprintf("%d connections open, the most a sandbox may have", s.cfg.MaxConns), nil)
		return
	}
	defer s.tcpConns.Add(-1)

	hostAddr := netip.AddrPortFrom(host, port).String()
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.DialTimeout)
	hc, err := s.cfg.Dial(ctx, "tcp", hostAddr)
	cancel()
	if err != nil {
		s.log.Debug("TCP dial failed", "addr", hostAddr, "err", err)
		refuse(rec, v.Rule, v.Reason, err)
		return
	}

	var wq waiter.Queue
	ep, terr := r.CreateEndpoint(&wq)
	r.Complete(false)
	if terr != nil {
		// The guest gave up or the handshake failed; gVisor has answered.
		err := tcpipErr("create endpoint", terr)
		s.log.Debug("TCP accept from guest failed", "addr", hostAddr, "err", err)
		hc.Close()
		s.stats.tcpRefused.Add(1)
		s.audit.count("tcp", true, v.Rule)
		rec.Event, rec.Rule, rec.Error = "failed", v.Rule, err.Error()
		s.audit.refused(rec)
		return
	}
	s.stats.tcpForwarded.Add(1)
	s.audit.count("tcp", true, v.Rule)
	rec.Rule, rec.Reason = v.Rule, v.Reason
	if via, ok := hc.(interface{ Via() string }); ok {
		rec.Via = via.Via()
	}
	s.log.Debug("TCP forwarded", "dst", dstAP, "host", hostAddr, "names", names)
	counted, closed := s.audit.opened(rec, gonet.NewTCPConn(&wq, ep))
	defer closed()
	var guest net.Conn = counted
	if ic := s.cfg.Intercept; ic != nil {
		if guest = s.intercept(ic, guest, hc, dstAP, hostAddr); guest == nil {
			return
		}
	}
	s.splice(guest, hc, ep.Abort)
}

// intercept offers a connection to the Interceptor, with both sides
// tracked (Close ends them) meanwhile. It returns the guest side to
// relay, or nil if the Interceptor served it.
func (s *Stack) intercept(ic Interceptor, guest, host net.Conn, dst netip.AddrPort, hostAddr string) net.Conn {
	if !s.track(guest) {
		host.Close()
		return nil
	}
	defer s.untrack(guest)
	if !s.track(host) {
		guest.Close()
		return nil
	}
	defer s.untrack(host)
	redial := func(ctx context.Context) (net.Conn, error) {
		if s.tcpConns.Add(1) > int64(s.cfg.MaxConns) {
			s.tcpConns.Add(-1)
			return nil, fmt.Errorf("netstack: dial %s: connection limit reached", hostAddr)
		}
		ctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
		defer cancel()
		c, err := s.cfg.Dial(ctx, "tcp", hostAddr)
		if err != nil || !s.track(c) {
			s.tcpConns.Add(-1)
			if err == nil {
				err = ErrClosed
			}
			return nil, err
		}
		return &countedConn{Conn: c, release: func() { s.untrack(c); s.tcpConns.Add(-1) }}, nil
	}
	return ic.Intercept(guest, host, dst, redial)
}

// countedConn runs release once, at its first Close.
type countedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// splice copies both ways between a guest-side and a host-side connection,
// propagating half-close (FIN) and turning an error on either side into an
// abort (RST) of both. It returns when both directions are done.
func (s *Stack) splice(guest, host net.Conn, abortGuest func()) {
	if !s.track(guest) {
		host.Close()
		return
	}
	defer s.untrack(guest)
	if !s.track(host) {
		guest.Close()
		return
	}
	defer s.untrack(host)

	abort := func() {
		// A reset, where the host side is TCP (a *net.TCPConn, or a
		// tunnel's connection to its proxy).
		if tc, ok := host.(interface{ SetLinger(int) error }); ok {
			_ = tc.SetLinger(0)
		}
		host.Close()
		if abortGuest != nil {
			abortGuest()
		}
		guest.Close()
	}
	errc := make(chan error, 2)
	go func() { errc <- pipe(host, guest) }() // guest → host
	go func() { errc <- pipe(guest, host) }() // host → guest
	for range 2 {
		if err := <-errc; err != nil {
			abort()
		}
	}
	host.Close()
	guest.Close()
}

// pipe copies src to dst until EOF, then half-closes dst. It hides the
// ReaderFrom/WriterTo fast paths so the fixed buffer is used.
func pipe(dst, src net.Conn) error {
	buf := make([]byte, spliceBufSize)
	_, err := io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, buf)
	if err != nil {
		if errors.Is(err, net.ErrClosed) {
			return nil // closed by the other direction or by Close
		}
		return err
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	} else {
		dst.Close()
	}
	return nil
}
