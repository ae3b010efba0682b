package netstack

import (
	"net"
	"net/netip"
	"strings"
	"testing"
)

func TestParsePolicyErrors(t *testing.T) {
	for _, tc := range []struct {
		mode        string
		allow, deny []string
		want        string // substring of the error
	}{
		{"open", nil, nil, `policy mode "open": want public-only, allow-all or deny-all`},
		{"", []string{""}, nil, `allow rule "": empty rule`},
		{"", []string{"10.0.0.0/33"}, nil, `allow rule "10.0.0.0/33": bad CIDR "10.0.0.0/33"`},
		{"", []string{"10.0.0.256"}, nil, `bad IP address "10.0.0.256"`},
		{"", []string{"10.0.0.0/8:0"}, nil, `bad port "0": want 1-65535`},
		{"", []string{"10.0.0.0/8:65536"}, nil, `bad port "65536"`},
		{"", []string{"10.0.0.0/8:http"}, nil, `bad port "http"`},
		{"", []string{"1.2.3.4:100-10"}, nil, `bad port range "100-10"`},
		{"", []string{"1.2.3.4:10-"}, nil, `bad port ""`},
		{"", []string{"1.2.3.4:"}, nil, `missing port after ':'`},
		{"", []string{":443"}, nil, `missing target before ':'`},
		{"", []string{"tcp/"}, nil, `missing target after "tcp/"`},
		{"", []string{"icmp/1.2.3.4"}, nil, `unknown protocol "icmp": want tcp or udp`},
		{"", nil, []string{"exa mple.com"}, `deny rule "exa mple.com": bad domain "exa mple.com": label "exa mple" has invalid character ' '`},
		{"", nil, []string{"foo..com"}, `bad domain "foo..com": empty label`},
		{"", nil, []string{"a.*.com"}, `'*' is only allowed as the whole first label`},
		{"", nil, []string{"-a.com"}, `starts or ends with '-'`},
		{"", nil, []string{"*."}, `bad domain "*.": '*' is only allowed`},
		{"", nil, []string{"*.."}, `bad domain "*..": empty name`},
		{"", nil, []string{"[2001:db8::1"}, `missing ']'`},
		{"", nil, []string{"[2001:db8::1]443"}, `want ':PORT' after ']'`},
		{"", nil, []string{"[fe80::1%eth0]"}, `zones are not supported`},
		{"", nil, []string{strings.Repeat("a", 64) + ".com"}, `longer than 63 characters`},
	} {
		_, err := ParsePolicy(tc.mode, tc.allow, tc.deny)
		if err == nil {
			t.Errorf("ParsePolicy(%q, %q, %q) succeeded, want error containing %q", tc.mode, tc.allow, tc.deny, tc.want)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParsePolicy(%q, %q, %q) = %q, want it to contain %q", tc.mode, tc.allow, tc.deny, err, tc.want)
		}
	}
}

func TestParseRule(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want rule
	}{
		{"10.0.0.0/8", rule{prefix: netip.MustParsePrefix("10.0.0.0/8")}},
		{"10.1.2.3/8", rule{prefix: netip.MustParsePrefix("10.0.0.0/8")}}, // masked
		{"10.0.0.0/8:443", rule{prefix: netip.MustParsePrefix("10.0.0.0/8"), portLo: 443, portHi: 443}},
		{"udp/1.2.3.4:53", rule{proto: "udp", prefix: netip.MustParsePrefix("1.2.3.4/32"), portLo: 53, portHi: 53}},
		{"TCP/1.2.3.4:8000-8100", rule{proto: "tcp", prefix: netip.MustParsePrefix("1.2.3.4/32"), portLo: 8000, portHi: 8100}},
		{"Example.COM.", rule{domain: "example.com"}},
		{"*.example.com:443", rule{domain: "example.com", wild: true, portLo: 443, portHi: 443}},
		{"tcp/*:25", rule{proto: "tcp", anyDst: true, portLo: 25, portHi: 25}},
		{"*", rule{anyDst: true}},
		{"2001:db8::/32", rule{prefix: netip.MustParsePrefix("2001:db8::/32")}},
		{"[2001:db8::1]:443", rule{prefix: netip.MustParsePrefix("2001:db8::1/128"), portLo: 443, portHi: 443}},
		{"::ffff:10.0.0.1", rule{prefix: netip.MustParsePrefix("10.0.0.1/32")}},
		{"localhost", rule{domain: "localhost"}},
	} {
		got, err := parseRule(tc.in)
		if err != nil {
			t.Errorf("parseRule(%q): %v", tc.in, err)
			continue
		}
		tc.want.text = tc.in
		if got != tc.want {
			t.Errorf("parseRule(%q) = %+v, want %+v", tc.in, got, tc.want)
		}
	}
}

