package e2b

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/supervisor"
)

func testServer(t *testing.T) (*Server, string) {
	t.Helper()
	dir := t.TempDir()
	m, err := supervisor.OpenManager(dir)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := OpenKeys(dir)
	if err != nil {
		t.Fatal(err)
	}
	secret, _, err := keys.Create("test", false)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Options{Manager: m, Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, secret
}

func TestKeys(t *testing.T) {
	dir := t.TempDir()
	keys, err := OpenKeys(dir)
	if err != nil {
		t.Fatal(err)
	}
	secret, kept, err := keys.Create("ci", true)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(secret, "e2b_") || len(secret) != 44 {
		t.Errorf("key %q: want e2b_ and 40 hex digits", secret)
	}
	if got, ok := keys.Check(secret); !ok || got.ID != kept.ID || !got.All {
		t.Errorf("Check(the key) = %+v, %v; want %+v, true", got, ok, kept)
	}
	mine := &supervisor.Record{Labels: map[string]string{labelKey: kept.ID}}
	theirs := &supervisor.Record{Labels: map[string]string{labelKey: "someone"}}
	cliMade := &supervisor.Record{}
	own := Key{ID: kept.ID}
	if !own.reaches(mine) || own.reaches(theirs) || own.reaches(cliMade) || !kept.reaches(theirs) || !kept.reaches(cliMade) {
		t.Error("a key's reach: want its own sandboxes, and every one with All")
	}
	for _, bad := range []string{"", secret + "0", "e2b_" + strings.Repeat("0", 40), kept.Hash} {
		if _, ok := keys.Check(bad); ok {
			t.Errorf("Check(%q) accepted it", bad)
		}
	}
	if _, _, err := keys.Create("ci", false); err == nil {
		t.Error("a second key named ci was made")
	}
	if _, _, err := keys.Create("bad\nname", false); err == nil {
		t.Error("a key name with a newline was taken")
	}
	// Only the hash is kept, in a file only its owner reads.
	path := filepath.Join(dir, KeysFile)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), secret) {
		t.Error("the keys file holds the key itself")
	}
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Errorf("the keys file's mode is %v, want 0600", st.Mode().Perm())
	}
	// Another process's keys are seen (the file is read again).
	other, _ := OpenKeys(dir)
	secret2, _, err := other.Create("", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := keys.Check(secret2); !ok {
		t.Error("a key another Keys made is not accepted")
	}
	if err := keys.Remove("ci"); err != nil {
		t.Fatal(err)
	}
	if _, ok := other.Check(secret); ok {
		t.Error("a removed key is still accepted")
	}
	if err := keys.Remove("ci"); err == nil {
		t.Error("removing a removed key succeeded")
	}
}

func TestSandboxTarget(t *testing.T) {
	for _, c := range []struct {
		host, id, port string
		wantID         string
		wantPort       int
		ok             bool
	}{
		{host: "127.0.0.1:3000", ok: false},
		{host: "api.example.com", ok: false},
		{host: "x", id: "isb1", wantID: "isb1", wantPort: EnvdPort, ok: true},
		{host: "x", id: "isb1", port: "8080", wantID: "isb1", wantPort: 8080, ok: true},
		{host: "x", id: "isb1", port: "nope", wantID: "isb1", wantPort: -1, ok: true},
		{host: "49983-isb1.example.com", wantID: "isb1", wantPort: 49983, ok: true},
		{host: "8080-isb1.localhost:3000", wantID: "isb1", wantPort: 8080, ok: true},
		{host: "70000-isb1.example.com", ok: false},
		{host: "www-isb1.example.com", ok: false},
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = c.host
		if c.id != "" {
			r.Header.Set("E2b-Sandbox-Id", c.id)
		}
		if c.port != "" {
			r.Header.Set("E2b-Sandbox-Port", c.port)
		}
		id, port, ok := sandboxTarget(r)
		if ok != c.ok || ok && (id != c.wantID || port != c.wantPort) {
			t.Errorf("host %q id %q port %q: %q %d %v; want %q %d %v", c.host, c.id, c.port, id, port, ok, c.wantID, c.wantPort, c.ok)
		}
	}
}

