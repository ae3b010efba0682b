package tlsproxy

import (
	"io"
	"net/http"
	"testing"
)

// BenchmarkProxy measures a request through the proxy on the host alone
// (the guest's side is a loopback client, the NAT's relay a plain copy):
// intercepted with a secret substituted and the echo scrubbed, beside
// passed through, on a kept-alive connection and on a new one each.
func BenchmarkProxy(b *testing.B) {
	for _, tc := range []struct {
		name, url string
		newConn   bool
	}{
		{"intercepted/keepalive", "https://api.test/v1", false},
		{"passthrough/keepalive", "https://plain.test/v1", false},
		{"intercepted/newconn", "https://api.test/v1", true},
		{"passthrough/newconn", "https://plain.test/v1", true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newHarness(b, Config{Secrets: []Secret{testSecret(false)}}, echo)
			roots := h.roots.Clone()
			roots.AddCert(h.proxy.cfg.CA.Certificate())
			c := h.client(roots, false)
			c.Transport.(*http.Transport).DisableKeepAlives = tc.newConn
			for b.Loop() {
				req, _ := http.NewRequest("GET", tc.url, nil)
				req.Header.Set("Authorization", "Bearer "+testPlaceholder)
				resp, err := c.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatal(resp.Status)
				}
			}
		})
	}
}
