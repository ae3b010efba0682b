package supervisor

import (
	"context"
	"fmt"
	"maps"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// headersBody is the header rules to put in force (none: no rules).
type headersBody struct {
	Rules []sandbox.HeaderRule `json:"rules"`
}

// SetHeaderRules replaces the header rules of the sandbox name
// (sandbox.Builder.Header; nil: none): at once if it runs, then in its
// record and with its secrets for its next start. Each rule's host must
// be one the sandbox's CA may name (sandbox.ErrOutsideCA): a running
// sandbox's proxy checks that, and a suspended one's snapshot's CA;
// a sandbox that never ran, or was suspended without interception, gets
// a CA for its rules when it starts. A running sandbox that intercepts
// nothing takes no rules (sandbox.ErrNoInterception), one without capsa's
// NAT none either (sandbox.ErrNoNAT). Nothing is changed when the rules
// are refused (a failure to write the record after the running sandbox
// took them leaves the two apart until the next update), and nothing is
// asked of the sandbox when it has no rules and gets none.
func (m *Manager) SetHeaderRules(ctx context.Context, name string, rules []sandbox.HeaderRule) error {
	fail := func(err error) error { return fmt.Errorf("supervisor: set the header rules of %s: %w", name, err) }
	if err := sandbox.CheckHeaderRules(rules); err != nil {
		return fail(err)
	}
	m.headersMu.Lock()
	defer m.headersMu.Unlock()
	rec, err := m.st.Get(name)
	if err != nil {
		return err
	}
	n := rec.Spec.Network
	if n == nil || n.Tap != nil {
		return fail(sandbox.ErrNoNAT)
	}
	if len(rules) == 0 && len(n.Headers) == 0 {
		return nil
	}
	specs, values := sandbox.HeaderRuleValues(rules)
	if rec.Alive() {
		if err := callLive(ctx, m.st, name, opHeaders, headersBody{Rules: rules}); err != nil {
			return err
		}
	} else if rec.RestoreFrom != "" {
		if err := sandbox.CheckSnapshotCA(rec.RestoreFrom, specs); err != nil {
			return fail(err)
		}
	}
	err = m.rewriteNetwork(name, sandbox.IsHeaderValue, values, func(n *sandbox.NetworkSpec) { n.Headers = specs })
	if err != nil {
		return fail(err)
	}
	return nil
}

// rewriteNetwork replaces the secret values of the sandbox name that
// replaced says are the setting's with values, then changes its record's
// network with change: a setting whose values are kept with its secrets
// (header rules, the egress proxy's password). The caller holds
// headersMu.
func (m *Manager) rewriteNetwork(name string, replaced func(key string) bool, values map[string]string, change func(*sandbox.NetworkSpec)) error {
	secrets, err := ReadSecrets(m.st, name)
	if err != nil {
		return err
	}
	kept := map[string]string{}
	for k, v := range secrets {
		if !replaced(k) {
			kept[k] = v
		}
	}
	maps.Copy(kept, values)
	if err := WriteSecrets(m.st, name, kept); err != nil {
		return err
	}
	return m.st.Update(name, func(r *Record) error {
		if r.Spec.Network == nil {
			return sandbox.ErrNoNAT
		}
		change(r.Spec.Network)
		return nil
	})
}

// HeaderRules are the header rules of the sandbox name with their values,
// for a front end that shows them to whoever set them.
func (m *Manager) HeaderRules(name string) ([]sandbox.HeaderRule, error) {
	rec, err := m.st.Get(name)
	if err != nil {
		return nil, err
	}
	if rec.Spec.Network == nil || len(rec.Spec.Network.Headers) == 0 {
		return nil, nil
	}
	secrets, err := ReadSecrets(m.st, name)
	if err != nil {
		return nil, err
	}
	return sandbox.HeaderRulesOf(rec.Spec.Network.Headers, secrets), nil
}