func TestMetadataFilter(t *testing.T) {
	// As the SDK sends {user: "abc", "a b": "x/y"}: each key and value
	// escaped, joined as a query, and the whole escaped again as the
	// query's value (which net/url undoes once).
	m, err := metadataFilter("user=abc&a%2520b=x%252Fy")
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 2 || m["user"] != "abc" || m["a b"] != "x/y" {
		t.Errorf("metadataFilter = %v", m)
	}
	if _, err := metadataFilter("a=%zz"); err == nil {
		t.Error("a bad escape was taken")
	}
}

func TestBasicUserAndSignature(t *testing.T) {
	if u, err := basicUser("Basic " + base64.StdEncoding.EncodeToString([]byte("user:"))); err != nil || u != "user" {
		t.Errorf("basicUser = %q, %v", u, err)
	}
	for _, bad := range []string{"Bearer x", "Basic !!!", "Basic " + base64.StdEncoding.EncodeToString([]byte(strings.Repeat("u", 65)+":"))} {
		if _, err := basicUser(bad); err == nil {
			t.Errorf("basicUser(%q) took it", bad)
		}
	}
	sign := func(raw string) string {
		sum := sha256.Sum256([]byte(raw))
		return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
	}
	r := httptest.NewRequest("GET", "/files?path=/a&signature="+sign("/a:read::tok"), nil)
	if !signatureValid(r, "tok") {
		t.Error("a valid read signature was refused")
	}
	if signatureValid(r, "other") {
		t.Error("a signature with another token was taken")
	}
	if r := httptest.NewRequest("POST", "/files?path=/a&signature="+sign("/a:read::tok"), nil); signatureValid(r, "tok") {
		t.Error("a read signature was taken for a write")
	}
	past := time.Now().Add(-time.Minute).Unix()
	r = httptest.NewRequest("GET", "/files?path=/a&signature_expiration="+itoa(past)+"&signature="+sign("/a:read::tok:"+itoa(past)), nil)
	if signatureValid(r, "tok") {
		t.Error("an expired signature was taken")
	}
}

func itoa(n int64) string { b, _ := json.Marshal(n); return string(b) }

func TestParsePasswd(t *testing.T) {
	users := parsePasswd("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbad:x:-1:0::/:\nshort:x\n")
	if len(users) != 2 || users["user"].uid != 1000 || users["user"].home != "/home/user" {
		t.Errorf("parsePasswd = %+v", users)
	}
	u := users["user"]
	for in, want := range map[string]string{"": "/home/user", "a/b": "/home/user/a/b", "/tmp/x": "/tmp/x", "../../etc": "/etc"} {
		if got := u.resolve(in); got != want {
			t.Errorf("resolve(%q) = %q, want %q", in, got, want)
		}
	}
}

// do sends a request to s and decodes its JSON answer into v (if not nil).
func do(t *testing.T, s *Server, method, path, key, body string, hdr map[string]string, v any) int {
	t.Helper()
	r := httptest.NewRequest(method, path, strings.NewReader(body))
	if key != "" {
		r.Header.Set("X-API-KEY", key)
	}
	for k, val := range hdr {
		r.Header.Set(k, val)
	}
	w := httptest.NewRecorder()
	s.ServeHTTP(w, r)
	if v != nil {
		if err := json.Unmarshal(w.Body.Bytes(), v); err != nil {
			t.Fatalf("%s %s: %d %q: %v", method, path, w.Code, w.Body.String(), err)
		}
	}
	return w.Code
}

