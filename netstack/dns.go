package netstack

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
)

const (
	dnsPort         = 53
	dnsTTL          = 30  // seconds, in answers to the guest
	dnsMaxAnswers   = 16  // keeps a UDP answer under 512 bytes
	dnsMaxInFlight  = 64  // concurrent UDP queries; more are dropped (the guest retries)
	dnsUDPSize      = 512 // answers over UDP without EDNS
	dnsQueryTimeout = 5 * time.Second
	dnsTCPIdle      = 10 * time.Second
	dnsFlowIdle     = 10 * time.Second
	// nameRecordTTL is how long a name→IP record made by a DNS answer keeps
	// admitting connections under domain allow rules. It outlives the
	// answer's TTL so that guest-side caching does not break connections.
	nameRecordTTL = 10 * time.Minute
)

// startDNS serves DNS on the DNS address, UDP and TCP port 53.
func (s *Stack) startDNS() error {
	addr := tcpip.FullAddress{NIC: nicID, Addr: toTCPIP(s.cfg.DNS), Port: dnsPort}
	uc, err := gonet.DialUDP(s.stack, &addr, nil, ipv4.ProtocolNumber)
	if err != nil {
		return fmt.Errorf("netstack: DNS server: listen UDP: %w", err)
	}
	tl, err := gonet.ListenTCP(s.stack, addr, ipv4.ProtocolNumber)
	if err != nil {
		uc.Close()
		return fmt.Errorf("netstack: DNS server: listen TCP: %w", err)
	}
	if !s.track(uc) || !s.track(tl) {
		return ErrClosed
	}
	s.goroutine(func() { s.serveDNSUDP(uc) })
	s.goroutine(func() { s.serveDNSTCP(tl) })
	return nil
}

func (s *Stack) serveDNSUDP(pc *gonet.UDPConn) {
	sem := make(chan struct{}, dnsMaxInFlight)
	buf := make([]byte, 65535)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		select {
		case sem <- struct{}{}:
		default:
			continue // overloaded: drop, the guest retries
		}
		q := append([]byte(nil), buf[:n]...)
		if !s.goroutine(func() {
			defer func() { <-sem }()
			if resp := s.answerDNS(q, dnsUDPSize, from.String(), s.dnsAddr()); resp != nil {
				_, _ = pc.WriteTo(resp, from)
			}
		}) {
			return
		}
	}
}

func (s *Stack) serveDNSTCP(l *gonet.TCPListener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		if s.tcpConns.Add(1) > int64(s.cfg.MaxConns) {
			s.tcpConns.Add(-1)
			c.Close()
			continue
		}
		if !s.track(c) {
			s.tcpConns.Add(-1)
			return
		}
		if !s.goroutine(func() {
			defer s.tcpConns.Add(-1)
			defer s.untrack(c)
			defer c.Close()
			s.serveDNSStream(c, c.RemoteAddr().String(), s.dnsAddr())
		}) {
			s.tcpConns.Add(-1)
			return
		}
	}
}

func (s *Stack) serveDNSStream(c net.Conn, src, dst string) {
	var lenBuf [2]byte
	for {
		_ = c.SetReadDeadline(time.Now().Add(dnsTCPIdle))
		if _, err := io.ReadFull(c, lenBuf[:]); err != nil {
			return
		}
		q := make([]byte, binary.BigEndian.Uint16(lenBuf[:]))
		if _, err := io.ReadFull(c, q); err != nil {
			return
		}
		resp := s.answerDNS(q, 65535, src, dst)
		if resp == nil {
			return
		}
		out := binary.BigEndian.AppendUint16(make([]byte, 0, 2+len(resp)), uint16(len(resp)))
		if _, err := c.Write(append(out, resp...)); err != nil {
			return
		}
	}
}

