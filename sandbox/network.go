package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/internal/auditlog"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/tap"
	virtionet "github.com/capsa-sandbox/capsa/virtio/net"
)

// guestMAC is every sandbox NIC's address: each sandbox has its own
// network, so they never meet on one link. (A locally administered
// unicast address.)
var guestMAC = net.HardwareAddr{0x52, 0x54, 0x00, 0xca, 0x95, 0x01}

// Network gives the sandbox a NIC behind capsa's user-mode NAT, which lets
// the guest reach what policy allows (nil: netstack.PublicOnly(), public
// addresses only). Without Network a sandbox has no network interface at
// all, only loopback.
func (b *Builder) Network(policy *netstack.Policy) *Builder {
	if policy == nil {
		policy = netstack.PublicOnly()
	}
	b.netConfig().Policy = policy
	return b
}

// Publish forwards a host port to a guest port:
// "[HOSTIP:]HOSTPORT:GUESTPORT[/udp]", bound to 127.0.0.1 unless HOSTIP is
// given; HOSTPORT 0 picks a free port (see Sandbox.Published). It needs
// Network.
func (b *Builder) Publish(spec string) *Builder {
	if _, err := netstack.ParsePublish(spec); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: publish: %w", err))
		return b
	}
	nc := b.netConfig()
	nc.Publish = append(nc.Publish, spec)
	return b
}

// DNSServer makes the sandbox's DNS server resolve names through the DNS
// server at addr (HOST:PORT) instead of the host's resolver.
func (b *Builder) DNSServer(addr string) *Builder {
	if _, err := netip.ParseAddrPort(addr); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: DNS server %q: want IP:PORT", addr))
		return b
	}
	b.netConfig().DNSServer = addr
	return b
}

// netConfig returns the builder's network settings, made on first use.
// Tap plugs the sandbox's NIC into the host tap device t.Name of the
// process's network namespace, with no NAT: the guest takes t.Address on
// its eth0 and its frames pass to the host kernel unchanged (package
// tap). It is how a containerd pod's VM joins the pod's network; the tap
// must exist, or the process needs CAP_NET_ADMIN to make it. A tap network
// has no policy, published ports, DNS server, secrets or TLS interception.
func (b *Builder) Tap(t TapSpec) *Builder {
	if err := checkTap(&t); err != nil {
		b.c.errs = append(b.c.errs, err)
		return b
	}
	b.netConfig().Tap = &t
	return b
}

// checkTap checks a tap's settings, and gives MTU its default.
func checkTap(t *TapSpec) error {
	if t.Name == "" || len(t.Name) >= unix.IFNAMSIZ || strings.ContainsAny(t.Name, "/ \x00") {
		return fmt.Errorf("sandbox: tap %q: want an interface name of 1 to %d characters", t.Name, unix.IFNAMSIZ-1)
	}
	if mac, err := net.ParseMAC(t.MAC); err != nil || len(mac) != 6 || mac[0]&1 != 0 {
		return fmt.Errorf("sandbox: tap %s: MAC %q: want a unicast Ethernet address", t.Name, t.MAC)
	}
	p, err := netip.ParsePrefix(t.Address)
	if err != nil || !p.Addr().Is4() {
		return fmt.Errorf("sandbox: tap %s: address %q: want IPv4 with its prefix (10.0.0.2/24)", t.Name, t.Address)
	}
	if t.Gateway != "" {
		if g, err := netip.ParseAddr(t.Gateway); err != nil || !g.Is4() {
			return fmt.Errorf("sandbox: tap %s: gateway %q: want an IPv4 address", t.Name, t.Gateway)
		}
	}
	if t.MTU == 0 {
		t.MTU = 1500
	}
	if t.MTU < virtionet.MinMTU || t.MTU > virtionet.MaxMTU {
		return fmt.Errorf("sandbox: tap %s: MTU %d: want %d to %d", t.Name, t.MTU, virtionet.MinMTU, virtionet.MaxMTU)
	}
	return nil
}