func TestPolicyCheck(t *testing.T) {
	pub := netip.MustParseAddr("93.184.216.34")
	for _, tc := range []struct {
		name        string
		mode        string
		allow, deny []string
		proto       string
		dst         string
		names       []string
		want        bool
	}{
		// public-only defaults
		{"public ok", "", nil, nil, "tcp", "93.184.216.34:443", nil, true},
		{"rfc1918", "", nil, nil, "tcp", "10.1.2.3:443", nil, false},
		{"rfc1918 172", "", nil, nil, "tcp", "172.31.255.255:443", nil, false},
		{"rfc1918 192", "", nil, nil, "udp", "192.168.0.1:53", nil, false},
		{"loopback", "", nil, nil, "tcp", "127.0.0.1:80", nil, false},
		{"link-local", "", nil, nil, "tcp", "169.254.169.254:80", nil, false},
		{"cgnat", "", nil, nil, "tcp", "100.64.1.1:80", nil, false},
		{"cgnat edge", "", nil, nil, "tcp", "100.128.0.1:80", nil, true},
		{"unspecified", "", nil, nil, "tcp", "0.0.0.0:80", nil, false},
		{"multicast", "", nil, nil, "udp", "239.1.1.1:5353", nil, false},
		{"broadcast", "", nil, nil, "udp", "255.255.255.255:67", nil, false},
		{"ula", "", nil, nil, "tcp", "[fd00::1]:80", nil, false},
		{"v6 loopback", "", nil, nil, "tcp", "[::1]:80", nil, false},
		{"v6 link-local", "", nil, nil, "tcp", "[fe80::1]:80", nil, false},
		{"v4-mapped private", "", nil, nil, "tcp", "[::ffff:10.0.0.1]:80", nil, false},
		{"v6 public", "", nil, nil, "tcp", "[2606:2800:220:1::1]:443", nil, true},
		// cloud infrastructure at public addresses
		{"azure wire server", "", nil, nil, "tcp", "168.63.129.16:80", nil, false},
		{"azure wire server dns", "", nil, nil, "udp", "168.63.129.16:53", nil, false},
		{"next to the wire server", "", nil, nil, "tcp", "168.63.129.17:80", nil, true},
		{"alibaba metadata", "", nil, nil, "tcp", "100.100.100.200:80", nil, false},
		{"oracle metadata", "", nil, nil, "tcp", "192.0.0.192:80", nil, false},
		{"v4-mapped wire server", "", nil, nil, "tcp", "[::ffff:168.63.129.16]:80", nil, false},
		{"wire server under allow-all", "allow-all", nil, nil, "tcp", "168.63.129.16:80", nil, true},
		// explicit CIDR allow opens a private range; ports and protocols matter
		{"cidr allow", "", []string{"10.0.0.0/8:5432"}, nil, "tcp", "10.1.2.3:5432", nil, true},
		{"cidr allow other port", "", []string{"10.0.0.0/8:5432"}, nil, "tcp", "10.1.2.3:5433", nil, false},
		{"cidr allow proto", "", []string{"udp/10.0.0.0/8"}, nil, "tcp", "10.1.2.3:53", nil, false},
		{"loopback allow", "", []string{"127.0.0.1:8080"}, nil, "tcp", "127.0.0.1:8080", nil, true},
		// a domain allow never opens a private address (DNS rebinding)
		{"domain allow private", "", []string{"internal.example.com"}, nil, "tcp", "10.1.2.3:443", []string{"internal.example.com"}, false},
		// deny beats allow
		{"deny beats allow", "", []string{"10.0.0.0/8"}, []string{"10.1.0.0/16"}, "tcp", "10.1.2.3:80", nil, false},
		{"deny public port", "", nil, []string{"tcp/*:25"}, "tcp", "93.184.216.34:25", nil, false},
		{"deny public port other proto", "", nil, []string{"tcp/*:25"}, "udp", "93.184.216.34:25", nil, true},
		{"deny domain", "", nil, []string{"*.evil.com"}, "tcp", "93.184.216.34:443", []string{"x.evil.com"}, false},
		{"deny domain apex not wild", "", nil, []string{"*.evil.com"}, "tcp", "93.184.216.34:443", []string{"evil.com"}, true},
		{"deny domain suffix trick", "", nil, []string{"*.evil.com"}, "tcp", "93.184.216.34:443", []string{"notevil.com"}, true},
		{"deny domain one of names", "", nil, []string{"evil.com"}, "tcp", "93.184.216.34:443", []string{"good.com", "evil.com"}, false},
		// allow-all
		{"allow-all private", "allow-all", nil, nil, "tcp", "10.1.2.3:80", nil, true},
		{"allow-all loopback", "allow-all", nil, nil, "tcp", "127.0.0.1:80", nil, true},
		{"allow-all deny", "allow-all", nil, []string{"127.0.0.0/8"}, "tcp", "127.0.0.1:80", nil, false},
		// deny-all
		{"deny-all nothing", "deny-all", nil, nil, "tcp", "93.184.216.34:443", nil, false},
		{"deny-all domain", "deny-all", []string{"example.com:443"}, nil, "tcp", "93.184.216.34:443", []string{"example.com"}, true},
		{"deny-all domain wrong port", "deny-all", []string{"example.com:443"}, nil, "tcp", "93.184.216.34:80", []string{"example.com"}, false},
		{"deny-all domain unresolved", "deny-all", []string{"example.com"}, nil, "tcp", "93.184.216.34:443", nil, false},
		{"deny-all domain private", "deny-all", []string{"example.com"}, nil, "tcp", "10.0.0.1:443", []string{"example.com"}, false},
		{"deny-all cidr", "deny-all", []string{"93.184.216.0/24"}, nil, "udp", "93.184.216.34:443", nil, true},
		{"deny-all star", "deny-all", []string{"tcp/*:443"}, nil, "tcp", "93.184.216.34:443", nil, true},
		{"deny-all star private", "deny-all", []string{"tcp/*:443"}, nil, "tcp", "10.0.0.1:443", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustPolicy(t, tc.mode, tc.allow, tc.deny)
			v := p.Check(tc.proto, netip.MustParseAddrPort(tc.dst), tc.names...)
			if v.Allowed != tc.want {
				t.Fatalf("Check(%s %s %v) = %+v, want allowed=%v (policy %s)", tc.proto, tc.dst, tc.names, v, tc.want, p)
			}
			if v.Reason == "" {
				t.Error("empty reason")
			}
		})
	}

	// The host's own addresses are refused under public-only.
	isHost := func(a netip.Addr) bool { return a == pub }
	if v := PublicOnly().check(&request{proto: "tcp", addr: pub, port: 22}, isHost); v.Allowed {
		t.Errorf("host's own public address allowed: %+v", v)
	}
}

