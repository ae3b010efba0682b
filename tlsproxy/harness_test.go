package tlsproxy

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"
)

// The test's secret.
const (
	testName        = "API_KEY"
	testPlaceholder = "capsa-secret-0123456789abcdef0123456789abcdef"
	testValue       = "s3cr3t-value-for-tests"
)

// upstreamCA makes a CA of the test's own (not the proxy's) and a server
// certificate from it for names.
func upstreamCA(t testing.TB, names ...string) (*x509.CertPool, tls.Certificate) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test upstream CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(caCert)
	return pool, tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// seen is what the upstream server got.
type seen struct {
	Host, Proto, Auth, Body, URL string
	ContentLength                int64
}

// harness is an upstream HTTPS server, a proxy in front of it, and a
// guest-side client whose every connection goes through Intercept as
// the NAT would hand it over (to port 443).
type harness struct {
	proxy    *Proxy
	upstream string // host:port
	roots    *x509.CertPool
	guestCAs *x509.CertPool
	audit    *AuditLog

	mu   sync.Mutex
	seen []seen

	ln      net.Listener
	handler http.Handler
}

var upstreamNames = []string{"api.test", "other.test", "plain.test", "*.wild.test"}

func newHarness(t testing.TB, cfg Config, handler http.HandlerFunc) *harness {
	t.Helper()
	roots, cert := upstreamCA(t, upstreamNames...)
	h := &harness{roots: roots}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		h.mu.Lock()
		h.seen = append(h.seen, seen{Host: r.Host, Proto: r.Proto, Auth: r.Header.Get("Authorization"), Body: string(b), URL: r.URL.String(), ContentLength: r.ContentLength})
		h.mu.Unlock()
		if handler != nil {
			handler(w, r)
		}
	}), ErrorLog: log.New(io.Discard, "", 0), TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}}
	ul, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.ServeTLS(ul, "", "")
	t.Cleanup(func() { srv.Close() })
	h.upstream = ul.Addr().String()

	if cfg.CA == nil {
		patterns := append(append([]string(nil), cfg.Intercept...), "api.test", "other.test", "*.wild.test")
		if cfg.CA, err = NewCA(patterns); err != nil {
			t.Fatal(err)
		}
	}
	if cfg.RootCAs == nil {
		cfg.RootCAs = roots
	}
	h.audit = NewAuditLog(100, nil)
	cfg.Audit = h.audit.Add
	if h.proxy, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.proxy.Close() })
	h.guestCAs = x509.NewCertPool()
	h.guestCAs.AddCert(cfg.CA.Certificate())

	if h.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.ln.Close() })
	go h.serve()
	return h
}

// serve hands each guest connection to the proxy as the NAT does, and
// relays what it gives back.
func (h *harness) serve() {
	dst := netip.MustParseAddrPort("192.0.2.1:443")
	redial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", h.upstream)
	}
	for {
		g, err := h.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			up, err := net.Dial("tcp", h.upstream)
			if err != nil {
				g.Close()
				return
			}
			rest := h.proxy.Intercept(g, up, dst, redial)
			if rest == nil {
				return
			}
			done := make(chan struct{})
			go func() { io.Copy(up, rest); up.(*net.TCPConn).CloseWrite(); close(done) }()
			io.Copy(rest, up)
			<-done
			rest.Close()
			up.Close()
		}()
	}
}

// client is the guest: HTTPS to any name reaches the harness's NAT,
// trusting roots (the proxy's CA unless said otherwise).
func (h *harness) client(roots *x509.CertPool, h2 bool) *http.Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", h.ln.Addr().String())
		},
		TLSClientConfig:   &tls.Config{RootCAs: roots},
		ForceAttemptHTTP2: h2,
		DisableKeepAlives: false,
	}
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

func (h *harness) last() seen {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.seen) == 0 {
		return seen{}
	}
	return h.seen[len(h.seen)-1]
}

func (h *harness) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.seen)
}

func testSecret(body bool) Secret {
	return Secret{Name: testName, Placeholder: testPlaceholder, Value: testValue, Hosts: []string{"api.test"}, Body: body}
}

// records waits (a while) for n audit records: a request's is written as
// its handler returns, which may be after the guest has its answer.
func (h *harness) records(n int) []Record {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if recs := h.audit.Records(); len(recs) >= n {
			return recs
		}
	}
	return h.audit.Records()
}
