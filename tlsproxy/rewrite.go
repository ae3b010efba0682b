package tlsproxy

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"

	"github.com/capsa-sandbox/capsa/netstack"
)

// Bounds on secrets.
const (
	// MaxSecretLen bounds a secret's value (API keys and tokens, even
	// long JWTs, are far shorter); it is also what a response stream
	// holds back to find a value split across reads.
	MaxSecretLen = 16 << 10
	// MinPlaceholderLen is the shortest placeholder taken: shorter ones
	// could be guessed or met by chance.
	MinPlaceholderLen = 16
)

// Secret is a value the guest only ever sees as Placeholder. On an
// intercepted request to one of Hosts, the proxy puts Value in place of
// Placeholder in the URL and the header values (inside Basic credentials
// too) and, with Body, in the body; a request carrying Placeholder to any
// other host is refused. Responses from Hosts get Value replaced by
// Placeholder, in headers, trailers and bodies, before the guest sees
// them.
type Secret struct {
	Name        string   // for the audit log and errors; never the value
	Placeholder string   // what the guest holds
	Value       string   // the real secret
	Hosts       []string // host patterns: example.com or *.example.com (subdomains)
	Body        bool     // substitute in request bodies too (buffered, up to Config.MaxBody)
}

// pattern is a host pattern: a name, or with wild every strict subdomain
// of it.
type pattern struct {
	domain string
	wild   bool
}

// parsePattern checks "example.com" or "*.example.com" (case and a
// trailing dot do not matter). An IP address is refused: interception
// goes by the name the guest asks for in TLS (SNI).
func parsePattern(s string) (pattern, error) {
	name := strings.ToLower(strings.TrimSuffix(strings.TrimSpace(s), "."))
	p := pattern{domain: name}
	if rest, ok := strings.CutPrefix(name, "*."); ok {
		p = pattern{domain: rest, wild: true}
	}
	if _, err := netip.ParseAddr(strings.Trim(p.domain, "[]")); err == nil {
		return p, fmt.Errorf("host %q: an IP address; interception goes by name (TLS SNI)", s)
	}
	if err := netstack.CheckDomain(p.domain); err != nil {
		return p, fmt.Errorf("host %q: %w", s, err)
	}
	return p, nil
}

func (p pattern) matches(name string) bool {
	if !p.wild {
		return name == p.domain
	}
	return len(name) > len(p.domain) && strings.HasSuffix(name, p.domain) && name[len(name)-len(p.domain)-1] == '.'
}

func (p pattern) String() string {
	if p.wild {
		return "*." + p.domain
	}
	return p.domain
}

func matchesAny(ps []pattern, name string) bool {
	for _, p := range ps {
		if p.matches(name) {
			return true
		}
	}
	return false
}

// canonicalHost lower-cases a host name and drops a trailing dot.
func canonicalHost(h string) string { return strings.ToLower(strings.TrimSuffix(h, ".")) }

// secret is a checked Secret.
type secret struct {
	Secret
	hosts       []pattern
	placeholder []byte
	value       []byte
}

