package netstack

import (
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Flow is one line of a sandbox's egress audit log (Config.Audit): a DNS
// query with its answer or refusal, a TCP connection or UDP flow opened,
// refused, failed or closed, or a summary of refusals left out. Every
// string in it is the NAT's own or bounded (a name is at most 253 bytes,
// answers at most dnsMaxAnswers).
type Flow struct {
	Time time.Time `json:"time"`
	// Kind is "dns", "tcp", "udp" or "summary".
	Kind string `json:"kind"`
	// Event: for tcp and udp "open", "close", "refused" or "failed" (the
	// policy allowed it, the host's side could not be reached); for dns
	// "answer", "refused" (by the policy, NXDOMAIN) or "failed"
	// (SERVFAIL); for summary "refused".
	Event string `json:"event"`
	// Src is the guest's address and port; Dst the destination it asked
	// for; Host where the NAT connected instead, when not Dst (the
	// gateway's address stands for the host's loopback).
	Src  string `json:"src,omitempty"`
	Dst  string `json:"dst,omitempty"`
	Host string `json:"host,omitempty"`
	// Via names the proxy a TCP connection was tunneled through, when
	// Config.Dial's connection says (a Via method: package egressproxy's).
	Via string `json:"via,omitempty"`
	// Names are the names the guest resolved to Dst through the NAT's DNS.
	Names []string `json:"names,omitempty"`
	// Name, QType, Answers and RCode describe a DNS query and its answer.
	Name    string   `json:"name,omitempty"`
	QType   string   `json:"qtype,omitempty"`
	Answers []string `json:"answers,omitempty"`
	RCode   string   `json:"rcode,omitempty"`
	// Rule is the policy rule that decided (Verdict.Rule); Reason says why
	// in words; Error is what failed.
	Rule   string `json:"rule,omitempty"`
	Reason string `json:"reason,omitempty"`
	Error  string `json:"error,omitempty"`
	// At close: the bytes the guest sent (Out) and received (In), and how
	// long the flow lasted. A count of zero is left out of the JSON.
	BytesOut   int64 `json:"bytes_out,omitempty"`
	BytesIn    int64 `json:"bytes_in,omitempty"`
	DurationMS int64 `json:"duration_ms,omitempty"`
	// Suppressed, in a summary, is how many refusals it stands for: the
	// lines left out since the last one logged, past the rate a guest may
	// fill the log at.
	Suppressed uint64 `json:"suppressed,omitempty"`
}

// FlowCount is how many flows (TCP connections, UDP flows and DNS
// queries) of one kind a rule decided one way (Stack.FlowCounts).
type FlowCount struct {
	Kind    string `json:"kind"` // "tcp", "udp" or "dns"
	Allowed bool   `json:"allowed"`
	Rule    string `json:"rule"` // Verdict.Rule, or a bound's name ("connection limit")
	Count   uint64 `json:"count"`
}

// auditRefusals is how many refusals a second are logged line by line;
// past it they are counted, and a summary line says how many.
const auditRefusals = 50

// auditor writes a Stack's Flow records to Config.Audit and counts flows
// by rule. The rules are the policy's (and a few bounds' names), so the
// counts are bounded however many flows a guest opens.
type auditor struct {
	fn func(Flow) // nil: no log, counts only

	mu         sync.Mutex
	window     time.Time
	inWindow   int
	suppressed uint64
	counts     map[flowKey]*atomic.Uint64
}

type flowKey struct {
	kind    string
	allowed bool
	rule    string
}

func newAuditor(fn func(Flow)) *auditor {
	return &auditor{fn: fn, counts: map[flowKey]*atomic.Uint64{}}
}

// count adds one flow of kind to the rule's count.
func (a *auditor) count(kind string, allowed bool, rule string) {
	k := flowKey{kind, allowed, rule}
	a.mu.Lock()
	c := a.counts[k]
	if c == nil {
		c = new(atomic.Uint64)
		a.counts[k] = c
	}
	a.mu.Unlock()
	c.Add(1)
}

// log writes f as it is (allowed flows: the policy bounds how many).
func (a *auditor) log(f Flow) {
	if a.fn == nil {
		return
	}
	if f.Time.IsZero() {
		f.Time = time.Now().UTC()
	}
	a.fn(f)
}

// refused writes f, a refusal, unless more than auditRefusals were
// written in this second: then it counts it for the next summary.
func (a *auditor) refused(f Flow) {
	if a.fn == nil {
		return
	}
	now := time.Now().UTC()
	a.mu.Lock()
	defer a.mu.Unlock()
	if now.Sub(a.window) >= time.Second {
		a.flushLocked(now)
		a.window, a.inWindow = now, 0
	}
	if a.inWindow >= auditRefusals {
		a.suppressed++
		return
	}
	a.inWindow++
	f.Time = now
	a.fn(f)
}

// flush writes the summary of the refusals left out, if any.
func (a *auditor) flush() {
	if a.fn == nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.flushLocked(time.Now().UTC())
}

func (a *auditor) flushLocked(now time.Time) {
	if a.suppressed == 0 {
		return
	}
	a.fn(Flow{Time: now, Kind: "summary", Event: "refused", Suppressed: a.suppressed,
		Reason: "refusals past the log's rate, left out since the last line"})
	a.suppressed = 0
}

// FlowCounts returns how many flows each rule allowed and refused so
// far, in a stable order.
func (s *Stack) FlowCounts() []FlowCount {
	a := s.audit
	a.mu.Lock()
	out := make([]FlowCount, 0, len(a.counts))
	for k, c := range a.counts {
		out = append(out, FlowCount{Kind: k.kind, Allowed: k.allowed, Rule: k.rule, Count: c.Load()})
	}
	a.mu.Unlock()
	slices.SortFunc(out, func(x, y FlowCount) int {
		if c := strings.Compare(x.Kind, y.Kind); c != 0 {
			return c
		}
		if x.Allowed != y.Allowed {
			if x.Allowed {
				return -1
			}
			return 1
		}
		return strings.Compare(x.Rule, y.Rule)
	})
	return out
}

// flushAudit writes a summary of left-out refusals each second while the
// stack runs, and a last one at its end.
func (s *Stack) flushAudit() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			s.audit.flush()
			return
		case <-t.C:
			s.audit.flush()
		}
	}
}

// flowRecord starts the record of a flow from the guest's src to dst,
// connected on the host at host.
func flowRecord(kind string, src, dst netip.AddrPort, host netip.Addr, names []string) Flow {
	f := Flow{Kind: kind, Src: src.String(), Dst: dst.String(), Names: names}
	if host.IsValid() && host != dst.Addr() {
		f.Host = netip.AddrPortFrom(host, dst.Port()).String()
	}
	return f
}

// opened logs rec's flow as open and returns the guest's side of it,
// counting its bytes, and the func that logs its close with them and the
// flow's duration.
func (a *auditor) opened(rec Flow, guest net.Conn) (*countingConn, func()) {
	open := rec
	open.Event = "open"
	a.log(open)
	start := time.Now()
	c := &countingConn{Conn: guest}
	return c, func() {
		rec.Event = "close"
		rec.BytesOut, rec.BytesIn = c.out.Load(), c.in.Load()
		rec.DurationMS = time.Since(start).Milliseconds()
		a.log(rec)
	}
}

// countingConn counts the bytes read from (the guest sent: out) and
// written to (the guest received: in) the guest's side of a flow. It
// keeps CloseWrite, which the relay uses to pass on a half-close.
type countingConn struct {
	net.Conn
	in, out atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.out.Add(int64(n))
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.in.Add(int64(n))
	return n, err
}

func (c *countingConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}
