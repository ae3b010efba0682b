package tlsproxy

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// headerEcho answers with the headers a rule may set, as upstream saw
// them.
func headerEcho(w http.ResponseWriter, r *http.Request) {
	fmt.Fprintf(w, "auth=%s team=%s trace=%s", r.Header.Get("Authorization"), r.Header.Get("X-Team"), r.Header.Get("X-Trace"))
}

// TestHeaderRules: a rule's headers reach the upstream of the hosts it
// matches, replacing the guest's; the exact host's rule wins over a
// wildcard's and rules are not merged; a host no rule matches is not
// intercepted; the audit log names the headers set, never their values.
func TestHeaderRules(t *testing.T) {
	rules := []HeaderRule{
		{Host: "api.test", Headers: map[string]string{"authorization": "Bearer rule-value-1", "X-Team": "blue"}},
		{Host: "*.wild.test", Headers: map[string]string{"X-Trace": "wild"}},
	}
	h := newHarness(t, Config{Headers: rules}, headerEcho)
	c := h.client(h.guestCAs, false)
	resp, body := get(t, c, "https://api.test/x", "Authorization", "Bearer guest's own", "X-Trace", "guest")
	if want := "auth=Bearer rule-value-1 team=blue trace=guest"; resp.StatusCode != 200 || body != want {
		t.Errorf("api.test: %d %q, want 200 %q (the rule's headers replace the guest's; others go as they are)", resp.StatusCode, body, want)
	}
	// A guest that names the rule's headers as hop-by-hop (Connection)
	// does not have them dropped.
	_, body = get(t, c, "https://api.test/x", "Connection", "keep-alive, X-Team, Authorization")
	if want := "auth=Bearer rule-value-1 team=blue trace="; body != want {
		t.Errorf("api.test with Connection naming the rule's headers: %q, want %q", body, want)
	}
	_, body = get(t, c, "https://a.wild.test/x")
	if want := "auth= team= trace=wild"; body != want {
		t.Errorf("a.wild.test: %q, want %q", body, want)
	}
	recs := h.records(3)
	if len(recs) != 3 || strings.Join(recs[0].Headers, ",") != "Authorization,X-Team" || strings.Join(recs[2].Headers, ",") != "X-Trace" {
		t.Errorf("audit = %+v, want the names set", recs)
	}
	for _, r := range recs {
		if strings.Contains(fmt.Sprint(r), "rule-value-1") {
			t.Errorf("the audit record %+v holds a rule's value", r)
		}
	}
	// plain.test: no rule, no interception (the guest sees the real
	// server, which its CA pool here does not trust).
	if _, err := c.Get("https://plain.test/x"); err == nil {
		t.Error("plain.test was intercepted with no rule for it")
	}
	if st := h.proxy.Stats(); st.Intercepted < 2 || st.HeadersSet != 3 {
		t.Errorf("Stats() = %+v, want 3 requests with headers set", st)
	}
}

