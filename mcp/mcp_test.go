package mcp

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/hub"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
	"github.com/capsa-sandbox/capsa/supervisor/supervisortest"
)

// connect starts a server on a fresh state directory and returns the SDK's
// own client connected to it in memory, with the directory, for the test
// to make records the server then finds (supervisortest).
func connect(t *testing.T) (*sdk.ClientSession, string) {
	t.Helper()
	m, dir := managerAndDir(t)
	return connectTo(t, NewServer(Options{Manager: m, Version: "test"})), dir
}

// managerAndDir opens a fresh state directory as a Manager.
func managerAndDir(t *testing.T) (*supervisor.Manager, string) {
	t.Helper()
	dir := t.TempDir()
	m, err := supervisor.OpenManager(dir)
	if err != nil {
		t.Fatal(err)
	}
	return m, dir
}

func connectTo(t *testing.T, s *sdk.Server) *sdk.ClientSession {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	st, ct := sdk.NewInMemoryTransports()
	ss, err := s.Connect(ctx, st, nil)
	if err != nil {
		t.Fatalf("server Connect = %v", err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test-client", Version: "1"}, nil).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatalf("client Connect = %v", err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// call calls a tool and returns its result, failing the test on a
// protocol error (a tool's own error is a result with IsError).
func call(t *testing.T, cs *sdk.ClientSession, name string, args map[string]any) *sdk.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("CallTool(%s, %v) = protocol error %v; want a result", name, args, err)
	}
	return res
}

func text(res *sdk.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*sdk.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

func TestToolList(t *testing.T) {
	cs, _ := connect(t)
	res, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatalf("ListTools = %v", err)
	}
	var names []string
	for _, tool := range res.Tools {
		names = append(names, tool.Name)
		if tool.Description == "" {
			t.Errorf("tool %s has no description", tool.Name)
		}
		schema, _ := json.Marshal(tool.InputSchema)
		if !strings.Contains(string(schema), `"type":"object"`) {
			t.Errorf("tool %s's input schema = %s; want an object", tool.Name, schema)
		}
	}
	slices.Sort(names)
	want := []string{"file_list", "file_read", "file_write", "kv_cas", "kv_get", "kv_list", "kv_set",
		"mailbox_publish", "mailbox_receive", "sandbox_create", "sandbox_destroy", "sandbox_exec",
		"sandbox_fork", "sandbox_list", "sandbox_network", "sandbox_resume", "sandbox_suspend", "snapshot_create", "snapshot_restore"}
	if !slices.Equal(names, want) {
		t.Errorf("ListTools names = %v, want %v", names, want)
	}
	// The schema carries the arguments' descriptions, and says which are
	// required.
	for _, tool := range res.Tools {
		if tool.Name != "sandbox_exec" {
			continue
		}
		schema, _ := json.Marshal(tool.InputSchema)
		var s struct {
			Required   []string                   `json:"required"`
			Properties map[string]json.RawMessage `json:"properties"`
		}
		json.Unmarshal(schema, &s)
		if !slices.Equal(s.Required, []string{"name"}) {
			t.Errorf("sandbox_exec's required arguments = %v, want [name]", s.Required)
		}
		if p := string(s.Properties["timeout_seconds"]); !strings.Contains(p, "kill the process") {
			t.Errorf("sandbox_exec's timeout_seconds schema = %s; want its description", p)
		}
	}
}

// TestArgumentErrors: bad arguments are tool errors (IsError, with why),
// whether the SDK's schema check or the tool's own finds them, and the
// server answers on.
func TestArgumentErrors(t *testing.T) {
	cs, _ := connect(t)
	for _, c := range []struct {
		tool string
		args map[string]any
		want string
	}{
		{"sandbox_exec", map[string]any{"command": []string{"true"}}, "name"},
		{"sandbox_exec", map[string]any{"name": "a"}, "give command"},
		{"sandbox_exec", map[string]any{"name": "a", "command": []string{"true"}, "shell": "true"}, "give command"},
		{"sandbox_exec", map[string]any{"name": "a", "shell": "true", "timeout_seconds": -1}, "timeout_seconds -1"},
		{"sandbox_exec", map[string]any{"name": "a", "shell": "true", "timeout_seconds": 99999}, "timeout_seconds 99999"},
		{"sandbox_exec", map[string]any{"name": "a", "shell": "true", "max_output_bytes": 1 << 30}, "max_output_bytes"},
		{"sandbox_exec", map[string]any{"name": "a", "shell": "true", "env": []string{"NOEQUALS"}}, "KEY=VALUE"},
		{"sandbox_exec", map[string]any{"name": "a", "shell": "true", "bogus": 1}, "bogus"},
		{"sandbox_create", map[string]any{"cpus": "two"}, "cpus"},
		{"sandbox_create", map[string]any{"cpus": 9999}, "CPUs: must be between"},
		{"sandbox_create", map[string]any{"memory_mib": 10}, "must be between 64"},
		{"sandbox_create", map[string]any{"name": "no/slash"}, "sandbox name"},
		{"sandbox_create", map[string]any{"network": "sideways"}, "network"},
		{"sandbox_create", map[string]any{"allow": []string{"example.com"}}, "need a network"},
		{"sandbox_create", map[string]any{"shares": []map[string]any{{"host": "relative/dir", "guest": "/mnt"}}}, "absolute host path"},
		{"sandbox_create", map[string]any{"shares": []map[string]any{{"host": "/nonexistent/dir", "guest": "/mnt"}}}, "/nonexistent/dir"},
		{"sandbox_create", map[string]any{"env": []string{"=x"}}, "KEY=VALUE"},
		{"sandbox_create", map[string]any{"ttl_seconds": -5}, "ttl_seconds"},
		{"sandbox_create", map[string]any{"limits": "net=fast"}, `limit net=fast: "fast" is not an amount`},
		{"sandbox_create", map[string]any{"cpu_quota": 0.001}, "CPU quota of 0.001 CPUs"},
		{"snapshot_restore", map[string]any{"snapshot": "s", "limits": "disk-iops=1"}, "disk: 1 operations a second"},
		{"file_read", map[string]any{"name": "a", "path": "relative"}, "absolute"},
		{"file_read", map[string]any{"name": "a", "path": "/x", "max_bytes": 1 << 30}, "max_bytes"},
		{"file_write", map[string]any{"name": "a", "path": "/x", "content": "hi", "encoding": "rot13"}, "encoding"},
		{"file_write", map[string]any{"name": "a", "path": "/x", "content": "!!!", "encoding": "base64"}, "content"},
		{"file_write", map[string]any{"name": "a", "path": "/x", "content": "hi", "mode": "rwx"}, "mode"},
		{"file_write", map[string]any{"name": "a", "path": "/x"}, "content"},
		{"file_list", map[string]any{"name": "a", "path": "."}, "absolute"},
		{"sandbox_fork", map[string]any{"name": "a", "count": 17}, "count 17"},
		{"snapshot_restore", map[string]any{"snapshot": "../x"}, "snapshot name"},
		{"snapshot_create", map[string]any{"name": "a", "snapshot": "a b"}, "snapshot name"},
		{"sandbox_create", map[string]any{"mailbox": []string{"a*b"}}, "may only end it"},
		{"sandbox_create", map[string]any{"network": "public-only", "secrets": []map[string]any{{"name": "API_KEY", "env": "CAPSA_MCP_TEST_UNSET", "hosts": []string{"api.example.com"}}}}, "--secret-env CAPSA_MCP_TEST_UNSET allows it"},
		{"sandbox_create", map[string]any{"shares": []map[string]any{{"host": "/tmp", "guest": "/mnt"}}}, "shares no host directory"},
		{"sandbox_create", map[string]any{"volumes": []map[string]any{{"name": "nosuchvol", "guest": "/data"}}}, "nosuchvol"},
		{"sandbox_create", map[string]any{"kv": []string{"a\u0001"}}, "control character"},
		{"kv_cas", map[string]any{"key": "k", "value": "v"}, "version"},
		{"kv_get", map[string]any{"key": ""}, "empty key"},
		{"kv_set", map[string]any{"key": "k", "value": "!!", "encoding": "base64"}, "value"},
		{"mailbox_receive", map[string]any{"topic": "t", "wait_seconds": 3600}, "wait_seconds 3600"},
		{"mailbox_receive", map[string]any{"topic": "t", "from": -2}, "from -2"},
		{"mailbox_publish", map[string]any{"topic": "", "payload": "x"}, "empty topic"},
	} {
		res := call(t, cs, c.tool, c.args)
		if !res.IsError || !strings.Contains(text(res), c.want) {
			t.Errorf("%s(%v) = IsError %v, %q; want a tool error saying %q", c.tool, c.args, res.IsError, text(res), c.want)
		}
	}
	if _, err := cs.ListTools(context.Background(), nil); err != nil {
		t.Errorf("ListTools after the errors = %v; the server should answer on", err)
	}
}

// TestMissingSandbox: a sandbox that does not exist, or does not run, is a
// tool error naming it.
func TestMissingSandbox(t *testing.T) {
	cs, dir := connect(t)
	for _, c := range []struct {
		tool string
		args map[string]any
	}{
		{"sandbox_exec", map[string]any{"name": "nosuch", "command": []string{"true"}}},
		{"file_read", map[string]any{"name": "nosuch", "path": "/etc/hostname"}},
		{"file_write", map[string]any{"name": "nosuch", "path": "/tmp/x", "content": "x"}},
		{"file_list", map[string]any{"name": "nosuch", "path": "/"}},
		{"sandbox_destroy", map[string]any{"name": "nosuch"}},
		{"sandbox_network", map[string]any{"name": "nosuch", "network": "deny-all"}},
		{"snapshot_create", map[string]any{"name": "nosuch"}},
		{"sandbox_fork", map[string]any{"name": "nosuch"}},
		{"snapshot_restore", map[string]any{"snapshot": "nosuch"}},
	} {
		res := call(t, cs, c.tool, c.args)
		if !res.IsError || !strings.Contains(text(res), "nosuch") {
			t.Errorf("%s(%v) = IsError %v, %q; want a tool error naming nosuch", c.tool, c.args, res.IsError, text(res))
		}
	}

	// A sandbox that ended: listed with all, refused by exec, destroyed.
	supervisortest.Exited(t, dir, "ended", sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"sleep", "1"}}}, 3, "its main process ended")
	res := call(t, cs, "sandbox_exec", map[string]any{"name": "ended", "shell": "true"})
	if !res.IsError || !strings.Contains(text(res), "not running") {
		t.Errorf("sandbox_exec(ended) = IsError %v, %q; want a tool error saying it is not running", res.IsError, text(res))
	}
	for _, all := range []bool{false, true} {
		res := call(t, cs, "sandbox_list", map[string]any{"all": all})
		var l listResult
		if b, _ := json.Marshal(res.StructuredContent); res.IsError || json.Unmarshal(b, &l) != nil {
			t.Fatalf("sandbox_list(all %v) = IsError %v, %q", all, res.IsError, text(res))
		}
		want := 0
		if all {
			want = 1
		}
		if len(l.Sandboxes) != want {
			t.Errorf("sandbox_list(all %v) = %+v; want %d sandboxes", all, l.Sandboxes, want)
		} else if all {
			if s := l.Sandboxes[0]; s.Name != "ended" || s.State != "exited" || s.ExitCode == nil || *s.ExitCode != 3 || s.Command != "sleep 1" {
				t.Errorf("sandbox_list(all) = %+v; want ended, exited with code 3, sleep 1", s)
			}
		}
	}
	if res := call(t, cs, "sandbox_destroy", map[string]any{"name": "ended"}); res.IsError {
		t.Errorf("sandbox_destroy(ended) = %q; want it removed", text(res))
	}
	if supervisortest.Recorded(t, dir, "ended") {
		t.Errorf("the record of ended is there after sandbox_destroy; want it gone")
	}
}

