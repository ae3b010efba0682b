package sandbox

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"

	"github.com/capsa-sandbox/capsa/egressproxy"
	"github.com/capsa-sandbox/capsa/netstack"
)

// EgressProxy is a SOCKS5 proxy for the sandbox's outbound TCP
// (egressproxy.Proxy), as Builder.EgressProxy and SetEgressProxy take it.
type EgressProxy = egressproxy.Proxy

// EgressProxySpec is an egress proxy as a Spec holds it: never its
// password, which like secrets' values is given at start
// (Workload.Secrets, under egressProxyKey), so a Spec, a detached
// sandbox's record and a snapshot never hold it.
type EgressProxySpec struct {
	Address    string `json:"address"`
	Username   string `json:"username,omitempty"`
	PublicOnly bool   `json:"public_only,omitempty"`
}

// egressProxyKey is where the proxy's password is among the workload's
// secret values (Workload.Secrets): a secret's name is an environment
// variable's and has no space.
const egressProxyKey = "egress-proxy password"

// EgressProxyPassword is the secret value (Workload.Secrets) that holds
// p's password, for a front end that keeps it with a sandbox's secrets,
// and p as a Spec holds it.
func EgressProxyPassword(p EgressProxy) (*EgressProxySpec, map[string]string) {
	values := map[string]string{}
	if p.Password != "" {
		values[egressProxyKey] = p.Password
	}
	return &EgressProxySpec{Address: p.Address, Username: p.Username, PublicOnly: p.PublicOnly}, values
}

// IsEgressProxyPassword says whether a secret value's key
// (Workload.SecretValues) is the egress proxy's password.
func IsEgressProxyPassword(key string) bool { return key == egressProxyKey }

// proxy is the proxy of s with its password from values.
func (s EgressProxySpec) proxy(values map[string]string) EgressProxy {
	return EgressProxy{Address: s.Address, Username: s.Username, Password: values[egressProxyKey], PublicOnly: s.PublicOnly}
}

// EgressProxy tunnels the sandbox's outbound TCP through the SOCKS5 proxy
// p, on the host, after the network policy allowed each connection (and
// after TLS interception, whose own connections go through it too); UDP
// (DNS, QUIC) goes out directly. Egress fails closed: a connection the
// proxy cannot make fails in the guest, never goes direct. With
// p.PublicOnly the proxy's address must be, and resolve at every dial to,
// a public one. It needs Network. The password is kept like a secret's
// value: never in the Spec.
func (b *Builder) EgressProxy(p EgressProxy) *Builder {
	if err := p.Check(); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %w", err))
		return b
	}
	spec, values := EgressProxyPassword(p)
	b.egressProxy(*spec)
	if b.c.secrets == nil {
		b.c.secrets = map[string]string{}
	}
	delete(b.c.secrets, egressProxyKey)
	for k, v := range values {
		b.c.secrets[k] = v
	}
	return b
}

// egressProxy sets the proxy as a Spec holds it, checked.
func (b *Builder) egressProxy(s EgressProxySpec) {
	if err := s.proxy(nil).Check(); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %w", err))
		return
	}
	b.netConfig().EgressProxy = &s
}

// ErrNonPublicProxy is CheckEgressProxy's error for a PublicOnly proxy
// whose address is, or resolves to, no public one.
var ErrNonPublicProxy = egressproxy.ErrNonPublic

// CheckEgressProxy checks p as a sandbox takes it, and resolves its host
// now as a dial would (the host's resolver), refusing a PublicOnly proxy
// on no public address (ErrNonPublicProxy): for a front end to refuse a
// bad proxy before a sandbox is made. It opens no connection.
func CheckEgressProxy(ctx context.Context, p EgressProxy) error {
	d, err := egressproxy.New(p, egressproxy.Options{NonPublic: netstack.NonPublicChecker()})
	if err != nil {
		return err
	}
	_, err = d.Resolve(ctx)
	return err
}

// egressDialer is the NAT's dialer: through the proxy in force, if any,
// or directly. The proxy can be replaced while the sandbox runs.
type egressDialer struct {
	resolver  *net.Resolver
	nonPublic func(netip.Addr) string // a PublicOnly proxy's check
	direct    net.Dialer
	cur       atomic.Pointer[egressproxy.Dialer]
}

// set puts p in force (nil: none) for every dial from now on.
func (e *egressDialer) set(p *EgressProxy) error {
	if p == nil {
		e.cur.Store(nil)
		return nil
	}
	d, err := egressproxy.New(*p, egressproxy.Options{Resolver: e.resolver, NonPublic: e.nonPublic})
	if err != nil {
		return err
	}
	e.cur.Store(d)
	return nil
}

func (e *egressDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	if d := e.cur.Load(); d != nil {
		return d.DialContext(ctx, network, addr)
	}
	return e.direct.DialContext(ctx, network, addr)
}

// SetEgressProxy puts the proxy p in force on the running sandbox (nil:
// none, connections go out directly) for every new TCP connection;
// connections under way go on where they were. A sandbox without capsa's
// NAT takes none (ErrNoNAT).
func (s *Sandbox) SetEgressProxy(p *EgressProxy) error {
	if s.net == nil || s.net.proxy == nil {
		if p == nil {
			return nil
		}
		return fmt.Errorf("sandbox: set the egress proxy: %w", ErrNoNAT)
	}
	// set checks p (egressproxy.New) before anything changes.
	if err := s.net.proxy.set(p); err != nil {
		return fmt.Errorf("sandbox: set the egress proxy: %w", err)
	}
	return nil
}
