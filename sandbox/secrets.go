package sandbox

// Secrets that never enter the VM: the guest holds placeholders, and the
// NAT's TLS proxy (package tlsproxy) puts the values in on intercepted
// connections to the hosts each secret is for.

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/tlsproxy"
)

// Where the guest finds the sandbox's CA: a file of its own, and appended
// to the usual bundle (made if the root has none), which the environment
// points the usual clients at.
const (
	CAFile   = "/etc/ssl/certs/capsa-ca.pem"
	CABundle = "/etc/ssl/certs/ca-certificates.crt"
)

// caEnv is what TLSIntercept and Secret add to the environment.
var caEnv = []string{
	"SSL_CERT_FILE=" + CABundle,      // OpenSSL: python's ssl, curl, ...
	"REQUESTS_CA_BUNDLE=" + CABundle, // python requests
	"CURL_CA_BUNDLE=" + CABundle,
	"NODE_EXTRA_CA_CERTS=" + CAFile, // added to Node's own roots
}

// snapshotCAFile is the CA (its key included, 0600) in a snapshot of a
// sandbox with interception, so that a restored guest's trust holds.
const snapshotCAFile = "tls-ca.pem"

// SecretSpec is a secret as a Spec holds it: its name, the placeholder
// the guest holds instead of it, where it may go. Never its value: that
// is given at start (Builder.Secret, Workload.Secrets), so a Spec, a
// detached sandbox's record and a snapshot never hold it.
type SecretSpec struct {
	Name        string   `json:"name"`
	Placeholder string   `json:"placeholder"`
	Hosts       []string `json:"hosts"`
	Body        bool     `json:"body,omitempty"`
}

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// Secret gives the sandbox a secret it never sees: its environment gets
// NAME=<placeholder> (random, the sandbox's own), and on HTTPS requests to
// one of hosts (example.com, *.example.com), which are intercepted, the
// NAT puts value in place of the placeholder in the URL and headers (see
// package tlsproxy; SecretInBody for bodies). A request carrying the
// placeholder to any other intercepted host is refused, and value is
// replaced by the placeholder in what the hosts answer. It needs Network.
func (b *Builder) Secret(name, value string, hosts ...string) *Builder {
	sp := SecretSpec{Name: name, Placeholder: tlsproxy.NewPlaceholder(), Hosts: hosts}
	if err := tlsproxy.CheckSecret(tlsproxy.Secret{Name: name, Placeholder: sp.Placeholder, Value: value, Hosts: hosts}); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %w", err))
		return b
	}
	if !b.addSecret(sp) {
		return b
	}
	if b.c.secrets == nil {
		b.c.secrets = map[string]string{}
	}
	b.c.secrets[name] = value
	b.c.Env = append(b.c.Env, name+"="+sp.Placeholder)
	return b
}

// addSecret adds a secret as a Spec holds it, checked.
func (b *Builder) addSecret(sp SecretSpec) bool {
	fail := func(format string, a ...any) bool {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: secret %s: "+format, append([]any{sp.Name}, a...)...))
		return false
	}
	if !envName.MatchString(sp.Name) {
		return fail("want a name for an environment variable (letters, digits, _)")
	}
	if len(sp.Placeholder) < tlsproxy.MinPlaceholderLen {
		return fail("placeholder %q is too short", sp.Placeholder)
	}
	if len(sp.Hosts) == 0 {
		return fail("no hosts to send it to")
	}
	for _, h := range sp.Hosts {
		if err := tlsproxy.CheckPattern(h); err != nil {
			return fail("%v", err)
		}
	}
	nc := b.netConfig()
	if slices.ContainsFunc(nc.Secrets, func(s SecretSpec) bool { return s.Name == sp.Name }) {
		return fail("given twice")
	}
	nc.Secrets = append(nc.Secrets, sp)
	b.addCAEnv()
	return true
}

// SecretInBody substitutes the named secrets in request bodies too
// (buffered, at most tlsproxy.DefaultMaxBody; Content-Length fixed up).
func (b *Builder) SecretInBody(names ...string) *Builder {
	for _, n := range names {
		nc := b.netConfig()
		i := slices.IndexFunc(nc.Secrets, func(s SecretSpec) bool { return s.Name == n })
		if i < 0 {
			b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: secret %s in bodies: no such secret", n))
			continue
		}
		nc.Secrets[i].Body = true
	}
	return b
}

