package netstack

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"time"
)

// Defaults, the QEMU user-networking layout.
var (
	DefaultSubnet     = netip.MustParsePrefix("10.0.2.0/24")
	DefaultGateway    = netip.MustParseAddr("10.0.2.2")
	DefaultDNS        = netip.MustParseAddr("10.0.2.3")
	DefaultGuestIP    = netip.MustParseAddr("10.0.2.15")
	DefaultGatewayMAC = net.HardwareAddr{0x52, 0x55, 0x0a, 0x00, 0x02, 0x02}
)

const (
	DefaultMTU            = 1500
	DefaultDialTimeout    = 10 * time.Second
	DefaultUDPIdleTimeout = 60 * time.Second
	DefaultMaxConns       = 512
	DefaultTCPBuffer      = 256 << 10
	DefaultMaxUDPFlows    = 1024
	DefaultQueueLen       = 1024
)

// Config describes the guest network. Zero fields take the defaults above.
type Config struct {
	// GuestMAC is the guest NIC's address. If set, frames from any other
	// source MAC are dropped and the stack knows the guest's link address
	// without ARP. If nil the stack learns it by ARP.
	GuestMAC net.HardwareAddr
	// GatewayMAC is the link address the stack answers with (gateway, DNS
	// and every off-subnet destination). Default 52:55:0a:00:02:02.
	GatewayMAC net.HardwareAddr

	// Subnet is the guest network (IPv4 only). Gateway, DNS and GuestIP
	// default to .2, .3 and .15 of it and must lie inside it.
	Subnet                netip.Prefix
	Gateway, DNS, GuestIP netip.Addr
	// MTU is the IP MTU of the link (frames carry 14 more bytes).
	MTU uint32

	// Policy decides what the guest may reach. nil = PublicOnly().
	Policy *Policy
	// Publish lists host listeners forwarded to the guest. They are opened
	// by New, so a port in use fails New.
	Publish []PortMapping

	// Resolver resolves names for the DNS server. nil = net.DefaultResolver.
	Resolver *net.Resolver
	// Dial opens host-side connections ("tcp" or "udp", "IP:port").
	// nil = a net.Dialer.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// DialTimeout bounds a host dial; the guest's SYN is answered only when
	// the dial completes. Default 10s.
	DialTimeout time.Duration
	// UDPIdleTimeout closes a UDP flow with no traffic either way. Default 60s.
	UDPIdleTimeout time.Duration
	// MaxConns bounds concurrent forwarded TCP connections (guest-initiated
	// plus published). Default 512. Excess SYNs are reset.
	MaxConns int
	// TCPBuffer bounds each forwarded connection's send and receive
	// buffers in the NAT (gVisor's own default goes to 4 MiB each), so
	// the most one guest's TCP flows can make the host hold is about
	// MaxConns x 2 x TCPBuffer (256 MiB by default). Default 256 KiB.
	TCPBuffer int
	// MaxUDPFlows bounds concurrent UDP flows. Default 1024. Excess
	// datagrams are dropped.
	MaxUDPFlows int
	// QueueLen is the number of frames buffered toward the guest; when the
	// queue is full frames are dropped like a NIC would. Default 1024.
	QueueLen int
	// Intercept, when not nil, is offered every guest TCP connection the
	// policy allowed once its host side is connected (package tlsproxy's
	// Proxy intercepts TLS with it). The Stack does not close it.
	Intercept Interceptor

	// Audit, when not nil, receives the egress audit log: a Flow for each
	// DNS query, and for each TCP connection and UDP flow the guest opens
	// or is refused, and its close (package doc, "Audit"). It is called
	// from many goroutines and must not block for long; refusals past
	// auditRefusals a second are summarised, not passed on one by one.
	Audit func(Flow)

	// Logger receives diagnostics. nil = discard.
	Logger *slog.Logger
}

// Interceptor takes over guest TCP connections (Config.Intercept).
type Interceptor interface {
	// Intercept gets the guest's side of a connection to dst and its host
	// side, connected to dst. It either serves the connection itself and
	// returns nil once done (both sides closed), or returns the guest's
	// side to relay to host as usual (wrapping what it read of it), host
	// untouched. redial opens another host connection to dst, counted
	// against Config.MaxConns until closed.
	Intercept(guest, host net.Conn, dst netip.AddrPort, redial func(context.Context) (net.Conn, error)) net.Conn
}

