package tlsproxy

import (
	"bytes"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// echo answers with the Authorization it got, in a header and the body.
func echo(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Echo", r.Header.Get("Authorization"))
	fmt.Fprintf(w, "auth=%s", r.Header.Get("Authorization"))
}

func get(t *testing.T, c *http.Client, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		if hdr[i] == "" {
			continue
		}
		if hdr[i] == "Host" {
			req.Host = hdr[i+1]
		} else {
			req.Header.Set(hdr[i], hdr[i+1])
		}
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("GET %s: body: %v", url, err)
	}
	return resp, string(b)
}

func TestHeaderSubstitutionAndScrub(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}}, echo)
	resp, body := get(t, h.client(h.guestCAs, false), "https://api.test/v1/x", "Authorization", "Bearer "+testPlaceholder)
	if got := h.last().Auth; got != "Bearer "+testValue {
		t.Errorf("upstream Authorization = %q, want %q", got, "Bearer "+testValue)
	}
	if want := "auth=Bearer " + testPlaceholder; body != want || resp.StatusCode != 200 {
		t.Errorf("guest got %d %q, want 200 %q (the echoed value scrubbed)", resp.StatusCode, body, want)
	}
	if got := resp.Header.Get("X-Echo"); got != "Bearer "+testPlaceholder {
		t.Errorf("guest's X-Echo header = %q, want the placeholder", got)
	}
	if cl := resp.ContentLength; cl != int64(len(body)) {
		t.Errorf("Content-Length = %d, want %d (fixed up after scrubbing)", cl, len(body))
	}
	recs := h.records(1)
	if len(recs) != 1 || recs[0].Status != 200 || recs[0].Path != "/v1/x" || recs[0].Method != "GET" ||
		len(recs[0].Substituted) != 1 || recs[0].Substituted[0] != testName || recs[0].Blocked {
		t.Errorf("audit = %+v, want one GET /v1/x 200 with %s substituted", recs, testName)
	}
	if st := h.proxy.Stats(); st.Intercepted != 1 || st.Substituted != 1 {
		t.Errorf("Stats() = %+v, want 1 intercepted, 1 substituted", st)
	}
}

func TestQueryAndBasicSubstitution(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}}, echo)
	c := h.client(h.guestCAs, false)
	basic := "Basic " + base64.StdEncoding.EncodeToString([]byte("user:"+testPlaceholder))
	get(t, c, "https://api.test/q?key="+testPlaceholder, "Authorization", basic)
	got := h.last()
	if want := "/q?key=" + testValue; got.URL != want {
		t.Errorf("upstream URL = %q, want %q", got.URL, want)
	}
	if want := "Basic " + base64.StdEncoding.EncodeToString([]byte("user:"+testValue)); got.Auth != want {
		t.Errorf("upstream Authorization = %q, want %q (Basic credentials decoded, substituted, encoded)", got.Auth, want)
	}
}

func TestBodySubstitution(t *testing.T) {
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprintf("chunked=%v", chunked), func(t *testing.T) {
			h := newHarness(t, Config{Secrets: []Secret{testSecret(true)}}, echo)
			c := h.client(h.guestCAs, false)
			body := `{"key":"` + testPlaceholder + `","again":"` + testPlaceholder + `"}`
			var r io.Reader = strings.NewReader(body)
			if chunked {
				r = io.MultiReader(r) // no length known: sent chunked
			}
			req, _ := http.NewRequest("POST", "https://api.test/post", r)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			want := strings.ReplaceAll(body, testPlaceholder, testValue)
			got := h.last()
			if got.Body != want || got.ContentLength != int64(len(want)) {
				t.Errorf("upstream body %q (Content-Length %d), want %q (%d)", got.Body, got.ContentLength, want, len(want))
			}
			if recs := h.records(1); len(recs) != 1 || recs[0].RequestBytes != int64(len(body)) {
				t.Errorf("audit = %+v, want one record of %d request bytes", recs, len(body))
			}
		})
	}
	t.Run("not asked", func(t *testing.T) {
		h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}}, echo)
		body := "k=" + testPlaceholder
		resp, err := h.client(h.guestCAs, false).Post("https://api.test/post", "text/plain", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := h.last().Body; got != body {
			t.Errorf("upstream body = %q, want %q (no body substitution unless asked)", got, body)
		}
	})
}