// TestPanicIsAToolError: a tool that panics answers with an error; the
// server lives on.
func TestPanicIsAToolError(t *testing.T) {
	s := sdk.NewServer(&sdk.Implementation{Name: "t", Version: "1"}, nil)
	addTool(s, &tools{log: slog.New(slog.DiscardHandler)}, &sdk.Tool{Name: "boom"}, func(context.Context, nameArgs) (destroyResult, error) {
		var m map[string]int
		m["x"]++ // a nil map: panics
		return destroyResult{}, nil
	})
	cs := connectTo(t, s)
	for range 2 {
		res := call(t, cs, "boom", map[string]any{"name": "x"})
		if !res.IsError || !strings.Contains(text(res), "boom: internal error") {
			t.Errorf("boom = IsError %v, %q; want a tool error", res.IsError, text(res))
		}
	}
}

func TestListenLoopback(t *testing.T) {
	for _, addr := range []string{":0", "0.0.0.0:0", "[::]:0", "192.0.2.1:0", "example.com:0", "127.0.0.1"} {
		if l, err := ListenLoopback(addr); err == nil {
			l.Close()
			t.Errorf("ListenLoopback(%q) = nil error; want it refused", addr)
		}
	}
	for _, addr := range []string{"127.0.0.1:0", "localhost:0", "127.0.0.2:0"} {
		l, err := ListenLoopback(addr)
		if err != nil {
			t.Errorf("ListenLoopback(%q) = %v; want it to listen", addr, err)
			continue
		}
		l.Close()
	}
}

