package supervisor

import (
	"context"
	"fmt"
	"strings"

	"github.com/capsa-sandbox/capsa/netstack"
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
// the sandbox when it has no proxy and gets none. One that is starting is
// waited for and takes it once it runs; a stopped one does not start
// until its record has it (changeNetwork).
func (m *Manager) SetEgressProxy(ctx context.Context, name string, p *sandbox.EgressProxy) error {
	if err := checkEgressProxy(name, p); err != nil {
		return err
	}
	return m.withSettings(ctx, name, func() error { return m.setEgressProxy(ctx, name, p) })
}

// checkEgressProxy refuses a malformed proxy, before any lock is waited
// for (nil, none, is fine).
func checkEgressProxy(name string, p *sandbox.EgressProxy) error {
	if p == nil {
		return nil
	}
	if err := p.Check(); err != nil {
		return fmt.Errorf("supervisor: set the egress proxy of %s: %w", name, err)
	}
	return nil
}

// setEgressProxy is SetEgressProxy with p checked and the settings lock
// held.
func (m *Manager) setEgressProxy(ctx context.Context, name string, p *sandbox.EgressProxy) error {
	fail := func(err error) error { return fmt.Errorf("supervisor: set the egress proxy of %s: %w", name, err) }
	var spec *sandbox.EgressProxySpec
	values := map[string]string{}
	if p != nil {
		spec, values = sandbox.EgressProxyPassword(*p)
	}
	err := m.changeNetwork(ctx, name, changeNetwork{
		check: func(rec *Record) (bool, error) {
			n := rec.Spec.Network
			if p == nil && (n == nil || n.EgressProxy == nil) {
				return false, nil
			}
			if n == nil || n.Tap != nil {
				return false, sandbox.ErrNoNAT
			}
			return true, nil
		},
		live: func(ctx context.Context) error {
			return callLive(ctx, m.st, name, opEgress, egressBody{Proxy: p})
		},
		replaced: sandbox.IsEgressProxyPassword,
		values:   values,
		change:   func(n *sandbox.NetworkSpec) { n.EgressProxy = spec },
	})
	if err != nil {
		return fail(err)
	}
	return nil
}

// NetworkUpdate is a change of a sandbox's network policy and egress
// proxy made together (UpdateNetwork).
type NetworkUpdate struct {
	// Policy is the new policy; nil leaves it as it is.
	Policy *netstack.Policy
	// SetProxy says Proxy is the new egress proxy (nil: none); false
	// leaves the proxy as it is.
	SetProxy bool
	Proxy    *sandbox.EgressProxy
}

// The steps of UpdateNetwork, as NetworkStepError names them.
const (
	StepProxy  = "the egress proxy"
	StepPolicy = "the network policy"
)

// NetworkStepError is UpdateNetwork's error: the step that failed (a
// Step* constant), those made before it, and why.
type NetworkStepError struct {
	Step string
	Made []string
	Err  error
}

func (e *NetworkStepError) Error() string {
	if len(e.Made) == 0 {
		return e.Err.Error()
	}
	return fmt.Sprintf("%v (%s was changed before this)", e.Err, strings.Join(e.Made, " and "))
}

func (e *NetworkStepError) Unwrap() error { return e.Err }

// UpdateNetwork makes u in the sandbox name, holding its settings lock
// throughout, so that no other change of its network interleaves, and in
// the order that never lets a connection out directly that either the old
// or the new settings would have sent through a proxy: a new proxy goes in
// before the policy that may open connections through it, and a proxy
// taken away goes after the policy (as E2B's updateNetwork documents it).
// Each step is SetEgressProxy's or SetNetworkPolicy's. A step that fails
// ends it with a *NetworkStepError naming it and the steps made before it
// (a failed policy step may have changed the record and not the running
// sandbox: SetNetworkPolicy writes the record first).
func (m *Manager) UpdateNetwork(ctx context.Context, name string, u NetworkUpdate) error {
	type step struct {
		what string
		do   func() error
	}
	var steps []step
	proxy := step{StepProxy, func() error { return m.setEgressProxy(ctx, name, u.Proxy) }}
	if u.SetProxy && u.Proxy != nil {
		steps = append(steps, proxy)
	}
	if u.Policy != nil {
		steps = append(steps, step{StepPolicy, func() error { return m.setNetworkPolicy(ctx, name, u.Policy) }})
	}
	if u.SetProxy && u.Proxy == nil {
		steps = append(steps, proxy)
	}
	if len(steps) == 0 {
		return nil
	}
	if u.SetProxy {
		if err := checkEgressProxy(name, u.Proxy); err != nil {
			return &NetworkStepError{Step: StepProxy, Err: err}
		}
	}
	return m.withSettings(ctx, name, func() error {
		var made []string
		for _, s := range steps {
			if err := s.do(); err != nil {
				return &NetworkStepError{Step: s.what, Made: made, Err: err}
			}
			made = append(made, s.what)
		}
		return nil
	})
}
