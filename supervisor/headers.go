package supervisor

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
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
// asked of the sandbox when it has no rules and gets none. One that is
// starting is waited for and takes them once it runs; a stopped one does
// not start until its record has them (changeNetwork).
func (m *Manager) SetHeaderRules(ctx context.Context, name string, rules []sandbox.HeaderRule) error {
	fail := func(err error) error { return fmt.Errorf("supervisor: set the header rules of %s: %w", name, err) }
	if err := sandbox.CheckHeaderRules(rules); err != nil {
		return fail(err)
	}
	specs, values := sandbox.HeaderRuleValues(rules)
	err := m.withSettings(ctx, name, func() error {
		return m.changeNetwork(ctx, name, changeNetwork{
			check: func(rec *Record) (bool, error) {
				n := rec.Spec.Network
				if n == nil || n.Tap != nil {
					return false, sandbox.ErrNoNAT
				}
				if len(rules) == 0 && len(n.Headers) == 0 {
					return false, nil
				}
				if !rec.Alive() && rec.RestoreFrom != "" {
					return true, sandbox.CheckSnapshotCA(rec.RestoreFrom, specs)
				}
				return true, nil
			},
			live: func(ctx context.Context) error {
				return callLive(ctx, m.st, name, opHeaders, headersBody{Rules: rules})
			},
			replaced: sandbox.IsHeaderValue,
			values:   values,
			change:   func(n *sandbox.NetworkSpec) { n.Headers = specs },
		})
	})
	if err != nil {
		return fail(err)
	}
	return nil
}

// changeNetwork is a change of a network setting whose values are kept
// with the sandbox's secrets (header rules, the egress proxy's password).
type changeNetwork struct {
	// check refuses the change for the record as it stands, or finds
	// nothing to do (false).
	check func(*Record) (bool, error)
	// live puts the setting in force in the running sandbox.
	live func(context.Context) error
	// replaced says which secret values are the setting's, values are
	// its new ones, and change sets it in the record's network.
	replaced func(key string) bool
	values   map[string]string
	change   func(*sandbox.NetworkSpec)
}

// settingsBusy bounds how long changeNetwork waits while a sandbox that
// is not running has its lock held: by a supervisor on its way out, a
// start claiming it, or another process changing its settings.
const settingsBusy = 30 * time.Second

// changeNetwork makes c in the sandbox name; the caller holds its settings
// lock (withSettings), which orders the changes of one sandbox's network
// made by any process: without it, two changes of a running sandbox could
// reach it in one order and its record in the other, or one rewrite of the
// secrets lose another's. A stopped sandbox's record and secrets are
// rewritten under its liveness lock too (store.WhileStopped), so that a
// start cannot read the old ones meanwhile and run with them while the
// record says otherwise; a running one takes the setting first (one that
// is starting is waited for until it runs), then its record is rewritten.
// One that ends before it takes the setting has its record rewritten as a
// stopped one's.
func (m *Manager) changeNetwork(ctx context.Context, name string, c changeNetwork) error {
	rewrite := func(rec *Record) error {
		if ok, err := c.check(rec); !ok || err != nil {
			return err
		}
		return m.rewriteNetwork(name, c.replaced, c.values, c.change)
	}
	deadline := time.Now().Add(settingsBusy)
	for {
		stopped, err := m.st.WhileStopped(name, rewrite)
		if err != nil || stopped {
			return err
		}
		// Refused, or nothing to do, is said without waiting for it.
		rec, err := m.st.Get(name)
		if err != nil {
			return err
		}
		if ok, err := c.check(rec); !ok || err != nil {
			return err
		}
		if rec.Alive() {
			if rec, err = m.waitStarted(ctx, name); err != nil {
				return err
			}
			if rec.Alive() {
				err := c.live(ctx)
				if errors.Is(err, ErrNotRunning) {
					continue // it ended meanwhile
				}
				if err != nil {
					return err
				}
				return m.rewriteNetwork(name, c.replaced, c.values, c.change)
			}
			continue // it ended meanwhile: its record alone, then
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("its lock stayed held for %s while it was not running", settingsBusy)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// withSettings runs fn holding the settings lock of the sandbox name
// (store.SettingsLock), waiting for it up to settingsBusy (and ctx). Every
// change of a sandbox's network settings runs inside one.
func (m *Manager) withSettings(ctx context.Context, name string, fn func() error) error {
	wait, cancel := context.WithTimeout(ctx, settingsBusy)
	defer cancel()
	l, err := m.st.SettingsLock(wait, name)
	if err != nil {
		return err
	}
	defer l.Close()
	return fn()
}

// waitStarted waits while the sandbox name is starting (its record says
// Creating) and returns its record once it runs, is paused or has ended;
// ctx and the sandbox's own ready timeout (and 10 s for its supervisor's
// start) bound the wait.
func (m *Manager) waitStarted(ctx context.Context, name string) (*Record, error) {
	rec, err := m.st.Get(name)
	if err != nil {
		return nil, err
	}
	bound := rec.Spec.ReadyTimeout
	if bound <= 0 {
		bound = sandbox.DefaultReadyTimeout
	}
	deadline := time.Now().Add(bound + 10*time.Second)
	for rec.State == store.Creating {
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("it was still starting after %s", bound)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if rec, err = m.st.Get(name); err != nil {
			return nil, err
		}
	}
	return rec, nil
}

// rewriteNetwork replaces the secret values of the sandbox name that
// replaced says are the setting's with values, then changes its record's
// network with change. The caller holds the settings lock.
func (m *Manager) rewriteNetwork(name string, replaced func(key string) bool, values map[string]string, change func(*sandbox.NetworkSpec)) error {
	secrets, err := readSecrets(m.st, name)
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
	if err := writeSecrets(m.st, name, kept); err != nil {
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
	secrets, err := readSecrets(m.st, name)
	if err != nil {
		return nil, err
	}
	return sandbox.HeaderRulesOf(rec.Spec.Network.Headers, secrets), nil
}
