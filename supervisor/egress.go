package supervisor

import (
	"context"
	"fmt"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// egressBody is the egress proxy to put in force (nil: none).
type egressBody struct {
	Proxy *sandbox.EgressProxy `json:"proxy"`
}

// SetEgressProxy puts the SOCKS5 proxy p in force for the outbound TCP of
// the sandbox name (sandbox.Builder.EgressProxy; nil: none, straight
// out): at once if it runs, then in its record and, for the password,
// its secrets file, for its next start. A sandbox without capsa's NAT
// takes none (sandbox.ErrNoNAT). Nothing is changed when p is refused
// (a failure to write the record after the running sandbox took it
// leaves the two apart until the next update), and nothing is asked of
// the sandbox when it has no proxy and gets none.
func (m *Manager) SetEgressProxy(ctx context.Context, name string, p *sandbox.EgressProxy) error {
	fail := func(err error) error { return fmt.Errorf("supervisor: set the egress proxy of %s: %w", name, err) }
	if p != nil {
		if err := p.Check(); err != nil {
			return fail(err)
		}
	}
	m.headersMu.Lock()
	defer m.headersMu.Unlock()
	rec, err := m.st.Get(name)
	if err != nil {
		return err
	}
	n := rec.Spec.Network
	if p == nil && (n == nil || n.EgressProxy == nil) {
		return nil
	}
	if n == nil || n.Tap != nil {
		return fail(sandbox.ErrNoNAT)
	}
	var spec *sandbox.EgressProxySpec
	values := map[string]string{}
	if p != nil {
		spec, values = sandbox.EgressProxyPassword(*p)
	}
	if rec.Alive() {
		if err := callLive(ctx, m.st, name, opEgress, egressBody{Proxy: p}); err != nil {
			return err
		}
	}
	err = m.rewriteNetwork(name, sandbox.IsEgressProxyPassword, values, func(n *sandbox.NetworkSpec) { n.EgressProxy = spec })
	if err != nil {
		return fail(err)
	}
	return nil
}
