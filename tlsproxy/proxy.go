package tlsproxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Port is the one port whose connections are looked at: a connection to
// any other port is relayed untouched without reading a byte.
const Port = 443

// Defaults for Config's bounds.
const (
	DefaultMaxConns         = 64
	DefaultMaxCerts         = 256
	DefaultMaxHeaderBytes   = 64 << 10
	DefaultMaxBody          = 1 << 20
	DefaultBodyBudget       = 16 << 20
	DefaultHandshakeTimeout = 10 * time.Second
)

const (
	// maxHello bounds what is read of a guest's first bytes before
	// deciding (crypto/tls stops a ClientHello at 64 KiB).
	maxHello = 128 << 10
	// maxStreams bounds the HTTP/2 streams of one guest connection.
	maxStreams = 16
	// upstreamConns bounds the host connections one guest connection's
	// requests are spread over.
	upstreamConns = 4
)

// Config configures a Proxy.
type Config struct {
	// CA signs the certificates shown to the guest (NewCA). Required.
	CA *CA
	// Intercept lists the host patterns (example.com, *.example.com)
	// whose TLS connections are intercepted, beside every secret's
	// Hosts.
	Intercept []string
	// Secrets are substituted on the way out and scrubbed on the way
	// back.
	Secrets []Secret
	// Headers are set on the requests to their hosts, which are
	// intercepted too (SetHeaders replaces them).
	Headers []HeaderRule
	// RootCAs verifies the real servers; nil: the host's trust store.
	// The guest has no say in it.
	RootCAs *x509.CertPool
	// Audit receives a record of every intercepted request and of every
	// intercepted connection refused. nil: none.
	Audit func(Record)
	// Logger receives diagnostics. nil: discard.
	Logger *slog.Logger

	// MaxConns bounds concurrent intercepted connections; more are
	// refused. Default 64.
	MaxConns int
	// MaxCerts bounds the cached certificates. Default 256.
	MaxCerts int
	// MaxHeaderBytes bounds a request's and a response's header.
	// Default 64 KiB.
	MaxHeaderBytes int
	// MaxBody bounds a request body rewritten for a secret (Secret.Body;
	// a larger one is refused with 413) and a response body scrubbed
	// whole (a larger one is scrubbed as it streams). Default 1 MiB.
	MaxBody int64
	// BodyBudget bounds the body bytes held at once across all
	// connections; a request body to rewrite waits for its share.
	// Default 16 MiB.
	BodyBudget int64
	// HandshakeTimeout bounds the guest's ClientHello and handshake and
	// the upstream handshake. Default 10s.
	HandshakeTimeout time.Duration
}

// Proxy intercepts a sandbox's TLS connections to the configured hosts.
// It is a netstack.Interceptor: the NAT hands it every guest TCP
// connection once the policy allowed it and the host side is connected.
type Proxy struct {
	cfg       Config
	log       *slog.Logger
	intercept []pattern
	secrets   []*secret
	headers   atomic.Pointer[headerSet]
	all       *scrubber // every secret: for errors and reasons
	certs     *leafCache
	slots     chan struct{} // one per intercepted connection
	bodies    chan struct{} // one per body buffered (BodyBudget / MaxBody)

	ln     *chanListener
	srv    *http.Server
	rp     *httputil.ReverseProxy
	byConn sync.Map // *tls.Conn → *conn, for the server's ConnContext
	ctx    context.Context
	cancel context.CancelFunc

	stats struct {
		intercepted, passed, refused       atomic.Uint64
		requests, substituted, blockedReqs atomic.Uint64
		headersSet                         atomic.Uint64
	}
}