// withToken adds a bearer token to every request.
type withToken struct{ token string }

func (b withToken) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}

// TestHTTP: streamable HTTP on loopback serves a client with the token,
// and nobody without it.
func TestHTTP(t *testing.T) {
	m, _ := managerAndDir(t)
	l, err := ListenLoopback("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(HTTPHandler(NewServer(Options{Manager: m}), "sesame", nil))
	srv.Listener.Close()
	srv.Listener = l
	srv.Start()
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	client := sdk.NewClient(&sdk.Implementation{Name: "test-client", Version: "1"}, nil)

	for _, token := range []string{"", "wrong"} {
		tr := &sdk.StreamableClientTransport{Endpoint: srv.URL + HTTPPath, HTTPClient: &http.Client{Transport: withToken{token}}, MaxRetries: -1}
		if cs, err := client.Connect(ctx, tr, nil); err == nil {
			cs.Close()
			t.Errorf("Connect with token %q = nil error; want it refused", token)
		}
	}
	req, _ := http.NewRequest("POST", srv.URL+HTTPPath, strings.NewReader("{}"))
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("POST %s without a token = %v, %v; want 401", HTTPPath, resp, err)
	}

	tr := &sdk.StreamableClientTransport{Endpoint: srv.URL + HTTPPath, HTTPClient: &http.Client{Transport: withToken{"sesame"}}}
	cs, err := client.Connect(ctx, tr, nil)
	if err != nil {
		t.Fatalf("Connect with the token = %v", err)
	}
	defer cs.Close()
	res, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "sandbox_list", Arguments: map[string]any{}})
	if err != nil || res.IsError {
		t.Fatalf("sandbox_list over HTTP = %v, %+v", err, res)
	}
	if got := text(res); got != `{"sandboxes":[]}` {
		t.Errorf("sandbox_list over HTTP = %s, want no sandboxes", got)
	}
}

