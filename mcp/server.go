// Package mcp serves capsa's sandboxes to LLM agents as tools of the Model
// Context Protocol, on the official Go SDK (github.com/modelcontextprotocol/go-sdk).
// Its starting point is NewServer, an MCP server with every tool; `capsa
// mcp` runs it over stdio, or over streamable HTTP on a loopback address
// (ListenLoopback, HTTPHandler).
//
// The sandboxes an agent creates are ordinary detached sandboxes in the
// state directory (package supervisor starts them as `capsa run -d` does),
// so `capsa ps`, `logs` and `rm` show and manage what the agent did. Every
// tool's failure, a bad argument or a panic included, comes back as the
// tool's error result, never as the server's end.
//
// The tools come in groups, each added by one function (registerSandboxTools,
// registerExecTools, registerFileTools, registerSnapshotTools,
// registerHubTools): a new
// capability is one more such function called from NewServer.
package mcp

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"runtime/debug"
	"sync"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/internal/bearer"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// Options configure a server.
type Options struct {
	// Manager owns the state directory whose detached sandboxes the
	// tools create and reach.
	Manager *supervisor.Manager
	// ShareRoots are the host directories under which a tool may share a
	// directory into a sandbox (none: no host directory is shared): a
	// token holder gets no more of the user's files than these.
	ShareRoots []string
	// SecretEnv names the server's environment variables a tool may use
	// as a secret's value (none: no secrets); CAPSA_MCP_TOKEN never.
	SecretEnv []string
	// PrivateEgressProxy lets a sandbox's egress proxy be on a loopback
	// or private address (without it, one must be public, so that an
	// agent cannot aim sandboxes' traffic at the host's services).
	PrivateEgressProxy bool
	// Log receives a line per tool call (nil: none).
	Log *slog.Logger
	// Version is capsa's, told to clients.
	Version string
}

// TokenEnv is the environment variable that may hold the HTTP server's
// bearer token: never a secret's value, whatever SecretEnv says.
const TokenEnv = "CAPSA_MCP_TOKEN"

// tools is what every tool handler works with.
type tools struct {
	m          *supervisor.Manager
	log        *slog.Logger
	shareRoots []string // cleaned, symlinks resolved
	secretEnv  map[string]bool
	// privateProxy is Options.PrivateEgressProxy.
	privateProxy bool
}

// instructions tell the agent how the tools go together.
const instructions = `capsa runs untrusted code in hardware-isolated microVMs (sandboxes).
Create a sandbox with sandbox_create (it runs until sandbox_destroy or its TTL), run commands in it with sandbox_exec, move files with file_write, file_read and file_list, and destroy it when done. sandbox_list shows the sandboxes; snapshot_create, snapshot_restore and sandbox_fork save and copy a running one. Sandboxes working in parallel coordinate through a mailbox and a key-value store the host keeps: grant them topics and key prefixes at sandbox_create (mailbox, kv), they use "capsa mailbox" and "capsa kv" inside, and you reach the same with mailbox_publish, mailbox_receive, kv_get, kv_set, kv_cas and kv_list. The sandboxes are ordinary detached capsa sandboxes: the person running capsa sees them with capsa ps.`

// NewServer returns an MCP server with capsa's tools.
func NewServer(o Options) *sdk.Server {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	version := o.Version
	if version == "" {
		version = "dev"
	}
	s := sdk.NewServer(&sdk.Implementation{Name: "capsa", Title: "capsa sandboxes", Version: version},
		&sdk.ServerOptions{Instructions: instructions, Logger: slog.New(atLeast{log.Handler(), slog.LevelWarn})})
	t := &tools{m: o.Manager, log: log, secretEnv: map[string]bool{}, privateProxy: o.PrivateEgressProxy}
	for _, r := range o.ShareRoots {
		if real, err := filepath.EvalSymlinks(r); err == nil {
			t.shareRoots = append(t.shareRoots, filepath.Clean(real))
		}
	}
	for _, e := range o.SecretEnv {
		if e != TokenEnv {
			t.secretEnv[e] = true
		}
	}
	registerSandboxTools(s, t)
	registerExecTools(s, t)
	registerFileTools(s, t)
	registerSnapshotTools(s, t)
	registerHubTools(s, t)
	return s
}