// New makes a proxy. Close releases it.
func New(cfg Config) (*Proxy, error) {
	if cfg.CA == nil {
		return nil, errors.New("tlsproxy: no CA")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	if cfg.MaxCerts <= 0 {
		cfg.MaxCerts = DefaultMaxCerts
	}
	if cfg.MaxHeaderBytes <= 0 {
		cfg.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	if cfg.BodyBudget <= 0 {
		cfg.BodyBudget = DefaultBodyBudget
	}
	cfg.BodyBudget = max(cfg.BodyBudget, cfg.MaxBody)
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = DefaultHandshakeTimeout
	}
	secrets, err := checkSecrets(cfg.Secrets)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: %w", err)
	}
	p := &Proxy{cfg: cfg, log: cfg.Logger.With("component", "tlsproxy"), secrets: secrets,
		slots: make(chan struct{}, cfg.MaxConns), bodies: make(chan struct{}, cfg.BodyBudget/cfg.MaxBody)}
	for _, s := range cfg.Intercept {
		pt, err := parsePattern(s)
		if err != nil {
			return nil, fmt.Errorf("tlsproxy: intercept: %w", err)
		}
		p.intercept = append(p.intercept, pt)
	}
	for _, s := range secrets {
		p.intercept = append(p.intercept, s.hosts...)
	}
	hs, err := checkHeaderRulesFor(cfg.CA, cfg.Headers)
	if err != nil {
		return nil, err
	}
	p.headers.Store(hs)
	p.all = newScrubber(secrets, func(*secret) bool { return true })
	if p.certs, err = newLeafCache(cfg.CA, cfg.MaxCerts); err != nil {
		return nil, err
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			x := exchangeOf(pr.In)
			pr.Out.URL.Scheme, pr.Out.URL.Host = "https", x.c.authority
			pr.Out.Host = pr.In.Host
			// Here, after the proxy dropped the hop-by-hop headers
			// (those the guest's Connection names among them): a
			// guest cannot have a rule's headers dropped.
			if x.rule != nil {
				x.rule.apply(pr.Out.Header)
				if x.c.scrub != nil {
					// An answer to check for secrets comes plain.
					pr.Out.Header.Del("Accept-Encoding")
				}
			}
		},
		Transport:      roundTripper(func(r *http.Request) (*http.Response, error) { return exchangeOf(r).c.tr.RoundTrip(r) }),
		ModifyResponse: p.modifyResponse,
		ErrorHandler:   p.upstreamError,
		ErrorLog:       slog.NewLogLogger(p.log.Handler(), slog.LevelDebug),
	}
	p.ln = newChanListener()
	p.srv = &http.Server{
		Handler: p,
		ConnContext: func(ctx context.Context, nc net.Conn) context.Context {
			if c, ok := p.byConn.Load(nc); ok {
				return context.WithValue(ctx, connKey{}, c)
			}
			return ctx
		},
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: maxStreams},
		ErrorLog:          slog.NewLogLogger(p.log.Handler(), slog.LevelDebug),
	}
	go p.srv.Serve(p.ln)
	return p, nil
}

// Close ends every intercepted connection.
func (p *Proxy) Close() error {
	p.cancel()
	return p.srv.Close()
}

// Stats are cumulative counters and the current state.
type Stats struct {
	Intercepted   uint64 // connections intercepted
	PassedThrough uint64 // connections to Port relayed untouched
	Refused       uint64 // connections to intercept refused (upstream certificate, limits)
	Requests      uint64 // requests on intercepted connections
	Substituted   uint64 // requests that had a secret substituted
	HeadersSet    uint64 // requests that had a header rule's headers set
	Blocked       uint64 // requests refused
	CertsMinted   uint64
	CertsCached   int
	Active        int // intercepted connections open
}

// Stats returns the proxy's counters.
func (p *Proxy) Stats() Stats {
	cached, minted := p.certs.stats()
	return Stats{
		Intercepted: p.stats.intercepted.Load(), PassedThrough: p.stats.passed.Load(), Refused: p.stats.refused.Load(),
		Requests: p.stats.requests.Load(), Substituted: p.stats.substituted.Load(), HeadersSet: p.stats.headersSet.Load(), Blocked: p.stats.blockedReqs.Load(),
		CertsMinted: minted, CertsCached: cached, Active: len(p.slots),
	}
}

// errPassThrough ends the guest handshake of a connection not to intercept.
var errPassThrough = errors.New("not intercepted")