func TestPolicyDNS(t *testing.T) {
	p := mustPolicy(t, "public-only", []string{"10.9.0.0/16:80", "name.allowed.com"}, []string{"blocked.com", "*.blocked.org", "ports.com:443", "10.9.9.0/24"})
	for name, want := range map[string]bool{
		"blocked.com": true, "sub.blocked.com": false, "x.blocked.org": true, "blocked.org": false,
		"ports.com": false, // only port 443 denied: resolvable, refused at connect
		"fine.com":  false,
	} {
		if got, _ := p.nameRefused(name); got != want {
			t.Errorf("nameRefused(%q) = %v, want %v", name, got, want)
		}
	}
	for addr, want := range map[string]bool{
		"93.184.216.34": true,
		"10.1.2.3":      false, // rebinding
		"127.0.0.1":     false,
		"10.9.1.1":      true,  // opened by a CIDR allow (any port)
		"10.9.9.9":      false, // but fully denied here
	} {
		if got := p.answerAllowed(netip.MustParseAddr(addr), nil); got != want {
			t.Errorf("answerAllowed(%s) = %v, want %v", addr, got, want)
		}
	}
	d := mustPolicy(t, "deny-all", []string{"*.ok.com"})
	if refused, _ := d.nameRefused("a.ok.com"); refused {
		t.Error("deny-all refused an allowed name")
	}
	if refused, _ := d.nameRefused("other.com"); !refused {
		t.Error("deny-all resolved a name no rule allows")
	}
	if refused, _ := AllowAll().nameRefused("anything.com"); refused {
		t.Error("allow-all refused a name")
	}
	if !AllowAll().answerAllowed(netip.MustParseAddr("10.0.0.1"), nil) {
		t.Error("allow-all dropped a private answer")
	}
}