// startTap opens the NIC's tap (Builder.Tap) and returns the guest's ip=
// argument.
func startTap(t *TapSpec, lim *limiters, log *slog.Logger) (*network, string, error) {
	if err := checkTap(t); err != nil {
		return nil, "", err
	}
	mac, _ := net.ParseMAC(t.MAC)
	dev, err := tap.Open(t.Name, t.MTU)
	if err != nil {
		return nil, "", fmt.Errorf("sandbox: network: %w", err)
	}
	done := make(chan struct{})
	nic, err := virtionet.New(mac, uint16(t.MTU), &limitedBackend{Backend: dev, rx: lim.netRx, tx: lim.netTx, done: done}, log)
	if err != nil {
		dev.Close()
		return nil, "", fmt.Errorf("sandbox: network: %w", err)
	}
	p := netip.MustParsePrefix(t.Address)
	mask := net.IP(net.CIDRMask(p.Bits(), 32)).String()
	// ip=CLIENT::GATEWAY:NETMASK:HOSTNAME:DEVICE:AUTOCONF
	arg := fmt.Sprintf("ip=%s::%s:%s::eth0:off", p.Addr(), t.Gateway, mask)
	return &network{nic: nic, tap: dev, done: done}, arg, nil
}

func (b *Builder) netConfig() *NetworkSpec {
	if b.c.Network == nil {
		b.c.Network = &NetworkSpec{}
	}
	return b.c.Network
}

// intercepts says whether the NAT intercepts any TLS: hosts named for
// it, secrets or header rules.
func (n *NetworkSpec) intercepts() bool {
	return len(n.Intercept)+len(n.Secrets)+len(n.Headers) > 0
}

// checkNetwork reports options that need Network without it.
func (c *config) checkNetwork() error {
	if c.Network != nil && c.Network.Tap != nil {
		n := c.Network
		if n.Policy != nil || len(n.Publish)+len(n.UpstreamCAs) > 0 || n.intercepts() || n.DNSServer != "" || n.EgressProxy != nil {
			return errors.New("sandbox: a tap network has no NAT: no policy, published ports, DNS server, egress proxy, secrets or TLS interception")
		}
		return nil
	}
	if c.Network != nil && c.Network.Policy == nil {
		return errors.New("sandbox: published ports, a DNS server, an egress proxy, secrets and TLS interception need Network (the sandbox has no network)")
	}
	return nil
}

// network is a running sandbox network: the NAT, the NIC and the TLS
// proxy, if it intercepts.
type network struct {
	stack     *netstack.Stack // nil on a tap
	tap       *tap.Device     // nil on the NAT
	nic       *virtionet.Device
	intercept *interception
	flows     *auditlog.Log[netstack.Flow] // the latest of the NAT's audit records
	proxy     *egressDialer                // nil on a tap
	done      chan struct{}                // closed at close: limited frames stop waiting
}

// interception is the network's TLS proxy; nil without one.
func (n *network) interception() *interception {
	if n == nil {
		return nil
	}
	return n.intercept
}