// Intercept takes a guest connection to dst and host, its host side,
// already connected to dst. For a connection to Port whose TLS ClientHello
// names a host to intercept, it serves the connection itself (refusing it
// if the upstream's certificate does not verify) and returns nil once the
// guest has gone; redial opens more host connections to dst. Any other
// connection it returns at once, or once it has seen that the first bytes
// are no ClientHello to intercept (after at most HandshakeTimeout), as a
// connection that yields those bytes again, to relay to host as usual; host
// is untouched then.
func (p *Proxy) Intercept(guest, host net.Conn, dst netip.AddrPort, redial func(context.Context) (net.Conn, error)) net.Conn {
	if dst.Port() != Port {
		return guest
	}
	pc := &peekConn{Conn: guest, recording: true, done: make(chan struct{})}
	var c *conn
	tc := tls.Server(pc, &tls.Config{
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			name := canonicalHost(h.ServerName)
			if name == "" || !p.intercepts(name) {
				return nil, errPassThrough
			}
			pc.decide()
			// The upstream handshake comes first: room for both.
			guest.SetDeadline(time.Now().Add(2 * p.cfg.HandshakeTimeout))
			var err error
			if c, err = p.open(name, dst, h.SupportedProtos, host, redial); err != nil {
				return nil, err
			}
			return c.serverConfig, nil
		},
	})
	guest.SetDeadline(time.Now().Add(p.cfg.HandshakeTimeout))
	err := tc.Handshake()
	if !pc.decided() {
		guest.SetDeadline(time.Time{})
		p.stats.passed.Add(1)
		return pc.replay()
	}
	if c == nil || err != nil {
		if c != nil {
			p.refuse(c.name, "TLS handshake with the guest: "+err.Error())
			c.close()
		}
		guest.Close()
		host.Close()
		return nil
	}
	guest.SetDeadline(time.Time{})
	p.stats.intercepted.Add(1)
	p.byConn.Store(tc, c)
	defer p.byConn.Delete(tc)
	select {
	case p.ln.conns <- tc:
		select {
		case <-pc.done: // the server closed it: the guest has gone
		case <-p.ctx.Done():
		}
	case <-p.ln.done:
	}
	tc.Close()
	c.close()
	return nil
}

// refuse records an intercepted connection refused before any request.
func (p *Proxy) refuse(host, reason string) {
	p.stats.refused.Add(1)
	p.log.Info("intercepted TLS connection refused", "host", host, "reason", reason)
	p.audit(Record{Time: time.Now().UTC(), Host: host, Blocked: true, Reason: reason})
}

func (p *Proxy) audit(r Record) {
	r.Kind = "http"
	if p.cfg.Audit != nil {
		p.cfg.Audit(r)
	}
}

// conn is an intercepted connection: the name the guest asked for and
// its way upstream.
type conn struct {
	p            *Proxy
	name         string // the TLS server name, checked and lower case
	port         uint16
	authority    string // name, or name:port off Port
	scrub        *scrubber
	serverConfig *tls.Config
	tr           *http.Transport
	host         net.Conn // the host connection the NAT made

	mu    sync.Mutex
	first net.Conn // the upstream connection made at the handshake, until the transport takes it
	slot  bool
}

