package tlsproxy

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// Header rules: headers the proxy sets on the intercepted requests to a
// host, as E2B's per-domain network transform rules do (its SDK's
// network.rules). Unlike a Secret the guest holds nothing for them and
// nothing of what comes back is looked at: a host that echoes a header
// back hands its value to the guest. A value the guest must never read
// is a Secret's job.

// Bounds on header rules.
const (
	MaxHeaderRules     = 64  // rules in one proxy
	MaxHeadersPerRule  = 32  // headers one rule sets
	maxHeaderNameLen   = 256 // a header's name
	maxHeaderRuleBytes = 64 << 10
)

// HeaderRule sets Headers on every intercepted request to a host Host
// matches (example.com, or *.example.com for its subdomains at any depth,
// not itself), replacing any header of that name the guest sent. For a
// host, the rule whose Host is exactly it wins, else the one with the
// longest wildcard that matches; rules are not merged.
type HeaderRule struct {
	Host    string            `json:"host"`
	Headers map[string]string `json:"headers"`
}

// unsettable are the headers a rule may not set: they frame the request
// or name its host (a rule cannot send a request elsewhere).
var unsettable = []string{"Host", "Content-Length", "Transfer-Encoding", "Connection", "Upgrade",
	"Te", "Trailer", "Keep-Alive", "Proxy-Connection", "Expect"}

// headerRule is a checked HeaderRule.
type headerRule struct {
	pattern
	names  []string // canonical, sorted
	values map[string]string
}

// headerSet is a proxy's checked rules.
type headerSet struct {
	rules []*headerRule
}

// CheckHeaderRules checks rules as Config.Headers and SetHeaders take
// them, naming what is wrong.
func CheckHeaderRules(rules []HeaderRule) error {
	_, err := checkHeaderRules(rules)
	return err
}

func checkHeaderRules(in []HeaderRule) (*headerSet, error) {
	if len(in) > MaxHeaderRules {
		return nil, fmt.Errorf("%d header rules, at most %d", len(in), MaxHeaderRules)
	}
	hs := &headerSet{}
	seen := map[pattern]bool{}
	size := 0
	for _, r := range in {
		p, err := parsePattern(r.Host)
		if err != nil {
			return nil, fmt.Errorf("header rule: %w", err)
		}
		if seen[p] {
			return nil, fmt.Errorf("header rule %s: given twice", p)
		}
		seen[p] = true
		if len(r.Headers) == 0 {
			return nil, fmt.Errorf("header rule %s: no headers", p)
		}
		if len(r.Headers) > MaxHeadersPerRule {
			return nil, fmt.Errorf("header rule %s: %d headers, at most %d", p, len(r.Headers), MaxHeadersPerRule)
		}
		hr := &headerRule{pattern: p, values: map[string]string{}}
		for name, v := range r.Headers {
			cn := http.CanonicalHeaderKey(name)
			switch {
			case len(name) > maxHeaderNameLen || !httpguts.ValidHeaderFieldName(name):
				return nil, fmt.Errorf("header rule %s: %q is not a header name", p, truncate(name, 64))
			case slices.Contains(unsettable, cn) || strings.HasPrefix(cn, "Proxy-"):
				return nil, fmt.Errorf("header rule %s: header %s frames the request or names its host, and no rule may set it", p, cn)
			case len(v) > MaxSecretLen:
				return nil, fmt.Errorf("header rule %s: the value of %s is longer than %d bytes", p, cn, MaxSecretLen)
			case !httpguts.ValidHeaderFieldValue(v):
				return nil, fmt.Errorf("header rule %s: the value of %s has control characters", p, cn)
			}
			if _, dup := hr.values[cn]; dup {
				return nil, fmt.Errorf("header rule %s: header %s given twice (names are case-insensitive)", p, cn)
			}
			hr.values[cn] = v
			hr.names = append(hr.names, cn)
			size += len(cn) + len(v)
		}
		sort.Strings(hr.names)
		hs.rules = append(hs.rules, hr)
	}
	if size > maxHeaderRuleBytes {
		return nil, fmt.Errorf("header rules: %d bytes of names and values, at most %d", size, maxHeaderRuleBytes)
	}
	return hs, nil
}

// match is the rule for host (checked, lower case): an exact one, else
// the longest wildcard; nil if none.
func (hs *headerSet) match(host string) *headerRule {
	if hs == nil {
		return nil
	}
	var best *headerRule
	for _, r := range hs.rules {
		if !r.matches(host) {
			continue
		}
		if !r.wild {
			return r
		}
		if best == nil || len(r.domain) > len(best.domain) {
			best = r
		}
	}
	return best
}

// apply sets r's headers on h.
func (r *headerRule) apply(h http.Header) {
	for _, n := range r.names {
		h[n] = []string{r.values[n]}
	}
}

// CanonicalPattern is the host pattern s as the proxy keeps it: checked
// (see CheckPattern), lower case, without spaces or a trailing dot.
func CanonicalPattern(s string) (string, error) {
	p, err := parsePattern(s)
	if err != nil {
		return "", err
	}
	return p.String(), nil
}

// ErrOutsideCA is SetHeaders' error for a rule whose host the proxy's CA
// cannot vouch for: its name constraints were fixed when it was made
// (NewCA), from the hosts the sandbox intercepted then.
var ErrOutsideCA = errors.New("outside the hosts the sandbox's CA was made for")

// SetHeaders replaces the proxy's header rules (nil: none) for every
// request from now on, requests under way included. Each rule's host must
// be one the proxy's CA may name (ErrOutsideCA otherwise): a rule for a
// host the sandbox did not intercept when it started cannot be added.
func (p *Proxy) SetHeaders(rules []HeaderRule) error {
	hs, err := checkHeaderRulesFor(p.cfg.CA, rules)
	if err != nil {
		return err
	}
	p.headers.Store(hs)
	return nil
}

// checkHeaderRulesFor checks rules (CheckHeaderRules) and that ca may
// name each one's host (CA.CheckHosts).
func checkHeaderRulesFor(ca *CA, rules []HeaderRule) (*headerSet, error) {
	hs, err := checkHeaderRules(rules)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: %w", err)
	}
	for _, r := range hs.rules {
		if !ca.permits(r.pattern) { // parsed already: CheckHosts without parsing again
			return nil, fmt.Errorf("tlsproxy: header rule: %w", ca.outside(r.String()))
		}
	}
	return hs, nil
}

// intercepts says whether connections to name are intercepted: the
// configured hosts, the secrets' and the header rules' in force.
func (p *Proxy) intercepts(name string) bool {
	return matchesAny(p.intercept, name) || p.headers.Load().match(name) != nil
}