// serveDNSFlow answers queries on an intercepted UDP flow to some other
// server's port 53 (connected endpoint), until idle.
func (s *Stack) serveDNSFlow(c net.Conn) {
	defer s.udpFlows.Add(-1)
	defer s.untrack(c)
	defer c.Close()
	buf := make([]byte, 65535)
	for {
		_ = c.SetReadDeadline(time.Now().Add(dnsFlowIdle))
		n, err := c.Read(buf)
		if err != nil {
			return
		}
		if resp := s.answerDNS(buf[:n], dnsUDPSize, c.RemoteAddr().String(), c.LocalAddr().String()); resp != nil {
			_, _ = c.Write(resp)
		}
	}
}

// answerDNS builds the answer to one query from the guest's src to the
// server dst (both "IP:port"), and logs it (Config.Audit); nil means drop
// it.
func (s *Stack) answerDNS(query []byte, maxSize int, src, dst string) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil || h.Response {
		return nil
	}
	s.stats.dnsQueries.Add(1)
	truncated := false
	var reply func(rcode dnsmessage.RCode, q *dnsmessage.Question, ips []netip.Addr) []byte
	reply = func(rcode dnsmessage.RCode, q *dnsmessage.Question, ips []netip.Addr) []byte {
		b := dnsmessage.NewBuilder(make([]byte, 0, 512), dnsmessage.Header{
			ID: h.ID, Response: true, OpCode: h.OpCode, RecursionDesired: h.RecursionDesired,
			RecursionAvailable: true, Truncated: truncated, RCode: rcode,
		})
		b.EnableCompression()
		if q == nil {
			if err := b.StartQuestions(); err != nil {
				return nil
			}
			msg, _ := b.Finish()
			return msg
		}
		if b.StartQuestions() != nil || b.Question(*q) != nil || b.StartAnswers() != nil {
			return nil
		}
		for _, ip := range ips {
			rh := dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: dnsTTL}
			if err := b.AResource(rh, dnsmessage.AResource{A: ip.As4()}); err != nil {
				return nil
			}
		}
		msg, err := b.Finish()
		if err != nil {
			return nil
		}
		if len(msg) > maxSize && !truncated {
			// Too big for UDP: an empty truncated answer makes the guest
			// retry over TCP.
			truncated = true
			return reply(rcode, q, nil)
		}
		return msg
	}
	rec := Flow{Kind: "dns", Event: "answer", Src: src, Dst: dst}
	// answer logs the reply, as Event says (refusals rate limited), and
	// builds it.
	answer := func(rcode dnsmessage.RCode, q *dnsmessage.Question, ips []netip.Addr) []byte {
		rec.RCode = strings.TrimPrefix(rcode.String(), "RCode")
		for _, ip := range ips {
			rec.Answers = append(rec.Answers, ip.String())
		}
		if rec.Event == "answer" {
			s.audit.log(rec)
		} else {
			s.audit.refused(rec)
		}
		return reply(rcode, q, ips)
	}
	if h.OpCode != 0 {
		rec.Event, rec.Reason = "refused", "not a standard query"
		return answer(dnsmessage.RCodeNotImplemented, nil, nil)
	}
	qs, err := p.AllQuestions()
	if err != nil || len(qs) != 1 {
		rec.Event, rec.Reason = "refused", "malformed, or not one question"
		return answer(dnsmessage.RCodeFormatError, nil, nil)
	}
	q := qs[0]
	name := strings.ToLower(strings.TrimSuffix(q.Name.String(), "."))
	rec.Name, rec.QType = name, strings.TrimPrefix(q.Type.String(), "Type")
	if q.Class != dnsmessage.ClassINET || name == "" {
		rec.Event, rec.Reason = "refused", "not an Internet-class name"
		return answer(dnsmessage.RCodeRefused, &q, nil)
	}
	policy := s.policy.Load() // one policy for the whole query
	refused, v := policy.nameRefused(name)
	rec.Rule = v.Rule
	if refused {
		s.stats.dnsRefused.Add(1)
		s.audit.count("dns", false, v.Rule)
		s.logDenied("DNS query refused", "name", name, "reason", v.Reason)
		rec.Event, rec.Reason = "refused", v.Reason
		return answer(dnsmessage.RCodeNameError, &q, nil)
	}
	s.audit.count("dns", true, v.Rule)
	switch q.Type {
	case dnsmessage.TypeA:
	case dnsmessage.TypeAAAA:
		// The guest network is IPv4 only: the name may exist, it just has
		// no address the guest can use (NODATA).
		return answer(dnsmessage.RCodeSuccess, &q, nil)
	default:
		return answer(dnsmessage.RCodeNotImplemented, &q, nil)
	}

	ctx, cancel := context.WithTimeout(s.ctx, dnsQueryTimeout)
	defer cancel()
	// A rooted name: the host's search domains must not apply.
	ips, err := s.cfg.Resolver.LookupNetIP(ctx, "ip4", name+".")
	if err != nil {
		var de *net.DNSError
		if errors.As(err, &de) && de.IsNotFound {
			return answer(dnsmessage.RCodeNameError, &q, nil)
		}
		s.log.Debug("DNS lookup failed", "name", name, "err", err)
		rec.Event, rec.Error = "failed", err.Error()
		return answer(dnsmessage.RCodeServerFailure, &q, nil)
	}
	kept, dropped := ips[:0], 0
	for _, ip := range ips {
		ip = ip.Unmap()
		if !ip.Is4() {
			continue
		}
		if !policy.answerAllowed(ip, s.hosts.contains) {
			s.logDenied("DNS answer dropped by policy", "name", name, "addr", ip)
			dropped++
			continue
		}
		kept = append(kept, ip)
		if len(kept) == dnsMaxAnswers {
			break
		}
	}
	if dropped > 0 {
		rec.Reason = fmt.Sprintf("%d addresses left out of the answer by the policy (not public, or denied)", dropped)
	}
	s.names.record(name, kept, time.Now())
	return answer(dnsmessage.RCodeSuccess, &q, kept)
}

