package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"

	"github.com/capsa-sandbox/capsa/internal/auditlog"
	"github.com/capsa-sandbox/capsa/netstack"
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
func (b *Builder) netConfig() *NetworkSpec {
	if b.c.Network == nil {
		b.c.Network = &NetworkSpec{}
	}
	return b.c.Network
}

// checkNetwork reports options that need Network without it.
func (c *config) checkNetwork() error {
	if c.Network != nil && c.Network.Policy == nil {
		return errors.New("sandbox: published ports, a DNS server, secrets and TLS interception need Network (the sandbox has no network)")
	}
	return nil
}

// network is a running sandbox network: the NAT, the NIC and the TLS
// proxy, if it intercepts.
type network struct {
	stack     *netstack.Stack
	nic       *virtionet.Device
	intercept *interception
	flows     *auditlog.Log[netstack.Flow] // the latest of the NAT's audit records
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
	return &network{stack: st, nic: nic, intercept: in, flows: flows, done: done}, arg, nil
}

func (n *network) close() error {
	if n == nil {
		return nil
	}
	close(n.done)
	return errors.Join(n.nic.Close(), n.stack.Close(), n.intercept.close())
}

// NetFlows returns the last records of the sandbox's egress audit log
// (at most 1000), oldest first: its DNS queries and the TCP connections
// and UDP flows it opened or was refused (package netstack, "Audit"); nil
// without a network. Workload.NetAudit receives every one as it happens.
func (s *Sandbox) NetFlows() []netstack.Flow {
	if s.net == nil {
		return nil
	}
	return s.net.flows.Records()
}

// Published lists the sandbox's published ports with the host addresses
// they listen on.
func (s *Sandbox) Published() []netstack.Published {
	if s.net == nil {
		return nil
	}
	return s.net.stack.Published()
}