func TestParsePublish(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1")
	for _, tc := range []struct {
		in   string
		want PortMapping
		err  string
	}{
		{in: "8080:80", want: PortMapping{Proto: "tcp", HostIP: lo, HostPort: 8080, GuestPort: 80}},
		{in: "0.0.0.0:8443:443", want: PortMapping{Proto: "tcp", HostIP: netip.MustParseAddr("0.0.0.0"), HostPort: 8443, GuestPort: 443}},
		{in: "5353:53/udp", want: PortMapping{Proto: "udp", HostIP: lo, HostPort: 5353, GuestPort: 53}},
		{in: "[::1]:2222:22/TCP", want: PortMapping{Proto: "tcp", HostIP: netip.MustParseAddr("::1"), HostPort: 2222, GuestPort: 22}},
		{in: "0:22", want: PortMapping{Proto: "tcp", HostIP: lo, HostPort: 0, GuestPort: 22}},
		{in: "80", err: "want [HOSTIP:]HOSTPORT:GUESTPORT"},
		{in: "8080:0", err: `guest port "0": want 1-65535`},
		{in: "8080:70000", err: `guest port "70000"`},
		{in: "x:80", err: `host port "x": want 0-65535`},
		{in: "99999:80", err: `host port "99999"`},
		{in: "1.2.3:8080:80", err: `host IP "1.2.3": not an IP address`},
		{in: "localhost:8080:80", err: `host IP "localhost": not an IP address`},
		{in: "::1:8080:80", err: `put IPv6 addresses in brackets`},
		{in: "8080:80/sctp", err: `protocol "sctp": want tcp or udp`},
		{in: ":80", err: `host port ""`},
	} {
		got, err := ParsePublish(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParsePublish(%q) = %v, %v; want error containing %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParsePublish(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
	if s := (PortMapping{HostPort: 1, GuestPort: 2}).String(); s != "127.0.0.1:1:2/tcp" {
		t.Errorf("String() = %q", s)
	}
}

// TestCloudInfraListIsRefused: every entry of the one list is refused
// under public-only whatever the protocol, and its neighbours are not
// (unless another rule covers them).
func TestCloudInfraListIsRefused(t *testing.T) {
	for _, c := range cloudInfra {
		a := c.prefix.Addr()
		if why := nonPublic(a, nil); why == "" {
			t.Errorf("nonPublic(%v) = \"\", want a refusal (%s)", a, c.what)
		}
		if c.prefix.Bits() != 32 {
			t.Errorf("%v: entries are single addresses", c.prefix)
		}
	}
	if why := nonPublic(netip.MustParseAddr("168.63.129.15"), nil); why != "" {
		t.Errorf("nonPublic(168.63.129.15) = %q, want public", why)
	}
}

// TestNonPublicRanges: the special-purpose ranges that are not the
// internet are refused under public-only, each with its reason, and
// their neighbours are public.
func TestNonPublicRanges(t *testing.T) {
	for addr, want := range map[string]string{
		"198.18.0.1":        "reserved", // RFC 2544 benchmarking
		"198.19.255.254":    "reserved",
		"64:ff9b:1::a00:1":  "IPv4-embedding", // RFC 8215 local-use NAT64
		"64:ff9b::10.0.0.1": "IPv4-embedding",
		"100.64.0.1":        "CGNAT",
		"198.17.255.255":    "",
		"198.20.0.0":        "",
		"64:ff9b:2::1":      "",
	} {
		if got := nonPublic(netip.MustParseAddr(addr), nil); got != want {
			t.Errorf("nonPublic(%s) = %q, want %q", addr, got, want)
		}
	}
}

// TestNonPublicChecker: every address of the host's own interfaces is
// refused, public ones too, as PublicOnly refuses them.
func TestNonPublicChecker(t *testing.T) {
	check := NonPublicChecker()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		p, err := netip.ParsePrefix(a.String())
		if err != nil {
			continue
		}
		if why := check(p.Addr()); why == "" {
			t.Errorf("the host's own %s: public; want it refused", p.Addr())
		}
	}
	if why := check(netip.MustParseAddr("8.8.8.8")); why != "" {
		t.Errorf("8.8.8.8: %q; want public", why)
	}
}