func TestBodyTooLarge(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(true)}, MaxBody: 1024}, echo)
	resp, err := h.client(h.guestCAs, false).Post("https://api.test/post", "text/plain", bytes.NewReader(make([]byte, 2048)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || h.count() != 0 {
		t.Errorf("a 2 KiB body to rewrite with MaxBody 1 KiB: status %d, upstream saw %d requests; want 413, 0", resp.StatusCode, h.count())
	}
}

func TestPlaceholderToOtherHostBlocked(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(true)}, Intercept: []string{"other.test"}}, echo)
	c := h.client(h.guestCAs, false)
	for _, tc := range []struct{ what, url, hdr, val string }{
		{"header", "https://other.test/", "Authorization", "Bearer " + testPlaceholder},
		{"query", "https://other.test/?k=" + testPlaceholder, "", ""},
		{"basic", "https://other.test/", "Authorization", "Basic " + base64.StdEncoding.EncodeToString([]byte("u:"+testPlaceholder))},
	} {
		resp, body := get(t, c, tc.url, tc.hdr, tc.val)
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, testName) {
			t.Errorf("placeholder in the %s to other.test: %d %q, want 403 naming %s", tc.what, resp.StatusCode, body, testName)
		}
	}
	if n := h.count(); n != 0 {
		t.Errorf("upstream saw %d requests, want none", n)
	}
	for _, r := range h.records(3) {
		if !r.Blocked || r.Host != "other.test" || r.Status != 403 {
			t.Errorf("audit record %+v, want blocked to other.test with 403", r)
		}
	}
	// Without the placeholder other.test is reached, the value never.
	// Bodies to other hosts are not looked at: a placeholder there goes
	// as it is, which tells the host nothing.
	if resp, _ := get(t, c, "https://other.test/"); resp.StatusCode != 200 || h.last().Host != "other.test" {
		t.Errorf("a plain request to other.test: %d, want 200", resp.StatusCode)
	}
	resp, err := c.Post("https://other.test/", "text/plain", strings.NewReader(testPlaceholder))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got := h.last().Body; resp.StatusCode != 200 || got != testPlaceholder {
		t.Errorf("the placeholder in a body to other.test: %d, upstream got %q; want 200, the placeholder", resp.StatusCode, got)
	}
}

func TestHostMismatchRefused(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}, Intercept: []string{"other.test"}}, echo)
	c := h.client(h.guestCAs, false)
	for _, host := range []string{"other.test", "api.test:8443", "evil.example"} {
		resp, _ := get(t, c, "https://api.test/", "Host", host, "Authorization", "Bearer "+testPlaceholder)
		if resp.StatusCode != http.StatusMisdirectedRequest {
			t.Errorf("SNI api.test, Host %s: status %d, want 421", host, resp.StatusCode)
		}
	}
	if n := h.count(); n != 0 {
		t.Errorf("upstream saw %d requests, want none", n)
	}
	if resp, _ := get(t, c, "https://api.test/", "Host", "API.test:443"); resp.StatusCode != 200 {
		t.Errorf("SNI api.test, Host API.test:443: status %d, want 200", resp.StatusCode)
	}
}