func TestCapped(t *testing.T) {
	c := &capped{max: 5}
	for _, s := range []string{"abc", "defg", "hij"} {
		if n, err := c.Write([]byte(s)); n != len(s) || err != nil {
			t.Errorf("capped.Write(%q) = %d, %v; want %d, nil", s, n, err, len(s))
		}
	}
	if string(c.buf) != "abcde" || !c.truncated {
		t.Errorf("capped = %q, truncated %v; want abcde, true", c.buf, c.truncated)
	}
	c = &capped{max: 5}
	c.Write([]byte("abcde"))
	if c.truncated {
		t.Errorf("capped of exactly max = truncated; want not")
	}
}

func TestEncode(t *testing.T) {
	for _, c := range []struct {
		data      string
		truncated bool
		content   string
		enc       string
	}{
		{"hello\n", false, "hello\n", encText},
		{"h\xc3\xa9", false, "h\xc3\xa9", encText},
		{"h\xc3", true, "h", encText},       // a rune cut by the limit
		{"h\xc3", false, "aMM=", encBase64}, // a file that ends so is not text
		{"\x00\xff\xfe", false, "AP/+", encBase64},
	} {
		content, enc := encode([]byte(c.data), c.truncated)
		if content != c.content || enc != c.enc {
			t.Errorf("encode(%q, %v) = %q, %s; want %q, %s", c.data, c.truncated, content, enc, c.content, c.enc)
		}
	}
}

