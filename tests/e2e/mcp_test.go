package e2e

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// mcpClientScript drives `capsa mcp` with the official TypeScript SDK's
// client (testdata/mcp-client.mjs says how).
//
//go:embed testdata/mcp-client.mjs
var mcpClientScript []byte

// mcpLine is one line the client script prints.
type mcpLine struct {
	Server *struct {
		Name string `json:"name"`
	} `json:"server"`
	Tools   []string `json:"tools"`
	Tool    string   `json:"tool"`
	IsError bool     `json:"isError"`
	Content []struct {
		Text string `json:"text"`
	} `json:"content"`
	Structured json.RawMessage `json:"structuredContent"`
	Progress   []string        `json:"progress"` // the call's progress notifications' messages
}

func (l mcpLine) text() string {
	var b strings.Builder
	for _, c := range l.Content {
		b.WriteString(c.Text)
	}
	return b.String()
}

// mcpCall is one step of the client script: a tool call, or tools/list.
type mcpCall struct {
	Tool string         `json:"tool,omitempty"`
	Args map[string]any `json:"args,omitempty"`
	List bool           `json:"list,omitempty"`
	// Progress: the call asks for progress notifications.
	Progress bool `json:"progress,omitempty"`
}

// nodeScript writes a client script (name, its text) beside a link to the
// mcp-client bundle's node_modules (scripts/mcp-client-bundle.sh), where
// Node looks for the SDKs, and returns the bundle's Node and the script's
// path.
func nodeScript(tb testing.TB, name string, text []byte) (node, script string) {
	tb.Helper()
	node = artifact(tb, "mcp-client/node")
	dir := tb.TempDir()
	script = filepath.Join(dir, name)
	if err := os.WriteFile(script, text, 0o644); err != nil {
		tb.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(filepath.Dir(node), "node_modules"), filepath.Join(dir, "node_modules")); err != nil {
		tb.Fatal(err)
	}
	return node, script
}

// mcpClient returns a function that runs the client script (Node 22 and
// the SDK from the mcp-client bundle, scripts/mcp-client-bundle.sh) with
// the CLI's state in stateDir, against the server that args name: stdio
// CAPSA or http URL TOKEN. It returns the script's lines, one per call
// after the first (the server's name), and its exit error.
func mcpClient(t *testing.T, stateDir string) func(timeout time.Duration, calls []mcpCall, args ...string) ([]mcpLine, error) {
	node, script := nodeScript(t, "mcp-client.mjs", mcpClientScript)
	return func(timeout time.Duration, calls []mcpCall, args ...string) ([]mcpLine, error) {
		t.Helper()
		js, err := json.Marshal(calls)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, node, append([]string{script, args[0], string(js)}, args[1:]...)...)
		cmd.Env = append(os.Environ(), "CAPSA_STATE="+stateDir, "CAPSA_DEBUG=1")
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		start := time.Now()
		err = cmd.Run()
		t.Logf("mcp-client %s %s: %v after %v\nstdout:\n%s\nstderr:\n%s", args[0], js, err, time.Since(start).Round(time.Millisecond), out.String(), errb.String())
		if ctx.Err() != nil {
			t.Fatalf("mcp-client: timed out after %v", timeout)
		}
		var lines []mcpLine
		sc := bufio.NewScanner(&out)
		sc.Buffer(nil, 16<<20)
		for sc.Scan() {
			var l mcpLine
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				t.Fatalf("mcp-client printed %q: %v", sc.Text(), err)
			}
			lines = append(lines, l)
		}
		if err == nil {
			if len(lines) != len(calls)+1 || lines[0].Server == nil || lines[0].Server.Name != "capsa" {
				t.Fatalf("mcp-client printed %d lines, the first %+v; want the server (capsa) and %d results", len(lines), lines, len(calls))
			}
			lines = lines[1:]
		}
		return lines, err
	}
}

// structured decodes a tool result's structured content into v, failing
// the test if the call was an error.
func structured(t *testing.T, l mcpLine, v any) {
	t.Helper()
	if l.IsError {
		t.Fatalf("%s = tool error %q; want a result", l.Tool, l.text())
	}
	if err := json.Unmarshal(l.Structured, v); err != nil {
		t.Fatalf("%s's structured content %s: %v", l.Tool, l.Structured, err)
	}
}