// open checks the upstream for an intercepted connection: a slot, then
// a TLS handshake with host verifying its certificate for name. It
// offers the upstream what the guest offered of HTTP/2 and HTTP/1.1, and
// the guest what the upstream chose.
func (p *Proxy) open(name string, dst netip.AddrPort, guestProtos []string, host net.Conn, redial func(context.Context) (net.Conn, error)) (*conn, error) {
	select {
	case p.slots <- struct{}{}:
	default:
		err := fmt.Errorf("%d intercepted connections are open, the most a sandbox may have", p.cfg.MaxConns)
		p.refuse(name, err.Error())
		return nil, err
	}
	c := &conn{p: p, name: name, port: dst.Port(), authority: name, host: host, slot: true,
		scrub: newScrubber(p.secrets, func(s *secret) bool { return s.allowed(name) })}
	if dst.Port() != Port {
		c.authority = net.JoinHostPort(name, strconv.Itoa(int(dst.Port())))
	}
	protos := []string{"http/1.1"}
	if slices.Contains(guestProtos, "h2") {
		protos = []string{"h2", "http/1.1"}
	}
	upCfg := &tls.Config{ServerName: name, RootCAs: p.cfg.RootCAs, NextProtos: protos, MinVersion: tls.VersionTLS12}
	handshake := func(ctx context.Context, raw net.Conn) (*tls.Conn, error) {
		ctx, cancel := context.WithTimeout(ctx, p.cfg.HandshakeTimeout)
		defer cancel()
		up := tls.Client(raw, upCfg)
		if err := up.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, err
		}
		return up, nil
	}
	up, err := handshake(p.ctx, host)
	if err != nil {
		c.close()
		err = fmt.Errorf("upstream %s: %w", name, err)
		p.refuse(name, err.Error())
		return nil, err
	}
	c.first = up
	cert, err := p.certs.get(name, time.Now())
	if err != nil {
		c.close()
		p.refuse(name, err.Error())
		return nil, err
	}
	c.serverConfig = &tls.Config{Certificates: []tls.Certificate{*cert}, MinVersion: tls.VersionTLS12}
	if np := up.ConnectionState().NegotiatedProtocol; np != "" {
		c.serverConfig.NextProtos = []string{np}
	} else {
		c.serverConfig.NextProtos = []string{"http/1.1"}
	}
	c.tr = &http.Transport{
		DialTLSContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			c.mu.Lock()
			first := c.first
			c.first = nil
			c.mu.Unlock()
			if first != nil {
				return first, nil
			}
			raw, err := redial(ctx)
			if err != nil {
				return nil, err
			}
			return handshake(ctx, raw)
		},
		ForceAttemptHTTP2:      true,
		MaxConnsPerHost:        upstreamConns,
		MaxIdleConnsPerHost:    upstreamConns,
		IdleConnTimeout:        time.Minute,
		MaxResponseHeaderBytes: int64(p.cfg.MaxHeaderBytes),
	}
	return c, nil
}

// close releases the connection's upstream side and slot.
func (c *conn) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.host.Close()
	c.first = nil
	if c.tr != nil {
		c.tr.CloseIdleConnections()
	}
	if c.slot {
		c.slot = false
		<-c.p.slots
	}
}

// checkHost refuses a request whose Host (HTTP/2's :authority) is not
// the name the connection's TLS handshake was for: a guest may not
// reach another host behind an allowed name (domain fronting).
func (c *conn) checkHost(h string) string {
	host, port := h, ""
	if hh, pp, err := net.SplitHostPort(h); err == nil {
		host, port = hh, pp
	}
	if canonicalHost(host) != c.name {
		return fmt.Sprintf("Host %q does not match the TLS server name %q (domain fronting is refused)", truncate(h, 256), c.name)
	}
	if port != "" && port != strconv.Itoa(int(c.port)) {
		return fmt.Sprintf("Host %q names another port than the connection's, %d", truncate(h, 256), c.port)
	}
	return ""
}

type connKey struct{}

// exchange is one request's state, in its context.
type exchange struct {
	c        *conn
	rec      *Record
	rule     *headerRule // the header rule for the request's host, if any
	upgraded bool
}

type exchangeKey struct{}