// TestHubTools: the mailbox and key-value tools reach the state
// directory's hub, the one sandboxes and capsa kv and capsa mailbox use.
func TestHubTools(t *testing.T) {
	cs, dir := connect(t)
	structured := func(res *sdk.CallToolResult, v any) {
		t.Helper()
		b, _ := json.Marshal(res.StructuredContent)
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("the result %s: %v", b, err)
		}
	}
	res := call(t, cs, "kv_cas", map[string]any{"key": "jobs/1", "version": 0, "value": "todo"})
	var v kvVersion
	structured(res, &v)
	if res.IsError || v.Version == 0 {
		t.Fatalf("kv_cas(jobs/1, 0) = %q; want a version", text(res))
	}
	if res := call(t, cs, "kv_cas", map[string]any{"key": "jobs/1", "version": 0, "value": "again"}); !res.IsError || !strings.Contains(text(res), "version mismatch") {
		t.Errorf("kv_cas(jobs/1, 0) on an existing key = %q; want a version mismatch", text(res))
	}
	var e kvEntry
	structured(call(t, cs, "kv_get", map[string]any{"key": "jobs/1"}), &e)
	if e.Value != "todo" || e.Version != v.Version || e.Encoding != "utf-8" {
		t.Errorf("kv_get(jobs/1) = %+v; want todo at %d", e, v.Version)
	}
	call(t, cs, "kv_set", map[string]any{"key": "jobs/2", "value": "/w==", "encoding": "base64"})
	var l kvListResult
	structured(call(t, cs, "kv_list", map[string]any{"prefix": "jobs/"}), &l)
	if len(l.Entries) != 2 || l.Entries[1].Value != "/w==" || l.Entries[1].Encoding != "base64" {
		t.Errorf("kv_list(jobs/) = %+v; want two, the second in base64", l)
	}
	// What the CLI's hub holds is what the tools see.
	h, err := hub.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if got, err := h.As(hub.Grants{Host: true}).Get(context.Background(), "jobs/1"); err != nil || string(got.Value) != "todo" {
		t.Errorf("the state directory's hub has jobs/1 = %q, %v", got.Value, err)
	}

	var m message
	structured(call(t, cs, "mailbox_publish", map[string]any{"topic": "results", "payload": "first"}), &m)
	if m.Offset != 0 || m.Sender != "mcp" {
		t.Errorf("mailbox_publish = %+v; want offset 0 from mcp", m)
	}
	var r receiveResult
	structured(call(t, cs, "mailbox_receive", map[string]any{"topic": "results", "from": 0}), &r)
	if len(r.Messages) != 1 || r.Messages[0].Payload != "first" || r.NextOffset == nil || *r.NextOffset != 1 {
		t.Errorf("mailbox_receive(from 0) = %+v; want the first message and next offset 1", r)
	}
	// Waiting: a message published meanwhile by a sandbox (here, a
	// session with its identity) arrives with its sender.
	go func() {
		time.Sleep(300 * time.Millisecond)
		h.As(hub.Grants{Identity: "worker-1", Topics: []string{"results"}}).Publish(context.Background(), "results", []byte("second"))
	}()
	structured(call(t, cs, "mailbox_receive", map[string]any{"topic": "results", "wait_seconds": 20}), &r)
	if len(r.Messages) != 1 || r.Messages[0].Sender != "worker-1" || r.Messages[0].Payload != "second" {
		t.Errorf("mailbox_receive(new, wait) = %+v; want second from worker-1", r)
	}
	structured(call(t, cs, "mailbox_receive", map[string]any{"topic": "results", "wait_seconds": 1}), &r)
	if len(r.Messages) != 0 {
		t.Errorf("mailbox_receive(new, 1 s) with nothing new = %+v; want none", r)
	}
}