func TestUpstreamCertificateRefused(t *testing.T) {
	other, _ := upstreamCA(t, "unrelated.test")
	for _, tc := range []struct {
		what  string
		roots *x509.CertPool
		url   string
	}{
		{"unknown CA", other, "https://api.test/"},
		{"wrong name", nil, "https://bad.test/"}, // the upstream's certificate does not name bad.test
	} {
		t.Run(tc.what, func(t *testing.T) {
			cfg := Config{Secrets: []Secret{testSecret(false)}, Intercept: []string{"bad.test"}, RootCAs: tc.roots}
			h := newHarness(t, cfg, echo)
			_, err := h.client(h.guestCAs, false).Get(tc.url)
			if err == nil {
				t.Fatalf("GET %s through an upstream whose certificate does not verify: no error", tc.url)
			}
			if h.count() != 0 {
				t.Errorf("upstream saw %d requests, want none", h.count())
			}
			recs := h.records(1)
			if len(recs) != 1 || !recs[0].Blocked || !strings.Contains(recs[0].Reason, "certificate") {
				t.Errorf("audit = %+v, want one refused connection naming the certificate", recs)
			}
			if st := h.proxy.Stats(); st.Refused != 1 || st.Active != 0 {
				t.Errorf("Stats() = %+v, want 1 refused, none active", st)
			}
		})
	}
}

func TestHTTP2Streams(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}}, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(20 * time.Millisecond)
		echo(w, r)
	})
	c := h.client(h.guestCAs, true)
	get(t, c, "https://api.test/warm") // one connection, then streams on it
	var wg sync.WaitGroup
	errs := make(chan string, maxStreams)
	for i := range maxStreams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("GET", fmt.Sprintf("https://api.test/s/%d", i), nil)
			req.Header.Set("Authorization", "Bearer "+testPlaceholder)
			resp, err := c.Do(req)
			if err != nil {
				errs <- err.Error()
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.Proto != "HTTP/2.0" || string(b) != "auth=Bearer "+testPlaceholder {
				errs <- fmt.Sprintf("stream %d: %s %q", i, resp.Proto, b)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range h.seen[1:] {
		if s.Auth != "Bearer "+testValue || s.Proto != "HTTP/2.0" {
			t.Errorf("upstream saw %s Authorization %q, want HTTP/2.0 with the value", s.Proto, s.Auth)
		}
	}
	if st := h.proxy.Stats(); st.Intercepted != 1 || st.Requests != maxStreams+1 {
		t.Errorf("Stats() = %+v, want %d requests on 1 intercepted connection", st, maxStreams+1)
	}
}

func TestStreamedResponseScrubbed(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Sum")
		fl := w.(http.Flusher)
		for i := 0; i < 5; i++ {
			// The value split across writes the guest may see apart.
			io.WriteString(w, "chunk "+testValue[:7])
			fl.Flush()
			io.WriteString(w, testValue[7:]+" ")
			fl.Flush()
		}
		w.Write(bytes.Repeat([]byte("x"), 2<<20)) // past MaxBody: streamed
		w.Header().Set("X-Sum", "end "+testValue)
	})
	resp, body := get(t, h.client(h.guestCAs, false), "https://api.test/stream", "Authorization", "Bearer "+testPlaceholder)
	if strings.Contains(body, testValue) || strings.Count(body, testPlaceholder) != 5 {
		t.Errorf("streamed body has the value %v, the placeholder %d times; want 0, 5", strings.Contains(body, testValue), strings.Count(body, testPlaceholder))
	}
	if got := resp.Trailer.Get("X-Sum"); got != "end "+testPlaceholder {
		t.Errorf("trailer X-Sum = %q, want %q", got, "end "+testPlaceholder)
	}
}

func TestEncodedResponseRefusedForSecretHost(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "br")
		w.Write([]byte("opaque"))
	})
	resp, body := get(t, h.client(h.guestCAs, false), "https://api.test/", "Accept-Encoding", "br")
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(body, "encoded") {
		t.Errorf("a br-encoded answer from a secret's host: %d %q, want 502 explaining", resp.StatusCode, body)
	}
	if got := h.last(); got.URL != "/" {
		t.Errorf("upstream saw %+v", got)
	}
}