// TestControlRefusals: what the control API refuses, before anything
// boots, with E2B's error shape (the SDKs read its code).
func TestControlRefusals(t *testing.T) {
	s, key := testServer(t)
	var e errorBody
	if code := do(t, s, "GET", "/v2/sandboxes", "", "", nil, &e); code != 401 || e.Code != 401 {
		t.Errorf("no key: %d %+v; want 401", code, e)
	}
	if code := do(t, s, "GET", "/v2/sandboxes", "e2b_"+strings.Repeat("1", 40), "", nil, &e); code != 401 {
		t.Errorf("a wrong key: %d; want 401", code)
	}
	for body, field := range map[string]string{
		`{"templateID":"base","timeout":-1}`:                                       "timeout",
		`{"templateID":"base","timeout":99999999}`:                                 "timeout",
		`{"templateID":"base","autoPause":true,"autoPauseMemory":false}`:           "autoPauseMemory",
		`{"autoPause":true,"autoPauseMemory":false,"autoResume":{"enabled":true}}`: "autoResume",
		`{"templateID":"base","volumeMounts":[{"name":"nosuch","path":"/data"}]}`:  "volumeMounts",
		`{"templateID":"base","volumeMounts":{"name":"x"}}`:                        "volumeMounts",
		`{"templateID":"base","autoResume":{"enabled":true}}`:                      "autoResume",
		`{"templateID":"base","envVars":{"A=B":"c"}}`:                              "envVars",
		`{"templateID":"base","metadata":{"":"x"}}`:                                "metadata",
		`{"templateID":"base","network":{"allowOut":["not a rule!"]}}`:             "network",
		`{"templateID":"` + strings.Repeat("x", maxTemplateID+1) + `"}`:            "templateID",
		`{"templateID":`: "body",
		`{"templateID":"base","allow_internet_access":false,"network":{"denyOut":["1.2.3.4"]}}`:                                             "network",
		`{"templateID":"base","network":{"egressProxy":{"address":"127.0.0.1:1080"}}}`:                                                      "not a public",
		`{"templateID":"base","network":{"egressProxy":{"address":"10.1.2.3:1080","username":"u"}}}`:                                        "private-egress-proxy",
		`{"templateID":"base","network":{"egressProxy":{"address":"proxy.test"}}}`:                                                          "HOST:PORT",
		`{"templateID":"base","network":{"egressProxy":{"address":"192.0.2.1:0"}}}`:                                                         "port",
		`{"templateID":"base","network":{"egressProxy":{"address":"8.8.8.8:1080","password":"p"}}}`:                                         "password without a username",
		`{"templateID":"base","network":{"egressProxy":{"address":"8.8.8.8:1080","username":"` + strings.Repeat("u", 256) + `"}}}`:          "255 bytes",
		`{"templateID":"base","allow_internet_access":false,"network":{"egressProxy":{"address":"8.8.8.8:1080"}}}`:                          "no network",
		`{"templateID":"base","network":{"rules":{"*":[{"transform":{"headers":{"A":"b"}}}]}}}`:                                             "rules",
		`{"templateID":"base","network":{"rules":{"1.2.3.4":[{"transform":{"headers":{"A":"b"}}}]}}}`:                                       "rules",
		`{"templateID":"base","network":{"rules":{"api.example.com":[{"transform":{"headers":{"Host":"b"}}}]}}}`:                            "Host",
		`{"templateID":"base","network":{"rules":{"api.example.com":[{"transform":{"headers":{"A":"b\r\nX: y"}}}]}}}`:                       "control characters",
		`{"templateID":"base","allow_internet_access":false,"network":{"rules":{"api.example.com":[{"transform":{"headers":{"A":"b"}}}]}}}`: "rules",
	} {
		e = errorBody{}
		if code := do(t, s, "POST", "/v2/sandboxes", key, body, nil, &e); code != 400 || e.Code != 400 || !strings.Contains(e.Message, field) {
			t.Errorf("create %s: %d %+v; want 400 naming %s", body, code, e, field)
		}
	}
	big := `{"templateID":"base","metadata":{"k":"` + strings.Repeat("v", maxBody) + `"}}`
	if code := do(t, s, "POST", "/v2/sandboxes", key, big, nil, &e); code != 400 {
		t.Errorf("a body over %d bytes: %d; want 400", maxBody, code)
	}
	for _, p := range []string{"/sandboxes/inosuch", "/sandboxes/inosuch/metrics"} {
		e = errorBody{}
		if code := do(t, s, "GET", p, key, "", nil, &e); code != 404 || e.Code != 404 {
			t.Errorf("GET %s: %d %+v; want 404 with code 404", p, code, e)
		}
	}
	if code := do(t, s, "DELETE", "/sandboxes/inosuch", key, "", nil, &e); code != 404 || e.Code != 404 {
		t.Errorf("DELETE /sandboxes/inosuch: %d %+v; want 404 with code 404", code, e)
	}
	if code := do(t, s, "POST", "/sandboxes/inosuch/fork", key, "{}", nil, &e); code != 404 {
		t.Errorf("fork of no sandbox: %d; want 404", code)
	}
	if code := do(t, s, "POST", "/sandboxes/inosuch/fork", key, `{"count":101}`, nil, &e); code != 400 || !strings.Contains(e.Message, "count") {
		t.Errorf("fork of 101: %d %+v; want 400 naming count", code, e)
	}
	if code := do(t, s, "PUT", "/sandboxes/inosuch/network", key, "{}", nil, &e); code != 404 {
		t.Errorf("update the network of no sandbox: %d; want 404", code)
	}
	for body, field := range map[string]string{
		`{"egressProxy":{"address":"127.0.0.1:1080"}}`:                            "not a public",
		`{"egressProxy":{"address":"a b:1080"}}`:                                  "egressProxy",
		`{"rules":{"*":[{"transform":{"headers":{"A":"b"}}}]}}`:                   "rules",
		`{"rules":{"x.test":[{"transform":{"headers":{"Content-Length":"1"}}}]}}`: "Content-Length",
		`{"allowOut":["not a rule!"]}`:                                            "network",
		`{"allowOut":` + strings.Repeat(`["1.2.3.4",`, 0) + `5}`:                  "body",
	} {
		e = errorBody{}
		if code := do(t, s, "PUT", "/sandboxes/inosuch/network", key, body, nil, &e); code != 400 || !strings.Contains(e.Message, field) {
			t.Errorf("update network %s: %d %+v; want 400 naming %s, before the sandbox is looked up", body, code, e, field)
		}
	}
	if code := do(t, s, "DELETE", "/templates/nosuch", key, "", nil, &e); code != 404 || e.Code != 404 {
		t.Errorf("delete snapshot nosuch: %d %+v; want 404 with code 404", code, e)
	}
	var list []sandboxInfo
	if code := do(t, s, "GET", "/v2/sandboxes?state=running", key, "", nil, &list); code != 200 || len(list) != 0 {
		t.Errorf("list: %d %v", code, list)
	}
	for _, q := range []string{"state=gone", "order=sideways", "startedAfter=yesterday", "limit=0", "limit=99999"} {
		if code := do(t, s, "GET", "/v2/sandboxes?"+q, key, "", nil, &e); code != 400 {
			t.Errorf("list %s: %d; want 400", q, code)
		}
	}
	// envd's side: an unknown sandbox, and a sandbox name that is no name.
	for _, id := range []string{"inosuch", "../x"} {
		if code := do(t, s, "POST", "/process.Process/List", "", "{}", map[string]string{"E2b-Sandbox-Id": id, "Content-Type": "application/json"}, &e); code != 404 {
			t.Errorf("envd for sandbox %q: %d %+v; want 404", id, code, e)
		}
	}
}

// TestReserve: a key's creates under way count against its limit, each
// holding its own slot until it is released; another key's do not.
func TestReserve(t *testing.T) {
	s, _ := testServer(t)
	s.perKey = 2
	r1, _, ok1 := s.reserve("k", 1)
	r2, _, ok2 := s.reserve("k", 1)
	_, have, ok3 := s.reserve("k", 1)
	if !ok1 || !ok2 || ok3 || have != 2 {
		t.Fatalf("three reservations of a limit of 2: %v %v %v (has %d)", ok1, ok2, ok3, have)
	}
	if _, _, ok := s.reserve("other", 2); !ok {
		t.Error("another key's reservation was refused")
	}
	r1()
	r1() // a second release gives back nothing more
	if _, _, ok := s.reserve("k", 2); ok {
		t.Error("a reservation of 2 with one slot free was taken")
	}
	r3, _, ok := s.reserve("k", 1)
	if !ok {
		t.Error("a released slot was not given again")
	}
	r2()
	r3()
	if s.pending["k"] != 0 {
		t.Errorf("pending after every release: %d", s.pending["k"])
	}
}