// dnsAddr is the NAT's DNS server's address, as a Flow gives it.
func (s *Stack) dnsAddr() string { return netip.AddrPortFrom(s.cfg.DNS, dnsPort).String() }

// nameCache remembers which names the guest resolved to which addresses, so
// domain rules can be applied when it connects.
type nameCache struct {
	mu   sync.Mutex
	max  int
	byIP map[netip.Addr]map[string]time.Time // name → expiry
}

const maxNamesPerIP = 32

func newNameCache(max int) *nameCache {
	return &nameCache{max: max, byIP: make(map[netip.Addr]map[string]time.Time)}
}

func (c *nameCache) record(name string, ips []netip.Addr, now time.Time) {
	exp := now.Add(nameRecordTTL)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, ip := range ips {
		m := c.byIP[ip]
		if m == nil {
			if len(c.byIP) >= c.max {
				c.evictLocked(now)
			}
			m = make(map[string]time.Time)
			c.byIP[ip] = m
		}
		if _, ok := m[name]; !ok && len(m) >= maxNamesPerIP {
			for n, e := range m {
				if now.After(e) {
					delete(m, n)
				}
			}
			for n := range m {
				if len(m) < maxNamesPerIP {
					break
				}
				delete(m, n)
			}
		}
		m[name] = exp
	}
}

// evictLocked drops expired records, then arbitrary ones down to 3/4 full.
func (c *nameCache) evictLocked(now time.Time) {
	for ip, m := range c.byIP {
		for n, e := range m {
			if now.After(e) {
				delete(m, n)
			}
		}
		if len(m) == 0 {
			delete(c.byIP, ip)
		}
	}
	for ip := range c.byIP {
		if len(c.byIP) <= c.max*3/4 {
			break
		}
		delete(c.byIP, ip)
	}
}

func (c *nameCache) lookup(ip netip.Addr, now time.Time) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var names []string
	for n, e := range c.byIP[ip] {
		if now.Before(e) {
			names = append(names, n)
		}
	}
	return names
}