func exchangeOf(r *http.Request) *exchange { return r.Context().Value(exchangeKey{}).(*exchange) }

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// ServeHTTP handles a request on an intercepted connection: checks, the
// secrets' substitution, the round trip upstream, and its audit record.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c, _ := r.Context().Value(connKey{}).(*conn)
	if c == nil {
		http.Error(w, "capsa: not an intercepted connection", http.StatusInternalServerError)
		return
	}
	p.stats.requests.Add(1)
	rec := &Record{Time: time.Now().UTC(), Host: c.name, Method: r.Method, Path: truncate(r.URL.Path, maxAuditPath), Proto: r.Proto}
	aw := &auditWriter{ResponseWriter: w, sc: c.scrub}
	in := &countingReader{r: r.Body}
	r.Body = in
	x := &exchange{c: c, rec: rec}
	defer func() {
		rec.Status, rec.ResponseBytes, rec.RequestBytes = aw.status, aw.n, in.n
		if x.upgraded {
			rec.Status = http.StatusSwitchingProtocols
		} else {
			aw.trailers()
		}
		rec.Reason = p.all.String(rec.Reason)
		p.audit(*rec)
	}()
	refuse := func(code int, reason string) {
		p.stats.blockedReqs.Add(1)
		rec.Blocked, rec.Reason = true, reason
		http.Error(aw, "capsa: request refused: "+reason, code)
	}
	if why := c.checkHost(r.Host); why != "" {
		refuse(http.StatusMisdirectedRequest, why)
		return
	}
	pl := planRequest(p.secrets, r, c.name)
	blocked := func() bool {
		if s := pl.blocked; s != nil {
			refuse(http.StatusForbidden, fmt.Sprintf("it carries the placeholder of secret %s, which may only be sent to %s, not to %s", s.Name, patternList(s.hosts), c.name))
			return true
		}
		return false
	}
	if blocked() {
		return
	}
	if c.scrub != nil && r.Header.Get("Upgrade") != "" {
		refuse(http.StatusForbidden, "protocol upgrades (WebSocket...) are not relayed to a host that receives secrets: what comes back could not be checked for them")
		return
	}
	out := r.Clone(context.WithValue(r.Context(), exchangeKey{}, x))
	if bs := bodySecrets(p.secrets, c.name); len(bs) > 0 && r.ContentLength != 0 {
		select {
		case p.bodies <- struct{}{}:
		case <-r.Context().Done():
			return // the guest went away
		}
		defer func() { <-p.bodies }()
		b, err := pl.rewriteBody(p.secrets, bs, r.Body, p.cfg.MaxBody)
		switch {
		case errors.Is(err, errTooLarge):
			refuse(http.StatusRequestEntityTooLarge, fmt.Sprintf("a body to rewrite for secrets may have at most %d bytes", p.cfg.MaxBody))
			return
		case err != nil:
			refuse(http.StatusBadRequest, "reading the body: "+err.Error())
			return
		}
		if blocked() {
			return
		}
		out.Body, out.ContentLength, out.TransferEncoding = io.NopCloser(bytes.NewReader(b)), int64(len(b)), nil
		out.Header.Del("Content-Length")
	}
	pl.substitute(out)
	if x.rule = p.headers.Load().match(c.name); x.rule != nil {
		rec.Headers = x.rule.names
		p.stats.headersSet.Add(1)
	}
	if c.scrub != nil {
		// The transport then asks for gzip itself and decodes it, so
		// the answer can be checked for the secrets.
		out.Header.Del("Accept-Encoding")
	}
	if rec.Substituted = pl.names(); len(rec.Substituted) > 0 {
		p.stats.substituted.Add(1)
	}
	p.rp.ServeHTTP(aw, out)
}

func patternList(ps []pattern) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}

// modifyResponse scrubs a response from a host that receives secrets:
// its body whole when it is small (Content-Length fixed up), else as it
// streams. Headers are scrubbed by the auditWriter.
func (p *Proxy) modifyResponse(res *http.Response) error {
	x := exchangeOf(res.Request)
	if res.StatusCode == http.StatusSwitchingProtocols {
		x.upgraded = true
		return nil
	}
	sc := x.c.scrub
	if sc == nil || res.Request.Method == http.MethodHead || res.StatusCode == http.StatusNoContent ||
		res.StatusCode == http.StatusNotModified || res.Body == nil || res.Body == http.NoBody {
		return nil
	}
	if ce := res.Header.Get("Content-Encoding"); ce != "" && !strings.EqualFold(ce, "identity") {
		return fmt.Errorf("the response is %s-encoded, and a host that receives secrets must answer unencoded to be checked for them", ce)
	}
	if res.ContentLength >= 0 && res.ContentLength <= p.cfg.MaxBody && p.tryBody() {
		defer func() { <-p.bodies }()
		b, err := io.ReadAll(io.LimitReader(res.Body, res.ContentLength+1))
		res.Body.Close()
		if err != nil {
			return fmt.Errorf("reading the response: %w", err)
		}
		b = sc.bytes(b)
		res.Body, res.ContentLength = io.NopCloser(bytes.NewReader(b)), int64(len(b))
		res.Header.Set("Content-Length", strconv.Itoa(len(b)))
		return nil
	}
	res.Body, res.ContentLength = newScrubReader(res.Body, sc), -1
	res.Header.Del("Content-Length")
	return nil
}

