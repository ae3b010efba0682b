package netstack

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Mode is the default disposition of a Policy for traffic no rule matches.
type Mode int

const (
	// ModePublicOnly allows public unicast destinations and refuses private
	// (RFC 1918, ULA), loopback, link-local, CGNAT (100.64.0.0/10),
	// unspecified, multicast, reserved (0/8, 240/4, 192.0.0.0/24,
	// 198.18.0.0/15), IPv4-embedding (NAT64 and its local-use prefix, 6to4,
	// Teredo) and cloud-infrastructure destinations and the host's own
	// interface addresses. It is the default.
	ModePublicOnly Mode = iota
	// ModeAllowAll allows every destination not matched by a deny rule.
	ModeAllowAll
	// ModeDenyAll allows only what an allow rule matches. Names no allow
	// rule matches are not even resolved (NXDOMAIN), which also closes DNS
	// as a tunnel.
	ModeDenyAll
)

func (m Mode) String() string {
	switch m {
	case ModePublicOnly:
		return "public-only"
	case ModeAllowAll:
		return "allow-all"
	case ModeDenyAll:
		return "deny-all"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

// Policy decides which destinations the guest may reach. The zero value is
// not useful; build one with ParsePolicy, PublicOnly or AllowAll. A Policy is
// immutable and safe for concurrent use.
//
// Evaluation of a connection (protocol, destination IP and port, and the
// names the guest resolved to that IP through the stack's DNS server):
//
//  1. A matching deny rule refuses it. Deny beats allow; rule order does not
//     matter.
//  2. A matching allow rule whose target is an address or CIDR allows it,
//     even a private or loopback destination under public-only (this is how
//     to open e.g. "10.0.0.0/8:5432" or "127.0.0.1:8080").
//  3. Under allow-all it is allowed.
//  4. A non-public destination (see ModePublicOnly) is refused. A domain
//     allow rule never opens a non-public address: a public name resolving
//     to 10.x or 127.0.0.1 (DNS rebinding) stays unreachable.
//  5. Under public-only it is allowed; under deny-all it is allowed only if a
//     domain or "*" allow rule matches.
//
// Domain rules are enforced by the DNS server (a name fully denied gets
// NXDOMAIN) and again at connect time through the name→IP records the DNS
// server keeps. A guest that resolves names elsewhere (DNS over HTTPS,
// hard-coded IPs) bypasses domain deny rules; plain DNS to any server on UDP
// port 53 is intercepted and answered by the stack. For strict domain
// allow-listing use deny-all.
type Policy struct {
	mode  Mode
	allow []rule
	deny  []rule
}

// PublicOnly returns the default policy: public destinations only, no rules.
func PublicOnly() *Policy { return &Policy{mode: ModePublicOnly} }

// AllowAll returns a policy allowing every destination.
func AllowAll() *Policy { return &Policy{mode: ModeAllowAll} }

// DenyAll returns a policy that allows nothing: no rules, deny-all.
func DenyAll() *Policy { return &Policy{mode: ModeDenyAll} }

// Mode reports the policy's default mode.
func (p *Policy) Mode() Mode { return p.mode }

// Rules are the policy's allow and deny rules as they were given.
func (p *Policy) Rules() (allow, deny []string) {
	for _, r := range p.allow {
		allow = append(allow, r.text)
	}
	for _, r := range p.deny {
		deny = append(deny, r.text)
	}
	return allow, deny
}

// String renders the policy in a form close to its input.
func (p *Policy) String() string {
	var b strings.Builder
	b.WriteString(p.mode.String())
	for _, r := range p.allow {
		b.WriteString(" allow=")
		b.WriteString(r.text)
	}
	for _, r := range p.deny {
		b.WriteString(" deny=")
		b.WriteString(r.text)
	}
	return b.String()
}

// rule is one parsed allow or deny entry.
type rule struct {
	text   string // as written, for messages
	proto  string // "" (any), "tcp" or "udp"
	anyDst bool   // target "*"
	prefix netip.Prefix
	domain string // lower case, no trailing dot; for wildcard the suffix without "*."
	wild   bool   // "*.suffix": strict subdomains of domain
	portLo uint16 // 0 = any port
	portHi uint16
}

func (r *rule) isDomain() bool { return r.domain != "" }

// name is the rule as a Verdict names it: kind ("allow" or "deny") and
// its text.
func (r *rule) name(kind string) string { return kind + " " + strconv.Quote(r.text) }
func (r *rule) isAddr() bool            { return r.prefix.IsValid() }

// unrestricted reports whether the rule applies to every protocol and port.
func (r *rule) unrestricted() bool { return r.proto == "" && r.portLo == 0 }

func (r *rule) matchesProtoPort(proto string, port uint16) bool {
	if r.proto != "" && r.proto != proto {
		return false
	}
	return r.portLo == 0 || (port >= r.portLo && port <= r.portHi)
}

func (r *rule) matchesName(name string) bool {
	if !r.isDomain() {
		return false
	}
	if r.wild {
		return len(name) > len(r.domain) && strings.HasSuffix(name, r.domain) &&
			name[len(name)-len(r.domain)-1] == '.'
	}
	return name == r.domain
}

func (r *rule) matchesAnyName(names []string) bool {
	for _, n := range names {
		if r.matchesName(n) {
			return true
		}
	}
	return false
}

// matches reports whether the rule covers the connection.
func (r *rule) matches(q *request) bool {
	if !r.matchesProtoPort(q.proto, q.port) {
		return false
	}
	switch {
	case r.anyDst:
		return true
	case r.isAddr():
		return r.prefix.Contains(q.addr)
	default:
		return r.matchesAnyName(q.names)
	}
}

// ParsePolicy builds a Policy from a mode ("public-only" or "" for the
// default, "allow-all", "deny-all"; case-insensitive, with the aliases
// "public", "all" and "none") and allow and deny rule strings.
//
// Rule syntax: [PROTO/]TARGET[:PORTS]
//
//	PROTO   tcp or udp (default: both)
//	TARGET  an IP (1.2.3.4, [2001:db8::1]), a CIDR (10.0.0.0/8,
//	        [2001:db8::/32]), a domain (example.com), a wildcard domain
//	        (*.example.com: every subdomain at any depth, not example.com
//	        itself) or * (any destination)
//	PORTS   a port (443) or an inclusive range (8000-8100); default all
//
// Examples: 10.0.0.0/8, 10.0.0.0/8:443, example.com, *.example.com:443,
// udp/1.2.3.4:53, tcp/*:25. A bare IPv6 address or CIDR without brackets is
// accepted when no port follows.
func ParsePolicy(mode string, allow, deny []string) (*Policy, error) {
	p := &Policy{}
	switch strings.ToLower(strings.TrimSpace(mode)) {
	case "", "public-only", "public":
		p.mode = ModePublicOnly
	case "allow-all", "all":
		p.mode = ModeAllowAll
	case "deny-all", "none":
		p.mode = ModeDenyAll
	default:
		return nil, fmt.Errorf("netstack: policy mode %q: want public-only, allow-all or deny-all", mode)
	}
	for _, s := range allow {
		r, err := parseRule(s)
		if err != nil {
			return nil, fmt.Errorf("netstack: allow rule %q: %w", s, err)
		}
		p.allow = append(p.allow, r)
	}
	for _, s := range deny {
		r, err := parseRule(s)
		if err != nil {
			return nil, fmt.Errorf("netstack: deny rule %q: %w", s, err)
		}
		p.deny = append(p.deny, r)
	}
	return p, nil
}

func parseRule(s string) (rule, error) {
	r := rule{text: strings.TrimSpace(s)}
	rest := r.text
	if rest == "" {
		return r, errors.New("empty rule")
	}
	if i := strings.IndexByte(rest, '/'); i >= 0 {
		switch p := strings.ToLower(rest[:i]); {
		case p == "tcp" || p == "udp":
			r.proto = p
			rest = rest[i+1:]
			if rest == "" {
				return r, fmt.Errorf("missing target after %q", r.proto+"/")
			}
		case isLetters(p):
			return r, fmt.Errorf("unknown protocol %q: want tcp or udp", rest[:i])
		}
	}

	target, ports, err := splitTargetPorts(rest)
	if err != nil {
		return r, err
	}
	if ports != "" {
		if r.portLo, r.portHi, err = parsePortRange(ports); err != nil {
			return r, err
		}
	}
	switch {
	case target == "*":
		r.anyDst = true
	case strings.Contains(target, "/"):
		pfx, err := netip.ParsePrefix(target)
		if err != nil {
			return r, fmt.Errorf("bad CIDR %q: %v", target, cleanNetipErr(err))
		}
		if pfx.Addr().Zone() != "" {
			return r, fmt.Errorf("bad CIDR %q: zones are not supported", target)
		}
		r.prefix = unmapPrefix(pfx.Masked())
	case looksLikeIP(target):
		a, err := netip.ParseAddr(target)
		if err != nil {
			return r, fmt.Errorf("bad IP address %q: %v", target, cleanNetipErr(err))
		}
		if a.Zone() != "" {
			return r, fmt.Errorf("bad IP address %q: zones are not supported", target)
		}
		a = a.Unmap()
		r.prefix = netip.PrefixFrom(a, a.BitLen())
	default:
		name := strings.ToLower(strings.TrimSuffix(target, "."))
		if strings.HasPrefix(name, "*.") {
			r.wild = true
			name = name[2:]
		}
		if err := validateDomain(name); err != nil {
			return r, fmt.Errorf("bad domain %q: %v", target, err)
		}
		r.domain = name
	}
	return r, nil
}

// splitTargetPorts separates "target:ports", handling bracketed and bare IPv6.
func splitTargetPorts(s string) (target, ports string, err error) {
	if strings.HasPrefix(s, "[") {
		end := strings.IndexByte(s, ']')
		if end < 0 {
			return "", "", fmt.Errorf("missing ']' in %q", s)
		}
		target, rest := s[1:end], s[end+1:]
		if target == "" {
			return "", "", fmt.Errorf("empty address in %q", s)
		}
		if rest == "" {
			return target, "", nil
		}
		if rest[0] != ':' || len(rest) == 1 {
			return "", "", fmt.Errorf("want ':PORT' after ']', got %q", rest)
		}
		return target, rest[1:], nil
	}
	switch strings.Count(s, ":") {
	case 0:
		return s, "", nil
	case 1:
		i := strings.IndexByte(s, ':')
		target, ports = s[:i], s[i+1:]
		if target == "" {
			return "", "", fmt.Errorf("missing target before ':' (use * for any)")
		}
		if ports == "" {
			return "", "", fmt.Errorf("missing port after ':'")
		}
		return target, ports, nil
	default:
		// A bare IPv6 address or CIDR; a port needs brackets.
		return s, "", nil
	}
}

func parsePortRange(s string) (lo, hi uint16, err error) {
	a, b, isRange := strings.Cut(s, "-")
	if lo, err = parsePort(a); err != nil {
		return 0, 0, err
	}
	if !isRange {
		return lo, lo, nil
	}
	if hi, err = parsePort(b); err != nil {
		return 0, 0, err
	}
	if hi < lo {
		return 0, 0, fmt.Errorf("bad port range %q: %d is above %d", s, lo, hi)
	}
	return lo, hi, nil
}

func parsePort(s string) (uint16, error) {
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("bad port %q: want 1-65535", s)
	}
	return uint16(n), nil
}

func isLetters(s string) bool {
	for _, c := range s {
		if c < 'a' || c > 'z' {
			return false
		}
	}
	return s != ""
}

// looksLikeIP reports whether s should be parsed as an address rather than a
// domain: it has a colon, or its last dot-separated label is all digits (no
// TLD is numeric, so "10.0.0.256" is a bad IP, not a domain).
func looksLikeIP(s string) bool {
	if strings.Contains(s, ":") {
		return true
	}
	last := s[strings.LastIndexByte(s, '.')+1:]
	if last == "" {
		return false
	}
	for _, c := range last {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// CheckDomain checks a host name as domain rules take it: lower case,
// without a trailing dot or wildcard.
func CheckDomain(name string) error { return validateDomain(name) }

// validateDomain checks a lower-case name without trailing dot or wildcard.
func validateDomain(name string) error {
	if name == "" {
		return errors.New("empty name")
	}
	if len(name) > 253 {
		return errors.New("longer than 253 characters")
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" {
			return errors.New("empty label")
		}
		if len(label) > 63 {
			return fmt.Errorf("label %q longer than 63 characters", label)
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return fmt.Errorf("label %q starts or ends with '-'", label)
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				if c == '*' {
					return errors.New("'*' is only allowed as the whole first label, as in *.example.com")
				}
				return fmt.Errorf("label %q has invalid character %q", label, c)
			}
		}
	}
	return nil
}

// cleanNetipErr strips the redundant input echo netip puts in its errors.
func cleanNetipErr(err error) string {
	msg := err.Error()
	if i := strings.LastIndex(msg, "): "); i >= 0 {
		return msg[i+3:]
	}
	if i := strings.LastIndex(msg, "\": "); i >= 0 {
		return msg[i+3:]
	}
	return msg
}

func unmapPrefix(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p
}

// request is a connection being checked.
type request struct {
	proto string // "tcp" or "udp"
	addr  netip.Addr
	port  uint16
	names []string // names the guest resolved to addr through our DNS
}

// Verdict is the outcome of a policy check.
type Verdict struct {
	Allowed bool
	// Rule names what decided: `allow "RULE"` or `deny "RULE"` for a
	// rule, or the policy's mode ("public-only", "allow-all",
	// "deny-all") where no rule did.
	Rule   string
	Reason string
}

// Check evaluates a connection to dst over proto ("tcp" or "udp") whose
// address the guest obtained by resolving names. It does not know the host's
// own addresses; the Stack adds that check for public-only and deny-all.
func (p *Policy) Check(proto string, dst netip.AddrPort, names ...string) Verdict {
	return p.check(&request{proto: proto, addr: dst.Addr().Unmap(), port: dst.Port(), names: names}, nil)
}

// check implements the precedence documented on Policy. isHost reports the
// host's own interface addresses (nil: none known).
func (p *Policy) check(q *request, isHost func(netip.Addr) bool) Verdict {
	for i := range p.deny {
		if p.deny[i].matches(q) {
			return Verdict{false, p.deny[i].name("deny"), "denied by rule " + strconv.Quote(p.deny[i].text)}
		}
	}
	for i := range p.allow {
		if r := &p.allow[i]; r.isAddr() && r.matches(q) {
			return Verdict{true, r.name("allow"), "allowed by rule " + strconv.Quote(r.text)}
		}
	}
	mode := p.mode.String()
	if p.mode == ModeAllowAll {
		return Verdict{true, mode, "allow-all"}
	}
	if why := nonPublic(q.addr, isHost); why != "" {
		return Verdict{false, mode, why + " address refused by " + mode + " policy"}
	}
	if p.mode == ModePublicOnly {
		return Verdict{true, mode, "public address"}
	}
	for i := range p.allow {
		if r := &p.allow[i]; !r.isAddr() && r.matches(q) {
			return Verdict{true, r.name("allow"), "allowed by rule " + strconv.Quote(r.text)}
		}
	}
	if len(q.names) == 0 {
		return Verdict{false, mode, "no allow rule matches (deny-all; names resolved through this stack: none)"}
	}
	return Verdict{false, mode, "no allow rule matches (deny-all; names: " + strings.Join(q.names, ",") + ")"}
}

// nameRefused reports whether the DNS server should answer NXDOMAIN for name
// without resolving it: a deny rule for every protocol and port matches it,
// or under deny-all no allow rule could ever admit it. The verdict's Rule
// names what decided, whichever way.
func (p *Policy) nameRefused(name string) (bool, Verdict) {
	for i := range p.deny {
		if r := &p.deny[i]; r.unrestricted() && (r.anyDst || r.matchesName(name)) {
			return true, Verdict{false, r.name("deny"), "denied by rule " + strconv.Quote(r.text)}
		}
	}
	if p.mode != ModeDenyAll {
		return false, Verdict{true, p.mode.String(), ""}
	}
	for i := range p.allow {
		if r := &p.allow[i]; r.anyDst || r.matchesName(name) {
			return false, Verdict{true, r.name("allow"), ""}
		}
	}
	return true, Verdict{false, p.mode.String(), "no allow rule matches the name (deny-all)"}
}

// answerAllowed reports whether the DNS server may hand addr to the guest:
// under public-only and deny-all a non-public address is dropped unless an
// address allow rule covers it (DNS rebinding protection), and an address a
// deny rule fully covers is always dropped.
func (p *Policy) answerAllowed(addr netip.Addr, isHost func(netip.Addr) bool) bool {
	addr = addr.Unmap()
	for i := range p.deny {
		if r := &p.deny[i]; r.unrestricted() && (r.anyDst || r.isAddr() && r.prefix.Contains(addr)) {
			return false
		}
	}
	if p.mode == ModeAllowAll || nonPublic(addr, isHost) == "" {
		return true
	}
	for i := range p.allow {
		if r := &p.allow[i]; r.isAddr() && r.prefix.Contains(addr) {
			return true
		}
	}
	return false
}

var (
	cgnat      = netip.MustParsePrefix("100.64.0.0/10")
	thisNet    = netip.MustParsePrefix("0.0.0.0/8")
	reserved4  = netip.MustParsePrefix("240.0.0.0/4")
	ietfProto  = netip.MustParsePrefix("192.0.0.0/24")
	nat64      = netip.MustParsePrefix("64:ff9b::/96")
	nat64Local = netip.MustParsePrefix("64:ff9b:1::/48") // RFC 8215: local-use NAT64
	benchmark4 = netip.MustParsePrefix("198.18.0.0/15")  // RFC 2544: benchmarking, often lab networks
	discardV6  = netip.MustParsePrefix("100::/64")
	sixToFour  = netip.MustParsePrefix("2002::/16")
	teredo     = netip.MustParsePrefix("2001::/32")
	siteLocal6 = netip.MustParsePrefix("fec0::/10")
)

// cloudInfra are public addresses that reach a cloud provider's own
// infrastructure from inside its VMs (instance metadata, the host agent,
// DNS and time services) rather than the internet: a sandbox on a cloud VM
// must not reach them under public-only or deny-all. (Link-local metadata
// addresses such as 169.254.169.254 and fd00:ec2::254 are refused as
// link-local and private already.)
var cloudInfra = []struct {
	prefix netip.Prefix
	what   string
}{
	{netip.MustParsePrefix("168.63.129.16/32"), "Azure's host wire server"},
	{netip.MustParsePrefix("100.100.100.200/32"), "Alibaba Cloud's metadata service"}, // in CGNAT space too
	{netip.MustParsePrefix("192.0.0.192/32"), "Oracle Cloud's metadata service"},      // in IETF protocol space too
}

func isCloudInfra(addr netip.Addr) bool {
	for _, c := range cloudInfra {
		if c.prefix.Contains(addr) {
			return true
		}
	}
	return false
}

// NonPublicChecker returns a function that says why an address is not a
// public unicast destination, as PublicOnly refuses it ("loopback",
// "private", "link-local"..., and "host's own" for the host's interface
// addresses, public ones included: they reach its services bound to
// 0.0.0.0), or "" when it is one. Each checker keeps its own list of the
// host's addresses, fetched again at most every 30 s.
func NonPublicChecker() func(netip.Addr) string {
	h := newHostAddrs()
	return func(addr netip.Addr) string { return nonPublic(addr, h.contains) }
}

// nonPublic returns why addr is not a public unicast destination, or "".
func nonPublic(addr netip.Addr, isHost func(netip.Addr) bool) string {
	addr = addr.Unmap()
	switch {
	case !addr.IsValid():
		return "invalid"
	case addr.IsUnspecified() || addr.Is4() && thisNet.Contains(addr):
		return "unspecified"
	case addr.IsLoopback():
		return "loopback"
	case addr.IsMulticast():
		return "multicast"
	case addr.IsLinkLocalUnicast():
		return "link-local"
	case addr.IsPrivate():
		return "private"
	case cgnat.Contains(addr):
		return "CGNAT"
	case reserved4.Contains(addr) || ietfProto.Contains(addr) || benchmark4.Contains(addr) || discardV6.Contains(addr) || siteLocal6.Contains(addr):
		return "reserved"
	case nat64.Contains(addr) || nat64Local.Contains(addr) || sixToFour.Contains(addr) || teredo.Contains(addr):
		// Translation prefixes embed an IPv4 address that may be private.
		return "IPv4-embedding"
	case isCloudInfra(addr):
		return "cloud infrastructure"
	case isHost != nil && isHost(addr):
		return "host's own"
	}
	return ""
}

// policyJSON is a Policy as data: its mode and rules as ParsePolicy takes
// them.
type policyJSON struct {
	Mode  string   `json:"mode"`
	Allow []string `json:"allow,omitempty"`
	Deny  []string `json:"deny,omitempty"`
}

// MarshalJSON writes the policy as {"mode", "allow", "deny"}, the rules as
// they were given.
func (p *Policy) MarshalJSON() ([]byte, error) {
	j := policyJSON{Mode: p.mode.String()}
	j.Allow, j.Deny = p.Rules()
	return json.Marshal(j)
}

// UnmarshalJSON parses what MarshalJSON wrote, through ParsePolicy: a rule
// that does not parse is an error.
func (p *Policy) UnmarshalJSON(b []byte) error {
	var j policyJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return fmt.Errorf("netstack: policy: %w", err)
	}
	if j.Mode == "" {
		return errors.New("netstack: policy: no mode")
	}
	q, err := ParsePolicy(j.Mode, j.Allow, j.Deny)
	if err != nil {
		return err
	}
	*p = *q
	return nil
}