// Addrs is what the guest must configure on its NIC.
type Addrs struct {
	GuestIP    netip.Prefix // address and prefix length, e.g. 10.0.2.15/24
	Gateway    netip.Addr   // default route
	DNS        netip.Addr   // name server
	MTU        uint32       // IP MTU
	GatewayMAC net.HardwareAddr
}

// withDefaults fills zero fields and validates the result.
func (c Config) withDefaults() (Config, error) {
	if !c.Subnet.IsValid() {
		c.Subnet = DefaultSubnet
	}
	c.Subnet = c.Subnet.Masked()
	if !c.Subnet.Addr().Is4() {
		return c, fmt.Errorf("netstack: subnet %s: only IPv4 guest networks are supported", c.Subnet)
	}
	if c.Subnet.Bits() > 29 {
		return c, fmt.Errorf("netstack: subnet %s: prefix too long, want /29 or shorter", c.Subnet)
	}
	nth := func(n uint32) netip.Addr {
		b := c.Subnet.Addr().As4()
		v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
		v += n
		return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
	}
	if !c.Gateway.IsValid() {
		c.Gateway = nth(2)
	}
	if !c.DNS.IsValid() {
		c.DNS = nth(3)
	}
	if !c.GuestIP.IsValid() {
		if c.Subnet.Bits() <= 27 {
			c.GuestIP = nth(15)
		} else {
			c.GuestIP = nth(4)
		}
	}
	bcast := nth(1<<(32-c.Subnet.Bits()) - 1)
	for _, a := range []struct {
		name string
		addr netip.Addr
	}{{"gateway", c.Gateway}, {"DNS", c.DNS}, {"guest IP", c.GuestIP}} {
		if !a.addr.Is4() || !c.Subnet.Contains(a.addr) || a.addr == c.Subnet.Addr() || a.addr == bcast {
			return c, fmt.Errorf("netstack: %s %s: want a host address inside subnet %s", a.name, a.addr, c.Subnet)
		}
	}
	if c.Gateway == c.GuestIP || c.DNS == c.GuestIP {
		return c, fmt.Errorf("netstack: guest IP %s collides with the gateway or DNS address", c.GuestIP)
	}
	if c.MTU == 0 {
		c.MTU = DefaultMTU
	}
	if c.MTU < 576 || c.MTU > 65535-14 {
		return c, fmt.Errorf("netstack: MTU %d: want 576-65521", c.MTU)
	}
	if c.GatewayMAC == nil {
		c.GatewayMAC = DefaultGatewayMAC
	}
	if err := checkMAC("gateway", c.GatewayMAC); err != nil {
		return c, err
	}
	if c.GuestMAC != nil {
		if err := checkMAC("guest", c.GuestMAC); err != nil {
			return c, err
		}
		if string(c.GuestMAC) == string(c.GatewayMAC) {
			return c, errors.New("netstack: guest MAC equals gateway MAC")
		}
	}
	if c.Policy == nil {
		c.Policy = PublicOnly()
	}
	if c.Resolver == nil {
		c.Resolver = net.DefaultResolver
	}
	if c.Dial == nil {
		var d net.Dialer
		c.Dial = d.DialContext
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.UDPIdleTimeout <= 0 {
		c.UDPIdleTimeout = DefaultUDPIdleTimeout
	}
	if c.MaxConns <= 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.MaxUDPFlows <= 0 {
		c.MaxUDPFlows = DefaultMaxUDPFlows
	}
	if c.TCPBuffer <= 0 {
		c.TCPBuffer = DefaultTCPBuffer
	}
	c.TCPBuffer = max(c.TCPBuffer, 16<<10)
	if c.QueueLen <= 0 {
		c.QueueLen = DefaultQueueLen
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	for i, m := range c.Publish {
		if err := m.validate(); err != nil {
			return c, fmt.Errorf("netstack: publish[%d] %s: %w", i, m, err)
		}
	}
	return c, nil
}

func checkMAC(what string, mac net.HardwareAddr) error {
	if len(mac) != 6 {
		return fmt.Errorf("netstack: %s MAC %s: want 6 bytes", what, mac)
	}
	if mac[0]&1 != 0 {
		return fmt.Errorf("netstack: %s MAC %s: multicast address", what, mac)
	}
	return nil
}