// TestHeaderRulePrecedence: for a host, the exact rule, else the longest
// wildcard; never two rules' headers together.
func TestHeaderRulePrecedence(t *testing.T) {
	hs, err := checkHeaderRules([]HeaderRule{
		{Host: "*.test", Headers: map[string]string{"A": "short"}},
		{Host: "*.wild.test", Headers: map[string]string{"B": "long"}},
		{Host: "x.wild.test", Headers: map[string]string{"C": "exact"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]string{"x.wild.test": "C", "y.wild.test": "B", "a.b.wild.test": "B", "wild.test": "A", "other.test": "A", "test": "", "other.example": ""} {
		got := ""
		if r := hs.match(host); r != nil {
			got = strings.Join(r.names, ",")
		}
		if got != want {
			t.Errorf("match(%s) sets %q, want %q", host, got, want)
		}
	}
}

// TestHeaderRuleChecks: what a rule may not be.
func TestHeaderRuleChecks(t *testing.T) {
	many := map[string]string{}
	for i := range MaxHeadersPerRule + 1 {
		many[fmt.Sprintf("X-%d", i)] = "v"
	}
	for _, tc := range []struct {
		rules []HeaderRule
		want  string
	}{
		{[]HeaderRule{{Host: "*", Headers: map[string]string{"A": "b"}}}, "host"},
		{[]HeaderRule{{Host: "10.0.0.1", Headers: map[string]string{"A": "b"}}}, "IP address"},
		{[]HeaderRule{{Host: "a.test", Headers: nil}}, "no headers"},
		{[]HeaderRule{{Host: "a.test", Headers: map[string]string{"Host": "b.test"}}}, "Host"},
		{[]HeaderRule{{Host: "a.test", Headers: map[string]string{"Proxy-Authorization": "x"}}}, "Proxy-Authorization"},
		{[]HeaderRule{{Host: "a.test", Headers: map[string]string{"A B": "x"}}}, "not a header name"},
		{[]HeaderRule{{Host: "a.test", Headers: map[string]string{"A": "x\r\nB: y"}}}, "control characters"},
		{[]HeaderRule{{Host: "a.test", Headers: map[string]string{"a": "1", "A": "2"}}}, "twice"},
		{[]HeaderRule{{Host: "a.test", Headers: map[string]string{"A": "1"}}, {Host: "A.test.", Headers: map[string]string{"B": "2"}}}, "twice"},
		{[]HeaderRule{{Host: "a.test", Headers: many}}, "at most"},
		{[]HeaderRule{{Host: "a.test", Headers: map[string]string{"A": strings.Repeat("v", MaxSecretLen+1)}}}, "longer"},
	} {
		if err := CheckHeaderRules(tc.rules); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CheckHeaderRules(%v) = %v, want an error naming %q", tc.rules, err, tc.want)
		}
	}
}

// TestSetHeaders: rules replaced while the proxy runs take effect on the
// next request; a host the CA was not made for is refused, and so is a
// proxy made with rules outside it.
func TestSetHeaders(t *testing.T) {
	h := newHarness(t, Config{}, headerEcho)
	c := h.client(h.guestCAs, false)
	if err := h.proxy.SetHeaders([]HeaderRule{{Host: "other.test", Headers: map[string]string{"X-Team": "red"}}}); err != nil {
		t.Fatal(err)
	}
	if _, body := get(t, c, "https://other.test/"); !strings.Contains(body, "team=red") {
		t.Errorf("after SetHeaders: %q, want team=red", body)
	}
	if err := h.proxy.SetHeaders([]HeaderRule{{Host: "other.test", Headers: map[string]string{"X-Team": "green"}}}); err != nil {
		t.Fatal(err)
	}
	if _, body := get(t, c, "https://other.test/"); !strings.Contains(body, "team=green") {
		t.Errorf("after the second SetHeaders: %q, want team=green", body)
	}
	if err := h.proxy.SetHeaders(nil); err != nil {
		t.Fatal(err)
	}
	// A new connection is not intercepted (one kept alive would still
	// be served).
	c.CloseIdleConnections()
	if _, err := c.Get("https://other.test/"); err == nil {
		t.Error("other.test still intercepted with its rule gone")
	}
	err := h.proxy.SetHeaders([]HeaderRule{{Host: "plain.test", Headers: map[string]string{"A": "b"}}})
	if !errors.Is(err, ErrOutsideCA) {
		t.Errorf("SetHeaders for a host outside the CA = %v, want ErrOutsideCA", err)
	}
	ca, _ := NewCA([]string{"api.test"})
	if _, err := New(Config{CA: ca, Headers: []HeaderRule{{Host: "*.other.test", Headers: map[string]string{"A": "b"}}}}); !errors.Is(err, ErrOutsideCA) {
		t.Errorf("New with a rule outside its CA = %v, want ErrOutsideCA", err)
	}
	for pat, want := range map[string]bool{"api.test": true, "*.api.test": true, "x.api.test": true, "test": false, "*.test": false, "other.test": false} {
		if got := ca.Permits(pat); got != want {
			t.Errorf("Permits(%s) = %v, want %v", pat, got, want)
		}
	}
}

// TestHeaderRuleOnSecretHost: on a host that receives secrets, whose
// answers are checked for them, a rule's Accept-Encoding does not reach
// the upstream (the transport asks for what it can decode itself), and
// the rule's other headers do.
func TestHeaderRuleOnSecretHost(t *testing.T) {
	h := newHarness(t, Config{Secrets: []Secret{testSecret(false)},
		Headers: []HeaderRule{{Host: "api.test", Headers: map[string]string{"Accept-Encoding": "br", "X-Team": "blue"}}}},
		func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "enc=%s team=%s", r.Header.Get("Accept-Encoding"), r.Header.Get("X-Team"))
		})
	resp, body := get(t, h.client(h.guestCAs, false), "https://api.test/x")
	if want := "enc=gzip team=blue"; resp.StatusCode != 200 || body != want {
		t.Errorf("%d %q, want 200 %q", resp.StatusCode, body, want)
	}
}
