// Package egressproxy tunnels a sandbox's outbound TCP through a SOCKS5
// proxy its user runs (RFC 1928, with RFC 1929's username and password),
// as E2B's network.egressProxy does ("bring your own proxy"). Its starting
// point is E2B's documented SandboxEgressProxyOpts: an address HOST:PORT,
// a username and password of at most 255 bytes each, the password only
// with a username; the tunnel is made on the host after the NAT's policy
// allowed the connection, so nothing in the guest sees the proxy or can
// route around it; and egress fails closed: when the proxy cannot be
// reached or refuses, the guest's connection fails, never goes direct.
//
// The SOCKS5 client itself is golang.org/x/net/proxy's. This package
// adds what a sandbox needs around it: checked settings, the proxy's
// host resolved at each dial and the connection pinned to the address it
// resolved to, and, where the caller asks (Proxy.PublicOnly, for an API
// whose callers are not the host's owner), a proxy address that resolves
// to a loopback, private or otherwise non-public address refused, at each
// dial too, so a name that changes its answer cannot turn the sandbox's
// traffic onto the host's own services.
//
// UDP (DNS, QUIC) is not tunneled, as in E2B: Dialer.DialContext passes
// every network but TCP to the direct dialer.
package egressproxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"golang.org/x/net/proxy"

	"github.com/capsa-sandbox/capsa/netstack"
)

// MaxCredential is the longest username or password RFC 1929 carries.
const MaxCredential = 255

// Proxy is a SOCKS5 proxy's settings.
type Proxy struct {
	// Address is HOST:PORT; HOST is a name or an IP address.
	Address string `json:"address"`
	// Username and Password authenticate to the proxy (RFC 1929); no
	// username: the proxy takes no credentials.
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
	// PublicOnly refuses a proxy address that is, or resolves to, a
	// non-public one (loopback, private, link-local...): Check with a
	// resolver, and every dial.
	PublicOnly bool `json:"public_only,omitempty"`
}

// String is the proxy's address and username, never its password.
func (p Proxy) String() string {
	if p.Username == "" {
		return "socks5://" + p.Address
	}
	return "socks5://" + p.Username + "@" + p.Address
}

// Check checks the settings' form, naming what is wrong; it resolves
// nothing (see Resolve).
func (p Proxy) Check() error {
	host, port, err := net.SplitHostPort(p.Address)
	if err != nil || host == "" {
		return fmt.Errorf("egress proxy address %q: want HOST:PORT", p.Address)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("egress proxy address %q: port %q: want 1 to 65535", p.Address, port)
	}
	if _, err := netip.ParseAddr(host); err != nil {
		// A name as the NAT's domain rules take one, any case, a root
		// dot allowed.
		if err := netstack.CheckDomain(strings.ToLower(strings.TrimSuffix(host, "."))); err != nil {
			return fmt.Errorf("egress proxy address %q: host %q is neither an IP address nor a DNS name: %v", p.Address, host, err)
		}
	}
	if len(p.Username) > MaxCredential || len(p.Password) > MaxCredential {
		return fmt.Errorf("egress proxy %s: a username or password longer than %d bytes (SOCKS5 carries no more)", p.Address, MaxCredential)
	}
	if p.Password != "" && p.Username == "" {
		return fmt.Errorf("egress proxy %s: a password without a username", p.Address)
	}
	return nil
}

// ErrNonPublic is the error for a Proxy.PublicOnly proxy whose address
// is, or resolves to, no public one.
var ErrNonPublic = errors.New("the proxy's address is not a public one")

// Options are what a Dialer needs from the sandbox around it.
type Options struct {
	// Resolver resolves the proxy's host name. nil: net.DefaultResolver.
	Resolver *net.Resolver
	// NonPublic says why an address is not public, or "" (the NAT's own
	// ranges, package netstack); required with Proxy.PublicOnly.
	NonPublic func(netip.Addr) string
}

// Dialer dials TCP through the proxy.
type Dialer struct {
	p      Proxy
	opts   Options
	direct net.Dialer
	socks  withConn
}

// withConn is the SOCKS5 handshake on a connection already made
// (x/net's socks.Dialer.DialWithConn): the connection to the proxy is
// made here, pinned, and stays a *net.TCPConn the NAT can half-close.
type withConn interface {
	DialWithConn(ctx context.Context, c net.Conn, network, address string) (net.Addr, error)
}

