package supervisor

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// headersBody is the header rules to put in force (none: no rules).
type headersBody struct {
	Rules []sandbox.HeaderRule `json:"rules"`
}

// SetHeaderRules replaces the header rules of the sandbox name
// (sandbox.Builder.Header; nil: none): in its record and with its secrets
// for its next start, then at once if it runs. Each rule's host must be
// one the sandbox's CA vouches for, which is fixed by the hosts it
// intercepted when it started: a host that is, or is beneath, one of the
// hosts it intercepts now (its secrets', its interception's, its rules').
// A sandbox that intercepts nothing takes no rules (sandbox.ErrNoInterception),
// one without capsa's NAT none either (sandbox.ErrNoNAT).
func (m *Manager) SetHeaderRules(ctx context.Context, name string, rules []sandbox.HeaderRule) error {
	fail := func(err error) error { return fmt.Errorf("supervisor: set the header rules of %s: %w", name, err) }
	if err := sandbox.CheckHeaderRules(rules); err != nil {
		return fail(err)
	}
	rec, err := m.st.Get(name)
	if err != nil {
		return err
	}
	n := rec.Spec.Network
	if n == nil || n.Tap != nil {
		return fail(sandbox.ErrNoNAT)
	}
	var hosts []string
	hosts = append(hosts, n.Intercept...)
	for _, s := range n.Secrets {
		hosts = append(hosts, s.Hosts...)
	}
	for _, h := range n.Headers {
		hosts = append(hosts, h.Host)
	}
	if len(rules) > 0 && len(hosts) == 0 {
		return fail(sandbox.ErrNoInterception)
	}
	for _, r := range rules {
		if !coveredBy(r.Host, hosts) {
			return fail(fmt.Errorf("header rule %s: %w (%s)", r.Host, sandbox.ErrOutsideCA, strings.Join(hosts, ", ")))
		}
	}
	specs, values := sandbox.HeaderRuleValues(rules)
	// The secrets' values first: a start that reads the record's rules
	// finds their values.
	secrets, err := ReadSecrets(m.st, name)
	if err != nil {
		return fail(err)
	}
	kept := map[string]string{}
	for k, v := range secrets {
		if !sandbox.IsHeaderValue(k) {
			kept[k] = v
		}
	}
	maps.Copy(kept, values)
	if err := m.writeSecrets(name, kept); err != nil {
		return fail(err)
	}
	err = m.st.Update(name, func(r *Record) error {
		if r.Spec.Network == nil {
			return sandbox.ErrNoNAT
		}
		r.Spec.Network.Headers = specs
		return nil
	})
	if err != nil {
		return fail(err)
	}
	if rec, err = m.st.Get(name); err == nil && rec.Alive() {
		err = callLive(ctx, m.st, name, opHeaders, headersBody{Rules: rules})
	}
	return err
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

// writeSecrets is WriteSecrets, removing the file when nothing is left.
func (m *Manager) writeSecrets(name string, values map[string]string) error {
	if len(values) == 0 {
		err := os.Remove(filepath.Join(m.st.SandboxDir(name), SecretsFile))
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		return err
	}
	return WriteSecrets(m.st, name, values)
}

// coveredBy says whether the host pattern h is, or is beneath, one of
// patterns (as a CA made for patterns may name it: tlsproxy.NewCA).
func coveredBy(h string, patterns []string) bool {
	d := strings.TrimPrefix(strings.ToLower(strings.TrimSuffix(h, ".")), "*.")
	for _, p := range patterns {
		p = strings.TrimPrefix(strings.ToLower(strings.TrimSuffix(p, ".")), "*.")
		if d == p || strings.HasSuffix(d, "."+p) {
			return true
		}
	}
	return false
}