func checkSecrets(in []Secret) ([]*secret, error) {
	var out []*secret
	seen := map[string]bool{}
	for _, s := range in {
		switch {
		case s.Name == "":
			return nil, errors.New("a secret without a name")
		case seen["n"+s.Name]:
			return nil, fmt.Errorf("secret %s: given twice", s.Name)
		case len(s.Placeholder) < MinPlaceholderLen:
			return nil, fmt.Errorf("secret %s: placeholder shorter than %d bytes", s.Name, MinPlaceholderLen)
		case seen["p"+s.Placeholder]:
			return nil, fmt.Errorf("secret %s: placeholder used by another secret", s.Name)
		case s.Value == "":
			return nil, fmt.Errorf("secret %s: empty value", s.Name)
		case len(s.Value) > MaxSecretLen:
			return nil, fmt.Errorf("secret %s: value longer than %d bytes", s.Name, MaxSecretLen)
		case strings.ContainsFunc(s.Value, isControl):
			return nil, fmt.Errorf("secret %s: the value has control characters (a secret is a token that goes in a header or URL)", s.Name)
		case strings.Contains(s.Value, s.Placeholder) || strings.Contains(s.Placeholder, s.Value):
			return nil, fmt.Errorf("secret %s: the value and the placeholder contain each other", s.Name)
		case len(s.Hosts) == 0:
			return nil, fmt.Errorf("secret %s: no hosts to send it to", s.Name)
		}
		seen["n"+s.Name], seen["p"+s.Placeholder] = true, true
		c := &secret{Secret: s, placeholder: []byte(s.Placeholder), value: []byte(s.Value)}
		for _, h := range s.Hosts {
			p, err := parsePattern(h)
			if err != nil {
				return nil, fmt.Errorf("secret %s: %w", s.Name, err)
			}
			c.hosts = append(c.hosts, p)
		}
		out = append(out, c)
	}
	return out, nil
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

func (s *secret) allowed(host string) bool { return matchesAny(s.hosts, host) }

// plan is what a request to host does with the secrets it carries.
type plan struct {
	host    string
	subst   []*secret // carried and allowed: substituted
	blocked *secret   // carried and not allowed: the request is refused
}

// names lists the substituted secrets' names.
func (p *plan) names() []string {
	var n []string
	for _, s := range p.subst {
		n = append(n, s.Name)
	}
	return n
}

// note records that s's placeholder was found in the request.
func (p *plan) note(s *secret) {
	if !s.allowed(p.host) {
		if p.blocked == nil {
			p.blocked = s
		}
		return
	}
	for _, t := range p.subst {
		if t == s {
			return
		}
	}
	p.subst = append(p.subst, s)
}

// scan notes every secret whose placeholder occurs in v.
func (p *plan) scan(secrets []*secret, v string) {
	for _, s := range secrets {
		if strings.Contains(v, s.Placeholder) {
			p.note(s)
		}
	}
}

// basicPrefix starts Basic credentials, whose user:password is base64.
const basicPrefix = "basic "

// planRequest finds the placeholders r's URL and header values carry
// (Basic credentials decoded), for a request to host.
func planRequest(secrets []*secret, r *http.Request, host string) *plan {
	p := &plan{host: host}
	if len(secrets) == 0 {
		return p
	}
	for _, v := range []string{r.URL.Path, r.URL.RawPath, r.URL.RawQuery} {
		p.scan(secrets, v)
	}
	for _, vs := range r.Header {
		for _, v := range vs {
			p.scan(secrets, v)
			if dec, ok := decodeBasic(v); ok {
				p.scan(secrets, dec)
			}
		}
	}
	return p
}

func decodeBasic(v string) (string, bool) {
	if len(v) <= len(basicPrefix) || !strings.EqualFold(v[:len(basicPrefix)], basicPrefix) {
		return "", false
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(v[len(basicPrefix):]))
	if err != nil {
		return "", false
	}
	return string(b), true
}

// substitute puts the values of p's secrets in place of their
// placeholders in r's URL and header values. It is only called for a
// plan with nothing blocked.
func (p *plan) substitute(r *http.Request) {
	if len(p.subst) == 0 {
		return
	}
	pairs := make([]string, 0, 2*len(p.subst))
	for _, s := range p.subst {
		pairs = append(pairs, s.Placeholder, s.Value)
	}
	rep := strings.NewReplacer(pairs...)
	r.URL.Path = rep.Replace(r.URL.Path)
	r.URL.RawPath = rep.Replace(r.URL.RawPath)
	r.URL.RawQuery = rep.Replace(r.URL.RawQuery)
	for k, vs := range r.Header {
		for i, v := range vs {
			if dec, ok := decodeBasic(v); ok && rep.Replace(dec) != dec {
				v = v[:len(basicPrefix)] + base64.StdEncoding.EncodeToString([]byte(rep.Replace(dec)))
			}
			vs[i] = rep.Replace(v)
		}
		r.Header[k] = vs
	}
}

// bodySecrets are the secrets of p to substitute in the request's body:
// those allowed for the host that ask for it (Secret.Body), whether or
// not the URL or headers carry them.
func bodySecrets(secrets []*secret, host string) []*secret {
	var out []*secret
	for _, s := range secrets {
		if s.Body && s.allowed(host) {
			out = append(out, s)
		}
	}
	return out
}

// errTooLarge is a body larger than the rewrite buffer.
var errTooLarge = errors.New("body too large to rewrite")

// rewriteBody reads body (at most max bytes, else errTooLarge), notes
// the placeholders it carries in p (a placeholder not allowed for the
// host blocks the request) and returns it with the values of subst in
// place of their placeholders.
func (p *plan) rewriteBody(secrets, subst []*secret, body io.Reader, max int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(body, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, errTooLarge
	}
	for _, s := range secrets {
		if bytes.Contains(b, s.placeholder) {
			p.note(s)
		}
	}
	for _, s := range subst {
		b = bytes.ReplaceAll(b, s.placeholder, s.value)
	}
	return b, nil
}

// scrubber replaces secrets' values by their placeholders in what a host
// sends back: each value as it is and in the encodings a server commonly
// reflects it in (percent-encoding, a JSON string's escapes, base64), each
// by the placeholder in the same encoding.
type scrubber struct {
	forms []form
	rep   *strings.Replacer
	hold  int // the longest form less one: what a stream holds back
}

// form is one encoding of a secret's value and of its placeholder.
type form struct{ value, placeholder []byte }

// encodings are the forms a value is scrubbed in, beside itself.
var encodings = []func(string) string{
	url.QueryEscape,
	url.PathEscape,
	func(v string) string { b, _ := json.Marshal(v); return string(b[1 : len(b)-1]) },
	b64(base64.StdEncoding), b64(base64.RawStdEncoding), b64(base64.URLEncoding), b64(base64.RawURLEncoding),
}

func b64(e *base64.Encoding) func(string) string {
	return func(v string) string { return e.EncodeToString([]byte(v)) }
}

// newScrubber scrubs the values of the secrets keep takes (for a host,
// those allowed for it: the only ones it was ever sent). nil when there
// are none.
func newScrubber(secrets []*secret, keep func(*secret) bool) *scrubber {
	var sc scrubber
	seen := map[string]bool{}
	add := func(v, p string) {
		if v != "" && !seen[v] {
			seen[v] = true
			sc.forms = append(sc.forms, form{[]byte(v), []byte(p)})
			sc.hold = max(sc.hold, len(v)-1)
		}
	}
	for _, s := range secrets {
		if !keep(s) {
			continue
		}
		add(s.Value, s.Placeholder)
		for _, enc := range encodings {
			add(enc(s.Value), enc(s.Placeholder))
		}
	}
	if len(sc.forms) == 0 {
		return nil
	}
	// The longest form first: where two start at one place (one a
	// prefix of the other), the Replacer takes the first given.
	slices.SortStableFunc(sc.forms, func(a, b form) int { return len(b.value) - len(a.value) })
	var pairs []string
	for _, f := range sc.forms {
		pairs = append(pairs, string(f.value), string(f.placeholder))
	}
	sc.rep = strings.NewReplacer(pairs...)
	return &sc
}

// String scrubs s; a nil scrubber leaves it as it is.
func (sc *scrubber) String(s string) string {
	if sc == nil {
		return s
	}
	return sc.rep.Replace(s)
}

// header scrubs every value of h in place.
func (sc *scrubber) header(h http.Header) {
	if sc == nil {
		return
	}
	for _, vs := range h {
		for i, v := range vs {
			vs[i] = sc.rep.Replace(v)
		}
	}
}

// bytes scrubs b.
func (sc *scrubber) bytes(b []byte) []byte {
	for _, f := range sc.forms {
		b = bytes.ReplaceAll(b, f.value, f.placeholder)
	}
	return b
}

// scrubReader is a body with the scrubber's values replaced as it
// streams: it holds back the last hold bytes of what it has read until
// more comes, so a value split across reads is still found.
type scrubReader struct {
	r       io.ReadCloser
	sc      *scrubber
	pending []byte // read, not yet scrubbed and released
	out     []byte // scrubbed, to hand out
	buf     []byte
	err     error
}

func newScrubReader(r io.ReadCloser, sc *scrubber) *scrubReader {
	return &scrubReader{r: r, sc: sc, buf: make([]byte, 32<<10)}
}

func (s *scrubReader) Read(p []byte) (int, error) {
	for len(s.out) == 0 {
		if s.err != nil {
			return 0, s.err
		}
		n, err := s.r.Read(s.buf)
		s.pending = append(s.pending, s.buf[:n]...)
		if err != nil {
			s.err = err
		}
		s.release(err != nil)
	}
	n := copy(p, s.out)
	s.out = s.out[n:]
	return n, nil
}

// release moves what is certainly scrubbed from pending to out: at the
// end, everything.
func (s *scrubReader) release(end bool) {
	for {
		i, f := s.first()
		// A longer value could still match there once more comes.
		if f == nil || !end && len(s.pending)-i <= s.sc.hold {
			break
		}
		s.out = append(s.out, s.pending[:i]...)
		s.out = append(s.out, f.placeholder...)
		s.pending = s.pending[i+len(f.value):]
	}
	keep := min(s.sc.hold, len(s.pending))
	if end {
		keep = 0
	}
	s.out = append(s.out, s.pending[:len(s.pending)-keep]...)
	s.pending = append(s.pending[:0], s.pending[len(s.pending)-keep:]...)
}

// first finds the earliest form in pending (the longest at one place).
func (s *scrubReader) first() (int, *form) {
	at, found := -1, (*form)(nil)
	for i := range s.sc.forms {
		f := &s.sc.forms[i]
		j := bytes.Index(s.pending, f.value)
		if j >= 0 && (at < 0 || j < at || j == at && len(f.value) > len(found.value)) {
			at, found = j, f
		}
	}
	return at, found
}

func (s *scrubReader) Close() error { return s.r.Close() }

// CheckPattern checks a host pattern as Config.Intercept and Secret.Hosts
// take it.
func CheckPattern(s string) error {
	_, err := parsePattern(s)
	return err
}

// CheckSecret checks a secret as New does.
func CheckSecret(s Secret) error {
	_, err := checkSecrets([]Secret{s})
	return err
}

// PlaceholderPrefix starts every placeholder NewPlaceholder makes.
const PlaceholderPrefix = "capsa-secret-"

// NewPlaceholder returns a random placeholder: PlaceholderPrefix and 32
// hex digits (128 bits), unguessable and unlikely to meet anything by
// chance.
func NewPlaceholder() string {
	b := make([]byte, 16)
	rand.Read(b)
	return PlaceholderPrefix + hex.EncodeToString(b)
}