// New returns a Dialer for p, once p.Check passes.
func New(p Proxy, opts Options) (*Dialer, error) {
	if err := p.Check(); err != nil {
		return nil, err
	}
	if p.PublicOnly && opts.NonPublic == nil {
		return nil, errors.New("egressproxy: PublicOnly needs Options.NonPublic")
	}
	if opts.Resolver == nil {
		opts.Resolver = net.DefaultResolver
	}
	d := &Dialer{p: p, opts: opts}
	var auth *proxy.Auth
	if p.Username != "" {
		auth = &proxy.Auth{User: p.Username, Password: p.Password}
	}
	s, err := proxy.SOCKS5("tcp", p.Address, auth, nil)
	if err != nil {
		return nil, fmt.Errorf("egress proxy %s: %w", p, err)
	}
	wc, ok := s.(withConn)
	if !ok {
		return nil, fmt.Errorf("egress proxy %s: the SOCKS5 client cannot shake hands on a connection of its caller's", p)
	}
	d.socks = wc
	return d, nil
}

// Proxy is the dialer's settings.
func (d *Dialer) Proxy() Proxy { return d.p }

// DialContext dials addr ("IP:port") through the proxy for "tcp", "tcp4"
// and "tcp6", and directly for every other network. The connection is a
// *Conn. An error names the proxy (never its password) and is the
// guest's connection refused.
func (d *Dialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	switch network {
	case "tcp", "tcp4", "tcp6":
	default:
		return d.direct.DialContext(ctx, network, addr)
	}
	c, err := d.dialProxy(ctx)
	if err != nil {
		return nil, fmt.Errorf("egress proxy %s: dial %s: %w", d.p, addr, err)
	}
	// The handshake's reads are bounded by the proxy's answers' sizes
	// and by ctx's deadline, which x/net puts on the connection.
	if _, err := d.socks.DialWithConn(ctx, c, "tcp", addr); err != nil {
		c.Close()
		return nil, fmt.Errorf("egress proxy %s: dial %s: %w", d.p, addr, err)
	}
	return &Conn{TCPConn: c, via: d.p.String()}, nil
}

// Conn is a connection through the proxy: the TCP connection to the
// proxy, past its handshake.
type Conn struct {
	*net.TCPConn
	via string
}

// Via names the proxy the connection goes through (Proxy.String), for
// the NAT's audit log.
func (c *Conn) Via() string { return c.via }

// Resolve resolves the proxy's host as a dial does, and refuses it as a
// dial would (Proxy.PublicOnly); it opens no connection. A front end
// calls it to refuse a bad proxy before a sandbox is made.
func (d *Dialer) Resolve(ctx context.Context) ([]netip.Addr, error) {
	host, _, _ := net.SplitHostPort(d.p.Address) // checked by New
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		got, err := d.opts.Resolver.LookupNetIP(ctx, "ip", host)
		if err != nil {
			return nil, fmt.Errorf("egress proxy %s: resolve %s: %w", d.p, host, err)
		}
		addrs = got
	}
	if !d.p.PublicOnly {
		return addrs, nil
	}
	var why string
	public := addrs[:0:0]
	for _, a := range addrs {
		if w := d.opts.NonPublic(a); w != "" {
			why = w
			continue
		}
		public = append(public, a)
	}
	switch {
	case len(public) > 0:
		return public, nil
	case len(addrs) == 1 && addrs[0].String() == host:
		// An address the caller gave: say what it is.
		return nil, fmt.Errorf("egress proxy %s: %w (%s)", d.p, ErrNonPublic, why)
	default:
		// What a name resolved to is the host's resolver's answer,
		// which the caller (an API's) may not learn.
		return nil, fmt.Errorf("egress proxy %s: %w (%s resolves to none)", d.p, ErrNonPublic, host)
	}
}

// dialProxy connects to the proxy: it resolves the proxy's host now and
// connects to an address it resolved to, the first that answers, so the
// check and the connection see the same address.
func (d *Dialer) dialProxy(ctx context.Context) (*net.TCPConn, error) {
	_, port, _ := net.SplitHostPort(d.p.Address) // checked by New
	addrs, err := d.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, a := range addrs {
		c, err := d.direct.DialContext(ctx, "tcp", net.JoinHostPort(a.String(), port))
		if err == nil {
			return c.(*net.TCPConn), nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errors.Join(errs...)
}