// TestMCP: `capsa mcp`, driven over stdio by the official TypeScript SDK's
// client on Node 22, lists its tools, creates a sandbox, runs `echo hi` in
// it (and a command whose output is capped, one that times out), writes,
// lists and reads files; the sandbox is an ordinary detached one that
// `capsa ps` and `capsa exec` see; a missing sandbox is a tool error; the
// same server over streamable HTTP on loopback serves a client with its
// token and refuses one without, and suspends the sandbox to disk and
// resumes it with its files; a snapshot sends progress notifications to
// the client that asks; the sandbox is destroyed.
func TestMCP(t *testing.T) {
	bin := artifact(t, "capsa")
	dir, cli := detachedState(t)
	client := mcpClient(t, dir)
	stdio := []string{"stdio", bin, "mcp"}

	note := "héllo from an agent\n"
	lines, err := client(5*time.Minute, []mcpCall{
		{List: true},
		{Tool: "sandbox_create", Args: map[string]any{"name": "agent", "memory_mib": 256, "ttl_seconds": 900, "kv": []string{"tasks/"}, "mailbox": []string{"results"}}},
		{Tool: "sandbox_exec", Args: map[string]any{"name": "agent", "command": []string{"echo", "hi"}}},
		{Tool: "sandbox_exec", Args: map[string]any{"name": "agent", "command": []string{"dd", "if=/dev/zero", "bs=1000", "count=300"}, "max_output_bytes": 1000}},
		{Tool: "sandbox_exec", Args: map[string]any{"name": "agent", "command": []string{"sleep", "60"}, "timeout_seconds": 1}},
		{Tool: "file_write", Args: map[string]any{"name": "agent", "path": "/tmp/mcp/note.txt", "content": note, "make_parents": true}},
		{Tool: "file_write", Args: map[string]any{"name": "agent", "path": "/tmp/mcp/bin", "content": "AP/+", "encoding": "base64", "mode": "600"}},
		{Tool: "file_read", Args: map[string]any{"name": "agent", "path": "/tmp/mcp/note.txt"}},
		{Tool: "file_read", Args: map[string]any{"name": "agent", "path": "/tmp/mcp/bin"}},
		{Tool: "file_list", Args: map[string]any{"name": "agent", "path": "/tmp/mcp"}},
		{Tool: "sandbox_exec", Args: map[string]any{"name": "nosuch", "shell": "echo hi"}},
		// The agent hands the sandbox a task through the key-value
		// store and gets its answer through the mailbox.
		{Tool: "kv_set", Args: map[string]any{"key": "tasks/1", "value": "say done"}},
		{Tool: "sandbox_exec", Args: map[string]any{"name": "agent", "shell": "capsa mailbox publish results \"done: $(capsa kv get tasks/1)\""}},
		{Tool: "mailbox_receive", Args: map[string]any{"topic": "results", "from": 0}},
		// The agent's sandbox was made without a network: none to change.
		{Tool: "sandbox_network", Args: map[string]any{"name": "agent", "network": "allow-all"}},
		// Long work tells how far it has come, where the client asks.
		{Tool: "snapshot_create", Args: map[string]any{"name": "agent", "snapshot": "mcpsnap"}, Progress: true},
	}, stdio...)
	if err != nil {
		t.Fatalf("mcp-client over stdio: %v", err)
	}
	want := []string{"file_list", "file_read", "file_write", "kv_cas", "kv_get", "kv_list", "kv_set",
		"mailbox_publish", "mailbox_receive", "sandbox_create", "sandbox_destroy", "sandbox_exec",
		"sandbox_fork", "sandbox_list", "sandbox_network", "sandbox_resume", "sandbox_suspend", "snapshot_create", "snapshot_restore"}
	if got := slices.Sorted(slices.Values(lines[0].Tools)); !slices.Equal(got, want) {
		t.Errorf("tools/list = %v, want %v", got, want)
	}
	var created struct{ Name, State string }
	if structured(t, lines[1], &created); created.Name != "agent" || created.State != "running" {
		t.Errorf("sandbox_create = %+v, want agent, running", created)
	}
	type execResult struct {
		ExitCode        int    `json:"exit_code"`
		TimedOut        bool   `json:"timed_out"`
		Stdout          string `json:"stdout"`
		Stderr          string `json:"stderr"`
		StdoutTruncated bool   `json:"stdout_truncated"`
	}
	var echo, capped, slow execResult
	if structured(t, lines[2], &echo); echo.ExitCode != 0 || echo.Stdout != "hi\n" || echo.StdoutTruncated || echo.TimedOut {
		t.Errorf("sandbox_exec echo hi = %+v, want exit 0 and hi", echo)
	}
	if structured(t, lines[3], &capped); capped.ExitCode != 0 || len(capped.Stdout) != 1000 || !capped.StdoutTruncated {
		t.Errorf("sandbox_exec dd of 300000 bytes with max_output_bytes 1000 = exit %d, %d bytes, truncated %v; want 0, 1000, true",
			capped.ExitCode, len(capped.Stdout), capped.StdoutTruncated)
	}
	if structured(t, lines[4], &slow); !slow.TimedOut || slow.ExitCode == 0 {
		t.Errorf("sandbox_exec sleep 60 with timeout_seconds 1 = %+v, want timed out", slow)
	}
	for _, l := range lines[5:7] {
		if l.IsError {
			t.Errorf("%s = tool error %q", l.Tool, l.text())
		}
	}
	type readResult struct {
		Content, Encoding string
		Size              int64
	}
	var text, binary readResult
	if structured(t, lines[7], &text); text.Content != note || text.Encoding != "utf-8" || text.Size != int64(len(note)) {
		t.Errorf("file_read note.txt = %+v, want %q as utf-8", text, note)
	}
	if structured(t, lines[8], &binary); binary.Content != "AP/+" || binary.Encoding != "base64" {
		t.Errorf("file_read bin = %+v, want AP/+ as base64", binary)
	}
	var listed struct {
		Entries []struct{ Name, Type, Mode string }
	}
	structured(t, lines[9], &listed)
	if len(listed.Entries) != 2 || listed.Entries[0].Name != "bin" || listed.Entries[0].Mode != "-rw-------" ||
		listed.Entries[1].Name != "note.txt" || listed.Entries[1].Type != "file" {
		t.Errorf("file_list /tmp/mcp = %+v, want bin (-rw-------) and note.txt, files", listed.Entries)
	}
	if l := lines[10]; !l.IsError || !strings.Contains(l.text(), "nosuch") {
		t.Errorf("sandbox_exec in nosuch = IsError %v, %q; want a tool error naming it", l.IsError, l.text())
	}
	var answer execResult
	if structured(t, lines[12], &answer); answer.ExitCode != 0 {
		t.Errorf("the sandbox reading its task and publishing = %+v, want exit 0", answer)
	}
	var received struct {
		Messages []struct{ Sender, Payload string }
	}
	if structured(t, lines[13], &received); len(received.Messages) != 1 || received.Messages[0].Sender != "agent" || received.Messages[0].Payload != "done: say done" {
		t.Errorf("mailbox_receive results from 0 = %+v, want \"done: say done\" from agent", received.Messages)
	}
	if l := lines[14]; !l.IsError || !strings.Contains(l.text(), "no NAT") {
		t.Errorf("sandbox_network on a sandbox without a network = %+v, want a tool error saying it has no NAT", l)
	}
	var snapped struct{ Snapshot string }
	if structured(t, lines[15], &snapped); snapped.Snapshot != "mcpsnap" {
		t.Errorf("snapshot_create = %+v, want mcpsnap", snapped)
	}
	if p := lines[15].Progress; len(p) < 2 || p[0] != "listing the guest's files" || p[1] != "writing memory: 0.0 of 256.0 MiB" {
		t.Errorf("snapshot_create's progress notifications = %q; want the inventory's step, then the memory's", p)
	}

	// An ordinary detached sandbox: the person sees it and reaches it.
	if ps := psAll(t, cli); ps["agent"].State != "running" {
		t.Errorf("capsa ps -a after sandbox_create = %+v, want agent running", ps)
	}
	if r := cli(time.Minute, "exec", "agent", "--", "cat", "/tmp/mcp/note.txt"); r.code != 0 || r.stdout != note {
		t.Errorf("capsa exec agent -- cat /tmp/mcp/note.txt = exit %d, %q; want 0, %q", r.code, r.stdout, note)
	}

	// Streamable HTTP on loopback, from another server process.
	const token = "e2e-token"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := exec.CommandContext(ctx, bin, "mcp", "--listen", "127.0.0.1:0")
	srv.Env = append(os.Environ(), "CAPSA_STATE="+dir, "CAPSA_MCP_TOKEN="+token)
	srvErr, err := srv.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	urls, logged := make(chan string, 1), make(chan struct{})
	defer func() {
		cancel()
		<-logged // its stderr ends as it does
		srv.Wait()
	}()
	go func() {
		defer close(logged)
		sc := bufio.NewScanner(srvErr)
		for sc.Scan() {
			t.Logf("capsa mcp --listen: %s", sc.Text())
			if u, ok := strings.CutPrefix(sc.Text(), "capsa mcp: serving "); ok {
				urls <- strings.Fields(u)[0]
			}
		}
	}()
	var url string
	select {
	case url = <-urls:
	case <-time.After(time.Minute):
		t.Fatal("capsa mcp --listen did not say where it serves within a minute")
	}
	if _, err := client(2*time.Minute, []mcpCall{{List: true}}, "http", url, "wrong"); err == nil {
		t.Errorf("mcp-client over HTTP with a wrong token = nil error; want it refused")
	}
	lines, err = client(3*time.Minute, []mcpCall{
		{Tool: "sandbox_list", Args: map[string]any{}},
		{Tool: "sandbox_exec", Args: map[string]any{"name": "agent", "shell": "cat /tmp/mcp/note.txt; echo err >&2; exit 3"}},
		// Suspended to disk and back, its /tmp (the guest's memory) kept.
		{Tool: "sandbox_suspend", Args: map[string]any{"name": "agent"}},
		{Tool: "sandbox_list", Args: map[string]any{}},
		{Tool: "sandbox_resume", Args: map[string]any{"name": "agent"}},
		{Tool: "file_read", Args: map[string]any{"name": "agent", "path": "/tmp/mcp/note.txt"}},
	}, "http", url, token)
	if err != nil {
		t.Fatalf("mcp-client over HTTP: %v", err)
	}
	var list struct {
		Sandboxes []struct{ Name, State string }
	}
	if structured(t, lines[0], &list); len(list.Sandboxes) != 1 || list.Sandboxes[0].Name != "agent" || list.Sandboxes[0].State != "running" {
		t.Errorf("sandbox_list over HTTP = %+v, want agent running", list.Sandboxes)
	}
	var shell execResult
	if structured(t, lines[1], &shell); shell.ExitCode != 3 || shell.Stdout != note || shell.Stderr != "err\n" {
		t.Errorf("sandbox_exec over HTTP = %+v, want exit 3, the note, err", shell)
	}
	var state struct{ Name, State string }
	if structured(t, lines[2], &state); state.State != "suspended" {
		t.Errorf("sandbox_suspend = %+v, want suspended", state)
	}
	if structured(t, lines[3], &list); len(list.Sandboxes) != 1 || list.Sandboxes[0].State != "suspended" {
		t.Errorf("sandbox_list after sandbox_suspend = %+v, want agent suspended", list.Sandboxes)
	}
	if structured(t, lines[4], &state); state.State != "running" {
		t.Errorf("sandbox_resume = %+v, want running", state)
	}
	var again struct{ Content string }
	if structured(t, lines[5], &again); again.Content != note {
		t.Errorf("file_read after suspend and resume = %q, want %q", again.Content, note)
	}

	lines, err = client(3*time.Minute, []mcpCall{
		{Tool: "sandbox_destroy", Args: map[string]any{"name": "agent"}},
		{Tool: "sandbox_list", Args: map[string]any{"all": true}},
	}, stdio...)
	if err != nil {
		t.Fatalf("mcp-client over stdio: %v", err)
	}
	if lines[0].IsError {
		t.Errorf("sandbox_destroy = tool error %q", lines[0].text())
	}
	if structured(t, lines[1], &list); len(list.Sandboxes) != 0 {
		t.Errorf("sandbox_list after sandbox_destroy = %+v, want none", list.Sandboxes)
	}
	if _, ok := psAll(t, cli)["agent"]; ok {
		t.Errorf("capsa ps -a after sandbox_destroy lists agent; want it gone")
	}
}
