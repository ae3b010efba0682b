package e2b

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
)

// FuzzRequestParsing feeds what an API caller controls (the host name,
// the routing headers, the list's metadata filter, the Authorization
// header, upload metadata headers, a guest's /etc/passwd) to the parsers
// that read them: none may panic, and what they accept must be in range.
func FuzzRequestParsing(f *testing.F) {
	f.Add("49983-isb1.example.com", "", "", "user=abc&a%2520b=x", "Basic dXNlcjo=", "X-Metadata-Owner", "root:x:0:0::/root:/bin/sh\n")
	f.Add("x", "isb1", "8080", "", "Bearer x", "X-Metadata-", "user:x:1000:1000::/home/user:/bin/bash")
	f.Add("70000-a.b:99", "", "-1", "%zz", "Basic !!", "X-Other", ":::::::\n")
	f.Fuzz(func(t *testing.T, host, id, port, meta, auth, hdr, passwd string) {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = host
		if id != "" && !strings.ContainsAny(id, "\r\n\x00") {
			r.Header.Set("E2b-Sandbox-Id", id)
		}
		if port != "" && !strings.ContainsAny(port, "\r\n\x00") {
			r.Header.Set("E2b-Sandbox-Port", port)
		}
		if gotID, p, ok := sandboxTarget(r); ok && p != -1 && (p <= 0 || p > 65535 || gotID == "") {
			t.Errorf("sandboxTarget(%q, %q, %q) = %q, %d", host, id, port, gotID, p)
		}
		if m, err := metadataFilter(meta); err == nil && len(m) > 0 && meta == "" {
			t.Errorf("metadataFilter(%q) = %v", meta, m)
		}
		if u, err := basicUser(auth); err == nil && len(u) > 64 {
			t.Errorf("basicUser(%q) = %q, over 64 bytes", auth, u)
		}
		h := http.Header{}
		if k := http.CanonicalHeaderKey(hdr); k != "" && !strings.ContainsAny(k, "\r\n\x00: ") {
			h.Set(k, meta)
		}
		if m, err := uploadMetadata(h); err == nil && len(m) > maxMetadata {
			t.Errorf("uploadMetadata gave %d entries", len(m))
		}
		for name, u := range parsePasswd(passwd) {
			if name == "" || u.uid < 0 || u.gid < 0 {
				t.Errorf("parsePasswd gave %q: %+v", name, u)
			}
			u.resolve(meta) // any path, made absolute
		}
		q := url.Values{"path": {meta}, "signature": {"v1_" + auth}, "signature_expiration": {port}}
		r = httptest.NewRequest("GET", "/files?"+q.Encode(), nil)
		if signatureValid(r, "") {
			t.Error("a signature was taken with no token")
		}
	})
}