// TLSIntercept intercepts HTTPS to the hosts matching patterns
// (example.com, *.example.com), beside every secret's hosts: the sandbox
// trusts a CA of its own (in its CA bundle, CABundle, and its environment:
// SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, NODE_EXTRA_CA_CERTS),
// and the NAT verifies the real servers. Intercepted requests are in the
// sandbox's audit log (Sandbox.NetAudit). It needs Network.
func (b *Builder) TLSIntercept(patterns ...string) *Builder {
	for _, p := range patterns {
		if err := tlsproxy.CheckPattern(p); err != nil {
			b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: TLS interception: %w", err))
			return b
		}
	}
	if len(patterns) > 0 {
		nc := b.netConfig()
		nc.Intercept = append(nc.Intercept, patterns...)
		b.addCAEnv()
	}
	return b
}

// UpstreamCA adds the certificates in these PEM files (on the host) to
// those an intercepting NAT trusts for the real servers, beside the
// host's trust store: a private server's CA. The guest has no say in it.
func (b *Builder) UpstreamCA(paths ...string) *Builder {
	for _, p := range paths {
		if _, err := readPool(nil, p); err != nil {
			b.c.errs = append(b.c.errs, err)
			return b
		}
	}
	if len(paths) > 0 {
		nc := b.netConfig()
		nc.UpstreamCAs = append(nc.UpstreamCAs, paths...)
	}
	return b
}

// addCAEnv points the guest's clients at its CA bundle, unless the
// environment says otherwise already.
func (b *Builder) addCAEnv() {
	for _, kv := range caEnv {
		k := kv[:strings.IndexByte(kv, '=')+1]
		if !slices.ContainsFunc(b.c.Env, func(e string) bool { return strings.HasPrefix(e, k) }) {
			b.c.Env = append(b.c.Env, kv)
		}
	}
}

// readPool adds the certificates of a PEM file to pool (nil: a new one).
func readPool(pool *x509.CertPool, path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("sandbox: upstream CA: %w", err)
	}
	if pool == nil {
		pool = x509.NewCertPool()
	}
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("sandbox: upstream CA %s: no PEM certificate in it", path)
	}
	return pool, nil
}

// Secrets gives the values of the secrets the workload's Spec names
// (FromSpec: a Spec holds none), by name.
func (w *Workload) Secrets(values map[string]string) *Workload {
	if w.c.secrets == nil {
		w.c.secrets = map[string]string{}
	}
	maps.Copy(w.c.secrets, values)
	return w
}

// SecretValues returns the workload's secrets' values by name, for a
// caller that hands the workload to another process: never put them in
// the Spec, or anywhere it goes.
func (w *Workload) SecretValues() map[string]string { return maps.Clone(w.c.secrets) }

// NetAudit receives the sandbox's egress audit log as it happens, a JSON
// line each: its DNS queries, TCP connections and UDP flows (netstack.Flow,
// "kind" dns, tcp, udp or summary) and its intercepted requests
// (tlsproxy.Record, "kind" http). Sandbox.NetFlows and Sandbox.NetAudit
// keep the last ones too.
func (w *Workload) NetAudit(out io.Writer) *Workload { w.c.netAudit = out; return w }

// interception is a running sandbox's TLS proxy.
type interception struct {
	proxy *tlsproxy.Proxy
	audit *tlsproxy.AuditLog
	ca    *tlsproxy.CA
}

// auditKeep is how many audit records of each kind (flows, intercepted
// requests) a sandbox keeps in memory.
const auditKeep = 1000

// startInterception makes the sandbox's TLS proxy, if it intercepts
// anything: its CA (c.ca, a snapshot's, or a new one), the secrets with
// their values, the upstream trust.
func startInterception(c config, audit io.Writer, log *slog.Logger) (*interception, error) {
	nc := c.Network
	if !nc.intercepts() {
		return nil, nil
	}
	cfg := tlsproxy.Config{Intercept: nc.Intercept, Logger: log, CA: c.ca}
	patterns := slices.Clone(nc.Intercept)
	var err error
	if cfg.Headers, err = headerRules(nc.Headers, c.secrets); err != nil {
		return nil, err
	}
	for _, h := range nc.Headers {
		patterns = append(patterns, h.Host)
	}
	for _, s := range nc.Secrets {
		v, ok := c.secrets[s.Name]
		if !ok {
			return nil, fmt.Errorf("sandbox: secret %s has no value (a Spec holds none: give it with Workload.Secrets or RestoreOptions.Secrets)", s.Name)
		}
		cfg.Secrets = append(cfg.Secrets, tlsproxy.Secret{Name: s.Name, Placeholder: s.Placeholder, Value: v, Hosts: s.Hosts, Body: s.Body})
		patterns = append(patterns, s.Hosts...)
	}
	// The host's roots are read now, not at the first handshake: by
	// then the VMM process may be confined away from them.
	pool, err := x509.SystemCertPool()
	if err != nil {
		pool = x509.NewCertPool()
	}
	for _, p := range nc.UpstreamCAs {
		if pool, err = readPool(pool, p); err != nil {
			return nil, err
		}
	}
	cfg.RootCAs = pool
	if cfg.CA == nil {
		if cfg.CA, err = tlsproxy.NewCA(patterns); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
	}
	// A snapshot's CA vouches only for the hosts it was made for.
	if err := cfg.CA.CheckHosts(patterns...); err != nil {
		return nil, fmt.Errorf("sandbox: intercept: %w: the guest trusts that CA alone", err)
	}
	in := &interception{audit: tlsproxy.NewAuditLog(auditKeep, audit), ca: cfg.CA}
	cfg.Audit = in.audit.Add
	if in.proxy, err = tlsproxy.New(cfg); err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return in, nil
}