// TestCreateSecretFromEnv: a secret's value comes from the server's
// environment, from a variable the server was allowed to use, never its
// own token; the builder's checks apply to it.
func TestCreateSecretFromEnv(t *testing.T) {
	t.Setenv("CAPSA_MCP_TEST_KEY", "s3cr3t")
	t.Setenv(TokenEnv, "t0k3n")
	m, _ := managerAndDir(t)
	cs := connectTo(t, NewServer(Options{Manager: m, SecretEnv: []string{"CAPSA_MCP_TEST_KEY", "CAPSA_MCP_TEST_UNSET", TokenEnv}}))
	res := call(t, cs, "sandbox_create", map[string]any{"secrets": []map[string]any{{"name": "API_KEY", "env": "CAPSA_MCP_TEST_KEY", "hosts": []string{"api.example.com"}}}})
	if !res.IsError || !strings.Contains(text(res), "network") || strings.Contains(text(res), "s3cr3t") {
		t.Errorf("sandbox_create with a secret and no network = IsError %v, %q; want a tool error about the network, without the value", res.IsError, text(res))
	}
	res = call(t, cs, "sandbox_create", map[string]any{"network": "public-only", "secrets": []map[string]any{{"name": "API_KEY", "env": "CAPSA_MCP_TEST_UNSET", "hosts": []string{"api.example.com"}}}})
	if !res.IsError || !strings.Contains(text(res), "has no CAPSA_MCP_TEST_UNSET") {
		t.Errorf("sandbox_create with an allowed but unset variable = %q; want a tool error naming it", text(res))
	}
	res = call(t, cs, "sandbox_create", map[string]any{"network": "public-only", "secrets": []map[string]any{{"name": "T", "env": TokenEnv, "hosts": []string{"evil.example"}}}})
	if !res.IsError || !strings.Contains(text(res), "may not use") || strings.Contains(text(res), "t0k3n") {
		t.Errorf("sandbox_create with the server's token as a secret = %q; want it refused, even listed", text(res))
	}
}

// TestShareRoots: a tool shares only host directories under the server's
// share roots; a path outside them, or a link inside one that leads out,
// is refused naming the rule.
func TestShareRoots(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	os.Mkdir(filepath.Join(root, "work"), 0o755)
	os.Symlink(outside, filepath.Join(root, "escape"))
	m, _ := managerAndDir(t)
	cs := connectTo(t, NewServer(Options{Manager: m, ShareRoots: []string{root}}))
	for host, want := range map[string]string{
		outside:                                "not under a share root",
		filepath.Join(root, "escape"):          "not under a share root",
		root + "/../" + filepath.Base(outside): "not under a share root",
	} {
		res := call(t, cs, "sandbox_create", map[string]any{"shares": []map[string]any{{"host": host, "guest": "/mnt"}}})
		if !res.IsError || !strings.Contains(text(res), want) {
			t.Errorf("sharing %s = %q; want a refusal saying %q", host, text(res), want)
		}
	}
	// Inside the root the share passes (the tool would then start a
	// sandbox, which this unit test cannot).
	tl := &tools{shareRoots: []string{mustReal(t, root)}}
	if err := tl.mayShare(filepath.Join(root, "work")); err != nil {
		t.Errorf("mayShare(a directory under the root) = %v", err)
	}
	if err := tl.mayShare(root); err != nil {
		t.Errorf("mayShare(the root) = %v", err)
	}
}

func mustReal(t *testing.T, p string) string {
	t.Helper()
	r, err := filepath.EvalSymlinks(p)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestSandboxNetwork: sandbox_network replaces the policy of a sandbox
// made with a network (here one that ended: its record, for a resume),
// refuses one made without, and a mode it does not know, naming what.
func TestSandboxNetwork(t *testing.T) {
	cs, dir := connect(t)
	base := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"sleep", "1"}}}
	withNet := base
	withNet.Network = &sandbox.NetworkSpec{Policy: netstack.PublicOnly()}
	supervisortest.Exited(t, dir, "net", withNet, 0, "done")
	supervisortest.Exited(t, dir, "nonet", base, 0, "done")
	res := call(t, cs, "sandbox_network", map[string]any{"name": "net", "network": "deny-all", "allow": []string{"example.com:443"}})
	if res.IsError || !strings.Contains(text(res), "deny-all allow=example.com:443") {
		t.Errorf("sandbox_network(net) = IsError %v, %q; want the new policy", res.IsError, text(res))
	}
	m, err := supervisor.OpenManager(dir)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := m.Get("net"); err != nil || r.Spec.Network.Policy.String() != "deny-all allow=example.com:443" {
		t.Errorf("the record after sandbox_network: %v, %v", r.Spec.Network.Policy, err)
	}
	for args, want := range map[string]map[string]any{
		"NAT":           {"name": "nonet", "network": "public-only"},
		"wide-open":     {"name": "net", "network": "wide-open"},
		"network":       {"name": "net"},
		"cannot be rem": {"name": "net", "network": "none"},
	} {
		if res := call(t, cs, "sandbox_network", want); !res.IsError || !strings.Contains(text(res), args) {
			t.Errorf("sandbox_network(%v) = IsError %v, %q; want a tool error naming %q", want, res.IsError, text(res), args)
		}
	}
}