func startNetwork(ctx context.Context, c config, lim *limiters, log *slog.Logger) (_ *network, _ string, err error) {
	nc := c.Network
	if nc.Tap != nil {
		return startTap(nc.Tap, lim, log)
	}
	// The audit log's two sources, the NAT's flows and the TLS proxy's
	// requests, write whole lines to one writer.
	var audit io.Writer
	if c.netAudit != nil {
		audit = &auditlog.SyncWriter{W: c.netAudit}
	}
	in, err := startInterception(c, audit, log)
	if err != nil {
		return nil, "", err
	}
	defer func() {
		if err != nil {
			in.close()
		}
	}()
	flows := auditlog.New[netstack.Flow](auditKeep, audit)
	cfg := netstack.Config{GuestMAC: guestMAC, Policy: nc.Policy, Logger: log, Audit: flows.Add}
	if in != nil {
		cfg.Intercept = in.proxy
	}
	for _, p := range nc.Publish {
		m, err := netstack.ParsePublish(p)
		if err != nil {
			return nil, "", fmt.Errorf("sandbox: publish: %w", err)
		}
		cfg.Publish = append(cfg.Publish, m)
	}
	if nc.DNSServer != "" {
		upstream := nc.DNSServer
		cfg.Resolver = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, upstream)
		}}
	}
	proxy := &egressDialer{resolver: cfg.Resolver, nonPublic: netstack.NonPublicChecker()}
	if p := nc.EgressProxy; p != nil {
		px := p.proxy(c.secrets)
		if err := proxy.set(&px); err != nil {
			return nil, "", fmt.Errorf("sandbox: %w", err)
		}
	}
	cfg.Dial = proxy.DialContext
	st, err := netstack.New(ctx, cfg)
	if err != nil {
		return nil, "", fmt.Errorf("sandbox: network: %w", err)
	}
	a := st.Addrs()
	done := make(chan struct{})
	nic, err := virtionet.New(guestMAC, uint16(a.MTU), &limitedBackend{Backend: st, rx: lim.netRx, tx: lim.netTx, done: done}, log)
	if err != nil {
		st.Close()
		return nil, "", fmt.Errorf("sandbox: network: %w", err)
	}
	// The kernel configures the NIC before init runs (CONFIG_IP_PNP):
	// ip=CLIENT::GATEWAY:NETMASK:HOSTNAME:DEVICE:AUTOCONF:DNS.
	mask := net.IP(net.CIDRMask(a.GuestIP.Bits(), 32)).String()
	arg := fmt.Sprintf("ip=%s::%s:%s::eth0:off:%s", a.GuestIP.Addr(), a.Gateway, mask, a.DNS)
	return &network{stack: st, nic: nic, intercept: in, flows: flows, proxy: proxy, done: done}, arg, nil
}

func (n *network) close() error {
	if n == nil {
		return nil
	}
	close(n.done)
	if n.tap != nil {
		return errors.Join(n.nic.Close(), n.tap.Close())
	}
	return errors.Join(n.nic.Close(), n.stack.Close(), n.intercept.close())
}

// NetFlows returns the last records of the sandbox's egress audit log
// (at most 1000), oldest first: its DNS queries and the TCP connections
// and UDP flows it opened or was refused (package netstack, "Audit"); nil
// without a network. Workload.NetAudit receives every one as it happens.
func (s *Sandbox) NetFlows() []netstack.Flow {
	if s.net == nil || s.net.flows == nil {
		return nil
	}
	return s.net.flows.Records()
}

// Published lists the sandbox's published ports with the host addresses
// they listen on.
func (s *Sandbox) Published() []netstack.Published {
	if nat := s.nat(); nat != nil {
		return nat.Published()
	}
	return nil
}

// nat is the sandbox's NAT; nil without one (no network, or a tap).
func (s *Sandbox) nat() *netstack.Stack {
	if s.net == nil {
		return nil
	}
	return s.net.stack
}

// ErrNoNAT is SetNetworkPolicy's error for a sandbox without capsa's NAT:
// no network, or a tap.
var ErrNoNAT = errors.New("the sandbox has no NAT (it was made without a network, or on a tap)")

// SetNetworkPolicy puts p in force on the running sandbox's NAT (nil:
// public-only) for every new connection and DNS query; connections under
// way go on. A sandbox made without a network gets none this way
// (ErrNoNAT).
func (s *Sandbox) SetNetworkPolicy(p *netstack.Policy) error {
	nat := s.nat()
	if nat == nil {
		return fmt.Errorf("sandbox: set the network policy: %w", ErrNoNAT)
	}
	nat.SetPolicy(p)
	return nil
}

// NetworkPolicy is the policy in force on the sandbox's NAT; nil without
// one.
func (s *Sandbox) NetworkPolicy() *netstack.Policy {
	if nat := s.nat(); nat != nil {
		return nat.Policy()
	}
	return nil
}