func (in *interception) close() error {
	if in == nil {
		return nil
	}
	return in.proxy.Close()
}

// installCA makes the guest trust the sandbox's CA: CAFile, and appended
// to CABundle (made if missing), in an image sandbox in its own writable
// layer.
func installCA(ctx context.Context, cl *agent.Client, ca *tlsproxy.CA) error {
	pem := ca.CertPEM()
	// A disk that trusts it already (a sandbox booted again from its
	// snapshot's disk, sandbox.Reboot) keeps its bundle as it is.
	if had, err := cl.ReadAll(ctx, CAFile, 64<<10); err == nil && bytes.Equal(had, pem) {
		return nil
	}
	if err := cl.Mkdir(ctx, "/etc/ssl/certs", 0o755, true); err != nil {
		return fmt.Errorf("sandbox: install the CA: %w", err)
	}
	if err := cl.WriteFile(ctx, CAFile, 0o644, bytes.NewReader(pem)); err != nil {
		return fmt.Errorf("sandbox: install the CA: %w", err)
	}
	if err := cl.AppendFile(ctx, CABundle, 0o644, bytes.NewReader(append([]byte("\n"), pem...))); err != nil {
		return fmt.Errorf("sandbox: install the CA: %w", err)
	}
	return nil
}

// NetAudit returns the last records of the sandbox's audit log of
// intercepted requests (at most 1000), oldest first; none without
// interception.
func (s *Sandbox) NetAudit() []tlsproxy.Record {
	if s.net == nil || s.net.intercept == nil {
		return nil
	}
	return s.net.intercept.audit.Records()
}

// InterceptStats reports the sandbox's TLS proxy's counters; ok is false
// without interception.
func (s *Sandbox) InterceptStats() (st tlsproxy.Stats, ok bool) {
	if s.net == nil || s.net.intercept == nil {
		return st, false
	}
	return s.net.intercept.proxy.Stats(), true
}

// CountInMemory counts the occurrences of b in the guest's memory, read
// region by region through the VMM's own mapping of it. It is for tests that prove what the guest holds, a secret's value above
// all; pause the sandbox first for an answer that stands still. The guest
// has no way to it: it runs on the host, over memory the guest writes.
func (s *Sandbox) CountInMemory(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("sandbox: count in memory: nothing to look for")
	}
	n := 0
	for _, r := range s.vm.Memory().Regions() {
		n += bytes.Count(r.Host, b)
	}
	return n, nil
}

// HeaderSpec is a header rule as a Spec holds it (Builder.Header): the
// host pattern and the names of the headers it sets. Never their values:
// like secrets' they are given at start (Workload.Secrets, under
// headerKey), so a Spec, a detached sandbox's record and a snapshot never
// hold them.
type HeaderSpec struct {
	Host  string   `json:"host"`
	Names []string `json:"names"`
}

// HeaderRule is a host pattern and the headers set on the sandbox's
// HTTPS requests to it (tlsproxy.HeaderRule), as SetHeaderRules and the
// front ends take them.
type HeaderRule = tlsproxy.HeaderRule

// CheckHeaderRules checks rules as SetHeaderRules takes them, naming what
// is wrong.
func CheckHeaderRules(rules []HeaderRule) error { return tlsproxy.CheckHeaderRules(rules) }

// CheckHostPattern checks a host pattern as interception takes it
// (example.com, *.example.com; no IP address).
func CheckHostPattern(s string) error { return tlsproxy.CheckPattern(s) }

// ErrOutsideCA is SetHeaderRules' error for a rule whose host the
// sandbox's CA may not name (tlsproxy.ErrOutsideCA).
var ErrOutsideCA = tlsproxy.ErrOutsideCA

// headerKey is where a header rule's value is among the workload's secret
// values (Workload.Secrets, SecretValues): a secret's name is an
// environment variable's and has no space.
func headerKey(host, name string) string { return "header " + host + " " + name }

// ErrNoInterception is SetHeaderRules' error for a sandbox that
// intercepts no TLS: it has no CA in its guest to add hosts to.
var ErrNoInterception = errors.New("the sandbox intercepts no TLS (it was made without secrets, interception or header rules)")