// addTool adds tool with handler h. The SDK checks the arguments against
// the schema it infers from In (its fields' json and jsonschema tags) and
// puts Out in the result; an error from h, or a panic, becomes the tool's
// error result, prefixed with the tool's name.
func addTool[In, Out any](s *sdk.Server, t *tools, tool *sdk.Tool, h func(context.Context, In) (Out, error)) {
	sdk.AddTool(s, tool, func(ctx context.Context, req *sdk.CallToolRequest, in In) (_ *sdk.CallToolResult, out Out, err error) {
		if tok := req.Params.GetProgressToken(); tok != nil && req.Session != nil {
			ctx = context.WithValue(ctx, progressKey{}, &progressTo{session: req.Session, token: tok})
		}
		start := time.Now()
		defer func() {
			if p := recover(); p != nil {
				t.log.Error("mcp: tool panicked", "tool", tool.Name, "panic", p, "stack", string(debug.Stack()))
				var zero Out
				out, err = zero, fmt.Errorf("%s: internal error: %v", tool.Name, p)
			}
			if err != nil {
				t.log.Info("mcp: tool call", "tool", tool.Name, "took", time.Since(start), "err", err)
			} else {
				t.log.Info("mcp: tool call", "tool", tool.Name, "took", time.Since(start))
			}
		}()
		out, err = h(ctx, in)
		if err != nil {
			err = fmt.Errorf("%s: %w", tool.Name, err)
		}
		return nil, out, err
	})
}

// progressKey is the context key of a tool call's progressTo: the call
// asked for progress notifications (its progress token).
type progressKey struct{}

// progressTo sends a tool call's progress notifications.
type progressTo struct {
	session *sdk.ServerSession
	token   any
	mu      sync.Mutex
	n       float64 // the notifications sent: MCP's progress must grow with each
}

// progress is the function that sends long work's progress (a snapshot, a
// fork) to the tool call of ctx as MCP progress notifications, each with
// the step in words; nil where the call asked for none.
func progress(ctx context.Context) func(sandbox.Progress) {
	p, ok := ctx.Value(progressKey{}).(*progressTo)
	if !ok {
		return nil
	}
	return func(sp sandbox.Progress) {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.n++
		// A client gone or slow loses notifications, not the work.
		nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		p.session.NotifyProgress(nctx, &sdk.ProgressNotificationParams{ProgressToken: p.token, Progress: p.n, Message: sp.String()})
	}
}

// atLeast passes on records of level min and up: the SDK's own log says
// at level info what every session does.
type atLeast struct {
	slog.Handler
	min slog.Level
}

func (h atLeast) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.min && h.Handler.Enabled(ctx, l)
}

func (h atLeast) WithAttrs(as []slog.Attr) slog.Handler {
	return atLeast{h.Handler.WithAttrs(as), h.min}
}

func (h atLeast) WithGroup(name string) slog.Handler {
	return atLeast{h.Handler.WithGroup(name), h.min}
}

// boolPtr is for the tool annotations' optional hints.
func boolPtr(b bool) *bool { return &b }

// HTTPPath is where HTTPHandler serves MCP.
const HTTPPath = "/mcp"

// HTTPHandler serves s over streamable HTTP at HTTPPath, to requests
// bearing token (Authorization: Bearer TOKEN): a loopback port is open to
// every local user, the state directory only to this one. The SDK refuses
// requests whose Host is not a loopback name (DNS rebinding), and
// cross-origin browser requests are refused too.
func HTTPHandler(s *sdk.Server, token string, log *slog.Logger) http.Handler {
	h := sdk.NewStreamableHTTPHandler(func(*http.Request) *sdk.Server { return s }, &sdk.StreamableHTTPOptions{Logger: log})
	mux := http.NewServeMux()
	mux.Handle(HTTPPath, http.NewCrossOriginProtection().Handler(h))
	return bearer.Guard(mux, token, "capsa mcp", "capsa mcp: want the bearer token capsa mcp printed (or was given in CAPSA_MCP_TOKEN)")
}

// ListenLoopback listens for TCP on addr (HOST:PORT), refusing any host
// that is not a loopback address or "localhost": the MCP server starts
// sandboxes as this user, and is for this machine only.
func ListenLoopback(addr string) (net.Listener, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("mcp: listen %q: %w (want HOST:PORT, e.g. 127.0.0.1:8765)", addr, err)
	}
	if host != "localhost" {
		ip := net.ParseIP(host)
		if ip == nil || !ip.IsLoopback() {
			return nil, fmt.Errorf("mcp: listen %q: %q is not a loopback address (want 127.0.0.1, ::1 or localhost)", addr, host)
		}
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("mcp: listen %s: %w", addr, err)
	}
	// "localhost" is resolved by Listen: check what it bound.
	if ta, ok := l.Addr().(*net.TCPAddr); !ok || !ta.IP.IsLoopback() {
		l.Close()
		return nil, fmt.Errorf("mcp: listen %s: bound %v, not a loopback address", addr, l.Addr())
	}
	return l, nil
}
