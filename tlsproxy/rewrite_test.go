package tlsproxy

import (
	"bufio"
	"bytes"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// chunkReader hands out at most n bytes a read.
type chunkReader struct {
	b []byte
	n int
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	k := min(len(p), r.n, len(r.b))
	copy(p, r.b[:k])
	r.b = r.b[k:]
	return k, nil
}

func mustSecrets(t testing.TB, in ...Secret) []*secret {
	t.Helper()
	s, err := checkSecrets(in)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func scrubAll(secrets []*secret, data []byte, chunk int) []byte {
	sc := newScrubber(secrets, func(*secret) bool { return true })
	out, _ := io.ReadAll(newScrubReader(io.NopCloser(&chunkReader{b: data, n: chunk}), sc))
	return out
}

func TestScrubReader(t *testing.T) {
	secrets := mustSecrets(t,
		Secret{Name: "A", Placeholder: "PLACEHOLDER-AAAAAAAA", Value: "alpha-value", Hosts: []string{"a.test"}},
		Secret{Name: "B", Placeholder: "PLACEHOLDER-BBBBBBBB", Value: "alpha-value-longer", Hosts: []string{"a.test"}},
	)
	in := "x alpha-value y alpha-value-longer z alpha-valu alpha-value"
	want := "x PLACEHOLDER-AAAAAAAA y PLACEHOLDER-BBBBBBBB z alpha-valu PLACEHOLDER-AAAAAAAA"
	for chunk := 1; chunk <= len(in)+1; chunk++ {
		if got := string(scrubAll(secrets, []byte(in), chunk)); got != want {
			t.Fatalf("scrub(%q) in %d-byte reads = %q, want %q", in, chunk, got, want)
		}
	}
}

// TestScrubEncodings: a host that reflects a secret percent-encoded,
// JSON-escaped or in base64 sends the guest the placeholder in that
// encoding, never the value, in a streamed body and in a string.
func TestScrubEncodings(t *testing.T) {
	value := `s3cr3t/va+lue"with\specials=`
	secrets := mustSecrets(t, Secret{Name: "K", Placeholder: testPlaceholder, Value: value, Hosts: []string{"a.test"}})
	for _, enc := range encodings {
		in := "echo: " + enc(value) + " end"
		want := "echo: " + enc(testPlaceholder) + " end"
		for _, chunk := range []int{1, 7, 4096} {
			if got := string(scrubAll(secrets, []byte(in), chunk)); got != want {
				t.Errorf("scrub(%q) in %d-byte reads = %q, want %q", in, chunk, got, want)
			}
		}
		sc := newScrubber(secrets, func(*secret) bool { return true })
		if got := sc.String(in); got != want {
			t.Errorf("String(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestCheckSecrets(t *testing.T) {
	ok := Secret{Name: "K", Placeholder: testPlaceholder, Value: "v4lue", Hosts: []string{"api.test"}}
	for _, tc := range []struct {
		what string
		mod  func(*Secret)
	}{
		{"no name", func(s *Secret) { s.Name = "" }},
		{"short placeholder", func(s *Secret) { s.Placeholder = "short" }},
		{"empty value", func(s *Secret) { s.Value = "" }},
		{"long value", func(s *Secret) { s.Value = strings.Repeat("v", MaxSecretLen+1) }},
		{"newline", func(s *Secret) { s.Value = "a\r\nX-Evil: 1" }},
		{"no hosts", func(s *Secret) { s.Hosts = nil }},
		{"IP host", func(s *Secret) { s.Hosts = []string{"10.0.0.1"} }},
		{"bad host", func(s *Secret) { s.Hosts = []string{"a..b"} }},
		{"value in placeholder", func(s *Secret) { s.Value = testPlaceholder[3:9] }},
	} {
		s := ok
		tc.mod(&s)
		if _, err := checkSecrets([]Secret{s}); err == nil {
			t.Errorf("checkSecrets(%s) = nil error", tc.what)
		}
	}
	if _, err := checkSecrets([]Secret{ok, ok}); err == nil {
		t.Errorf("checkSecrets(the same secret twice) = nil error")
	}
	if _, err := checkSecrets([]Secret{ok}); err != nil {
		t.Errorf("checkSecrets(%+v) = %v", ok, err)
	}
}

func TestPatterns(t *testing.T) {
	for _, tc := range []struct {
		pattern, name string
		want          bool
	}{
		{"api.test", "api.test", true},
		{"API.test.", "api.test", true},
		{"api.test", "x.api.test", false},
		{"*.api.test", "x.api.test", true},
		{"*.api.test", "a.b.api.test", true},
		{"*.api.test", "api.test", false},
		{"*.api.test", "xapi.test", false},
	} {
		p, err := parsePattern(tc.pattern)
		if err != nil {
			t.Fatalf("parsePattern(%q) = %v", tc.pattern, err)
		}
		if got := p.matches(tc.name); got != tc.want {
			t.Errorf("pattern %q matches %q = %v, want %v", tc.pattern, tc.name, got, tc.want)
		}
	}
}

// replaceRef replaces leftmost-longest, the reference for the scrubber.
// replaceRef is the scrubber's replacement done the plain way: at each
// place the longest of the forms (each secret's value, as it is and
// encoded) that starts there, else the byte.
func replaceRef(data []byte, secrets []*secret) []byte {
	forms := newScrubber(secrets, func(*secret) bool { return true }).forms
	var out []byte
	for i := 0; i < len(data); {
		var best *form
		for j := range forms {
			if f := &forms[j]; bytes.HasPrefix(data[i:], f.value) && (best == nil || len(f.value) > len(best.value)) {
				best = f
			}
		}
		if best == nil {
			out = append(out, data[i])
			i++
			continue
		}
		out = append(out, best.placeholder...)
		i += len(best.value)
	}
	return out
}

// FuzzScrubReader: whatever the data and however it is read, the guest
// gets exactly the data with the values (and their encodings) replaced,
// leftmost first and the longest where two start at one place (one value
// may extend the other).
func FuzzScrubReader(f *testing.F) {
	f.Add([]byte("a s3cr3t b s3cr3ts3cr3t"), "s3cr3t", "", uint8(3))
	f.Add([]byte("sss3cr3t"), "ss3", "cr", uint8(1))
	f.Add(bytes.Repeat([]byte("ab"), 100), "aba", "b", uint8(7))
	f.Fuzz(func(t *testing.T, data []byte, value, more string, chunk uint8) {
		in := []Secret{{Name: "S", Placeholder: testPlaceholder, Value: value, Hosts: []string{"a.test"}}}
		if more != "" {
			in = append(in, Secret{Name: "T", Placeholder: strings.ToUpper(testPlaceholder), Value: value + more, Hosts: []string{"a.test"}})
		}
		secrets, err := checkSecrets(in)
		if err != nil {
			return
		}
		want := replaceRef(data, secrets)
		if got := scrubAll(secrets, data, int(chunk)+1); !bytes.Equal(got, want) {
			t.Fatalf("scrub(%q, values %q, %q) in %d-byte reads = %q, want %q", data, value, value+more, int(chunk)+1, got, want)
		}
	})
}

// FuzzRewriteRequest: a request from the guest, however it is made, gets
// only the values of the secrets allowed for its host, only where their
// placeholders were, and never the placeholder of another secret: that
// one blocks it.
func FuzzRewriteRequest(f *testing.F) {
	const phA, phB = "capsa-secret-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "capsa-secret-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
	secrets := mustSecrets(f,
		Secret{Name: "A", Placeholder: phA, Value: "VALUE-OF-A", Hosts: []string{"api.test"}, Body: true},
		Secret{Name: "B", Placeholder: phB, Value: "VALUE-OF-B", Hosts: []string{"*.other.test"}, Body: true},
	)
	f.Add([]byte("GET /x?k=" + phA + " HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer " + phA + "\r\n\r\n"))
	f.Add([]byte("POST /x HTTP/1.1\r\nHost: api.test\r\nAuthorization: Basic Y2Fwc2Etc2VjcmV0LWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYQ==\r\nContent-Length: 52\r\n\r\nk=" + phA + phB[:5]))
	f.Add([]byte("GET / HTTP/1.1\r\nHost: api.test\r\nX-Other: " + phB + "\r\n\r\n"))
	f.Add([]byte("POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"))
	f.Fuzz(func(t *testing.T, raw []byte) {
		r, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw)))
		if err != nil {
			return
		}
		dump := func(r *http.Request) string {
			var b strings.Builder
			b.WriteString(r.URL.Path + " " + r.URL.RawPath + " " + r.URL.RawQuery)
			for _, k := range slices.Sorted(maps.Keys(r.Header)) {
				for _, v := range r.Header[k] {
					b.WriteString("\n" + k + ": " + v)
					if dec, ok := decodeBasic(v); ok {
						b.WriteString(" (" + dec + ")")
					}
				}
			}
			return b.String()
		}
		before := dump(r)
		pl := planRequest(secrets, r, "api.test")
		body, err := pl.rewriteBody(secrets, bodySecrets(secrets, "api.test"), r.Body, 1<<16)
		if err != nil {
			return
		}
		if pl.blocked != nil {
			if pl.blocked.Name != "B" {
				t.Fatalf("blocked by %s for api.test, want only B", pl.blocked.Name)
			}
			return
		}
		if strings.Contains(before, phB) {
			t.Fatalf("a request carrying B's placeholder was not blocked:\n%s", before)
		}
		pl.substitute(r)
		after := dump(r)
		if strings.Contains(after, phA) || bytes.Contains(body, []byte(phA)) {
			t.Fatalf("A's placeholder left after substitution:\n%s\n%q", after, body)
		}
		if strings.Contains(after, "VALUE-OF-B") != strings.Contains(before, "VALUE-OF-B") {
			t.Fatalf("B's value appeared in a request to api.test:\n%s", after)
		}
		if !strings.Contains(before, phA) && !strings.Contains(before, "VALUE-OF-A") && strings.Contains(after, "VALUE-OF-A") {
			t.Fatalf("A's value appeared where its placeholder was not:\n%s\n->\n%s", before, after)
		}
		if !strings.Contains(before, phA) && before != after {
			t.Fatalf("a request without placeholders changed:\n%s\n->\n%s", before, after)
		}
	})
}