// tryBody takes a body buffer's share of the budget if one is free.
func (p *Proxy) tryBody() bool {
	select {
	case p.bodies <- struct{}{}:
		return true
	default:
		return false
	}
}

// upstreamError answers a request the upstream did not answer with 502.
func (p *Proxy) upstreamError(w http.ResponseWriter, r *http.Request, err error) {
	x := exchangeOf(r)
	msg := p.all.String(err.Error())
	x.rec.Reason = "upstream: " + msg
	if errors.Is(err, context.Canceled) {
		return // the guest went away
	}
	http.Error(w, "capsa: upstream "+x.c.name+": "+msg, http.StatusBadGateway)
}

// auditWriter counts what goes to the guest and scrubs header values
// (informational, final, trailers) as they go.
type auditWriter struct {
	http.ResponseWriter
	sc     *scrubber
	status int
	n      int64
}

func (w *auditWriter) WriteHeader(code int) {
	w.sc.header(w.Header())
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *auditWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(b)
	w.n += int64(n)
	return n, err
}

// trailers scrubs what is set after the body: net/http sends it as
// trailers once the handler returns.
func (w *auditWriter) trailers() { w.sc.header(w.Header()) }

func (w *auditWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

type countingReader struct {
	r io.ReadCloser
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func (c *countingReader) Close() error { return c.r.Close() }

// peekConn is the guest connection while its first bytes are looked at:
// it records what is read and drops what is written until decide (so
// crypto/tls's alert for a connection not intercepted never reaches the
// guest), and signals its Close.
type peekConn struct {
	net.Conn
	mu        sync.Mutex
	recording bool
	rec       []byte
	over      bool
	done      chan struct{}
	closeOnce sync.Once
}

func (c *peekConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	if c.recording {
		if len(c.rec)+n > maxHello {
			c.over = true
		} else {
			c.rec = append(c.rec, p[:n]...)
		}
	}
	c.mu.Unlock()
	return n, err
}

func (c *peekConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	pass := !c.recording
	c.mu.Unlock()
	if !pass {
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// decide ends recording: the connection is intercepted.
func (c *peekConn) decide() {
	c.mu.Lock()
	c.recording, c.rec = false, nil
	c.mu.Unlock()
}

func (c *peekConn) decided() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.recording
}

func (c *peekConn) Close() error {
	c.closeOnce.Do(func() { close(c.done) })
	return c.Conn.Close()
}

// replay is the guest connection with what was read of it first.
func (c *peekConn) replay() net.Conn {
	if c.over {
		// Cannot happen with crypto/tls's bound; never relay a gap.
		c.Conn.Close()
		return c.Conn
	}
	if len(c.rec) == 0 {
		return c.Conn
	}
	return &prefixConn{Conn: c.Conn, r: io.MultiReader(bytes.NewReader(c.rec), c.Conn)}
}

// prefixConn reads r (a prefix, then the connection) and keeps the
// connection's half-close.
type prefixConn struct {
	net.Conn
	r io.Reader
}

func (c *prefixConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func (c *prefixConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// chanListener hands the HTTP server the intercepted connections.
type chanListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newChanListener() *chanListener {
	return &chanListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *chanListener) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4zero, Port: Port} }