// TestEgressProxy: sandbox_create and sandbox_network take a SOCKS5 proxy
// whose password comes from a variable the server allows; it must be
// public unless the server allows private ones, and needs a network.
// Refusals name what is wrong and never carry the password.
func TestEgressProxy(t *testing.T) {
	t.Setenv("CAPSA_MCP_TEST_PW", "pr0xy-pw")
	m, dir := managerAndDir(t)
	public := connectTo(t, NewServer(Options{Manager: m, SecretEnv: []string{"CAPSA_MCP_TEST_PW"}}))
	for want, args := range map[string]map[string]any{
		"needs a network":        {"egress_proxy": map[string]any{"address": "192.0.2.1:1080"}},
		"--private-egress-proxy": {"network": "public-only", "egress_proxy": map[string]any{"address": "127.0.0.1:1080"}},
		"may not use its environment variable HOME": {"network": "public-only",
			"egress_proxy": map[string]any{"address": "192.0.2.1:1080", "username": "u", "password_env": "HOME"}},
		"want HOST:PORT": {"network": "public-only", "egress_proxy": map[string]any{"address": "proxy.example"}},
	} {
		res := call(t, public, "sandbox_create", args)
		if !res.IsError || !strings.Contains(text(res), want) || strings.Contains(text(res), "pr0xy-pw") {
			t.Errorf("sandbox_create(%v) = IsError %v, %q; want a tool error naming %q", args, res.IsError, text(res), want)
		}
	}
	withNet := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"true"}},
		Network: &sandbox.NetworkSpec{Policy: netstack.PublicOnly()}}
	supervisortest.Exited(t, dir, "net", withNet, 0, "done")
	private := connectTo(t, NewServer(Options{Manager: m, SecretEnv: []string{"CAPSA_MCP_TEST_PW"}, PrivateEgressProxy: true}))
	proxy := map[string]any{"address": "127.0.0.1:1080", "username": "agent", "password_env": "CAPSA_MCP_TEST_PW"}
	res := call(t, private, "sandbox_network", map[string]any{"name": "net", "network": "public-only", "egress_proxy": proxy})
	if res.IsError || !strings.Contains(text(res), "127.0.0.1:1080") || strings.Contains(text(res), "pr0xy-pw") {
		t.Errorf("sandbox_network with a proxy = IsError %v, %q; want the proxy's address, no password", res.IsError, text(res))
	}
	if r, err := m.Get("net"); err != nil || r.Spec.Network.EgressProxy == nil || r.Spec.Network.EgressProxy.Username != "agent" {
		t.Errorf("the record after sandbox_network: %+v, %v; want the proxy and its username", r.Spec.Network, err)
	}
	if res := call(t, public, "sandbox_network", map[string]any{"name": "net", "network": "public-only", "egress_proxy": proxy}); !res.IsError {
		t.Errorf("a loopback proxy through a server that allows none: %q; want a tool error", text(res))
	}
	res = call(t, private, "sandbox_network", map[string]any{"name": "net", "network": "public-only", "egress_proxy": map[string]any{"address": "none"}})
	if res.IsError {
		t.Fatalf("sandbox_network taking the proxy away: %q", text(res))
	}
	if r, _ := m.Get("net"); r.Spec.Network.EgressProxy != nil {
		t.Errorf("the record after taking the proxy away: %+v", r.Spec.Network.EgressProxy)
	}
}