func TestPassThrough(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)}}, echo)
	// plain.test is not intercepted: the guest sees the upstream's own
	// certificate, so it must trust the upstream's CA, not the proxy's.
	c := h.client(h.roots, false)
	resp, body := get(t, c, "https://plain.test/", "Authorization", "Bearer "+testPlaceholder)
	if resp.StatusCode != 200 || body != "auth=Bearer "+testPlaceholder || h.last().Auth != "Bearer "+testPlaceholder {
		t.Errorf("passed-through request: %d %q, upstream saw %q; want the placeholder untouched", resp.StatusCode, body, h.last().Auth)
	}
	if resp.TLS == nil || resp.TLS.PeerCertificates[0].Issuer.CommonName != "test upstream CA" {
		t.Errorf("passed-through connection's certificate is not the upstream's own")
	}
	if _, err := h.client(h.guestCAs, false).Get("https://plain.test/"); err == nil {
		t.Errorf("a client trusting only the proxy's CA reached a passed-through host")
	}
	// Not TLS at all: relayed as it is.
	conn, err := net.Dial("tcp", h.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 64)
	n, _ := conn.Read(b)
	if !strings.HasPrefix(string(b[:n]), "HTTP/1.") {
		t.Errorf("plain HTTP to port 443 got %q, want the upstream's (TLS) server's answer", b[:n])
	}
	if st := h.proxy.Stats(); st.PassedThrough < 3 || st.Intercepted != 0 {
		t.Errorf("Stats() = %+v, want 3 or more passed through, none intercepted", st)
	}
}

func TestCertCacheBounded(t *testing.T) {
	h := newHarness(t, Config{Intercept: []string{"*.wild.test"}, MaxCerts: 2}, echo)
	c := h.client(h.guestCAs, false)
	for _, n := range []string{"a", "b", "c", "d", "e", "a"} {
		c.CloseIdleConnections()
		if resp, _ := get(t, c, "https://"+n+".wild.test/"); resp.StatusCode != 200 {
			t.Fatalf("%s.wild.test: %d", n, resp.StatusCode)
		}
	}
	if st := h.proxy.Stats(); st.CertsCached != 2 || st.CertsMinted != 6 {
		t.Errorf("Stats() = %+v, want 2 cached, 6 minted (a's evicted before its return)", st)
	}
}

func TestConnectionLimit(t *testing.T) {
	release := make(chan struct{})
	h := newHarness(t, Config{Intercept: []string{"other.test"}, MaxConns: 1}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			<-release
		}
	})
	defer close(release)
	go h.client(h.guestCAs, false).Get("https://other.test/hold")
	for deadline := time.Now().Add(10 * time.Second); h.proxy.Stats().Active != 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first connection never became active")
		}
	}
	if _, err := h.client(h.guestCAs, false).Get("https://other.test/"); err == nil {
		t.Errorf("a second intercepted connection past MaxConns 1 was served")
	}
	if st := h.proxy.Stats(); st.Refused != 1 {
		t.Errorf("Stats() = %+v, want 1 refused", st)
	}
}

func TestCARoundTrip(t *testing.T) {
	ca, err := NewCA([]string{"api.test", "*.wild.test"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := ca.MarshalPEM()
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseCA(b)
	if err != nil {
		t.Fatalf("ParseCA(MarshalPEM()) = %v", err)
	}
	if !back.cert.Equal(ca.cert) || !back.key.Equal(ca.key) {
		t.Errorf("ParseCA(MarshalPEM()) differs from the CA")
	}
	if _, err := ParseCA(ca.CertPEM()); err == nil {
		t.Errorf("ParseCA(a certificate without its key) = nil error")
	}
	// The name constraints: a leaf for another domain does not verify.
	lc, _ := newLeafCache(ca, 4)
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	for name, ok := range map[string]bool{"api.test": true, "x.wild.test": true, "evil.example": false} {
		cert, err := lc.get(name, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		leaf, _ := x509.ParseCertificate(cert.Certificate[0])
		_, err = leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: pool})
		if (err == nil) != ok {
			t.Errorf("a leaf for %s verifies: %v, want %v", name, err, ok)
		}
	}
	if _, err := NewCA([]string{"10.0.0.1"}); err == nil {
		t.Errorf("NewCA of an IP address = nil error")
	}
}