// Header sets the header name to value on every HTTPS request the sandbox
// makes to a host that host matches (example.com, *.example.com for its
// subdomains at any depth), replacing any the guest sent: those hosts'
// HTTPS is intercepted (see TLSIntercept), and for each host the rule of
// the exact name wins, else the longest wildcard's, rules not merged
// (tlsproxy.HeaderRule, E2B's network rules). Unlike a secret's, the
// value is not kept from the guest: a host that echoes the header gives
// it back. It needs Network.
func (b *Builder) Header(host, name, value string) *Builder {
	rule := tlsproxy.HeaderRule{Host: host, Headers: map[string]string{name: value}}
	if err := tlsproxy.CheckHeaderRules([]tlsproxy.HeaderRule{rule}); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %w", err))
		return b
	}
	host, _ = tlsproxy.CanonicalPattern(host) // checked above
	name = http.CanonicalHeaderKey(name)
	if !b.addHeader(host, name) {
		return b
	}
	if b.c.secrets == nil {
		b.c.secrets = map[string]string{}
	}
	b.c.secrets[headerKey(host, name)] = value
	return b
}

// addHeader adds a header rule's host and header name as a Spec holds
// them, refusing one given twice.
func (b *Builder) addHeader(host, name string) bool {
	nc := b.netConfig()
	i := slices.IndexFunc(nc.Headers, func(h HeaderSpec) bool { return h.Host == host })
	if i < 0 {
		nc.Headers = append(nc.Headers, HeaderSpec{Host: host})
		i = len(nc.Headers) - 1
	}
	if slices.Contains(nc.Headers[i].Names, name) {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: header rule %s: header %s given twice", host, name))
		return false
	}
	nc.Headers[i].Names = append(nc.Headers[i].Names, name)
	b.addCAEnv()
	return true
}

// headerRules are the proxy's rules for specs, with their values from
// values (headerKey).
func headerRules(specs []HeaderSpec, values map[string]string) ([]tlsproxy.HeaderRule, error) {
	for _, h := range specs {
		for _, n := range h.Names {
			if _, ok := values[headerKey(h.Host, n)]; !ok {
				return nil, fmt.Errorf("sandbox: header rule %s: header %s has no value (a Spec holds none: give it with Workload.Secrets or RestoreOptions.Secrets)", h.Host, n)
			}
		}
	}
	out := HeaderRulesOf(specs, values)
	if err := tlsproxy.CheckHeaderRules(out); err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return out, nil
}

// HeaderRuleValues are the secret values (Workload.Secrets) that give
// rules' headers their values, for a front end that keeps a sandbox's
// rules with its secrets, and the rules as a Spec holds them.
func HeaderRuleValues(rules []tlsproxy.HeaderRule) ([]HeaderSpec, map[string]string) {
	var specs []HeaderSpec
	values := map[string]string{}
	for _, r := range rules {
		host, err := tlsproxy.CanonicalPattern(r.Host)
		if err != nil {
			host = r.Host // CheckHeaderRules refuses it
		}
		hs := HeaderSpec{Host: host}
		for n, v := range r.Headers {
			n = http.CanonicalHeaderKey(n)
			hs.Names = append(hs.Names, n)
			values[headerKey(host, n)] = v
		}
		slices.Sort(hs.Names)
		specs = append(specs, hs)
	}
	return specs, values
}

// HeaderRulesOf are the rules of specs with their values from values
// (a sandbox's secret values), for a front end that shows them.
func HeaderRulesOf(specs []HeaderSpec, values map[string]string) []tlsproxy.HeaderRule {
	var out []tlsproxy.HeaderRule
	for _, h := range specs {
		r := tlsproxy.HeaderRule{Host: h.Host, Headers: map[string]string{}}
		for _, n := range h.Names {
			r.Headers[n] = values[headerKey(h.Host, n)]
		}
		out = append(out, r)
	}
	return out
}

// IsHeaderValue says whether a secret value's key (Workload.SecretValues)
// is a header rule's.
func IsHeaderValue(key string) bool { return strings.HasPrefix(key, "header ") }

// SetHeaderRules replaces the running sandbox's header rules (nil: none)
// for every request from now on. Their hosts must be ones the sandbox's
// CA was made for (tlsproxy.ErrOutsideCA): the hosts it intercepted at
// its start. A sandbox that intercepts nothing has no rules to replace
// (ErrNoInterception), unless rules is empty.
func (s *Sandbox) SetHeaderRules(rules []tlsproxy.HeaderRule) error {
	in := s.net.interception()
	if in == nil {
		if len(rules) == 0 {
			return nil
		}
		return fmt.Errorf("sandbox: set the header rules: %w", ErrNoInterception)
	}
	if err := in.proxy.SetHeaders(rules); err != nil {
		return fmt.Errorf("sandbox: set the header rules: %w", err)
	}
	return nil
}
