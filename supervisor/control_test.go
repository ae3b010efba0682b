package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestControlTableMatchesServer: every operation of the table is served
// under the route its clients send, each name once; a request the table
// does not have (a client that disagrees with the server) matches nothing.
func TestControlTableMatchesServer(t *testing.T) {
	mux := (&control{}).mux(slog.New(slog.DiscardHandler))
	seen := map[string]bool{}
	for _, op := range controlOps {
		if seen[op.opName()] {
			t.Errorf("operation %s twice in the table", op.opName())
		}
		seen[op.opName()] = true
		req, err := op.clientRequest(context.Background())
		if err != nil {
			t.Fatalf("%s: %v", op.opName(), err)
		}
		if _, pattern := mux.Handler(req); pattern != op.pattern() {
			t.Errorf("%s: the client's %s %s reaches the server's %q; want %q", op.opName(), req.Method, req.URL.Path, pattern, op.pattern())
		}
	}
	for _, bad := range []struct{ method, path string }{{http.MethodGet, "/v1/stop"}, {http.MethodPost, "/v1/nosuch"}, {http.MethodPost, "/v2/pause"}} {
		req := httptest.NewRequest(bad.method, "http://supervisor"+bad.path, nil)
		if _, pattern := mux.Handler(req); pattern != "" {
			t.Errorf("%s %s reaches %q; want no route", bad.method, bad.path, pattern)
		}
	}
}

// TestControlStopAndSnapshotRequests: the server checks what it is given
// before it acts: a negative stop timeout and a relative snapshot
// directory are refused (400, naming the fault); a good stop reaches the
// supervisor's stop channel, once, however often it is asked.
func TestControlStopAndSnapshotRequests(t *testing.T) {
	c := &control{stopc: make(chan stopRequest, 1)}
	path := filepath.Join(t.TempDir(), ControlSocket)
	srv, err := c.serve(path, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	hc := controlClient(path)
	ctx := context.Background()
	if _, err := opStop.call(ctx, hc, stopBody{Timeout: -1}); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "negative timeout") {
		t.Errorf("stop with a negative timeout = %v; want 400, negative timeout", err)
	}
	if _, err := opSnapshot.call(ctx, hc, snapshotBody{Dir: "rel/dir"}); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "absolute") {
		t.Errorf("snapshot to a relative directory = %v; want 400 asking for an absolute one", err)
	}
	for range 2 {
		if _, err := opStop.call(ctx, hc, stopBody{Timeout: time.Second, Kill: true}); err != nil {
			t.Fatalf("stop = %v", err)
		}
	}
	if got := <-c.stopc; got.timeout != time.Second || !got.kill {
		t.Errorf("the supervisor got %+v; want a 1 s timeout and kill", got)
	}
	if len(c.stopc) != 0 {
		t.Error("a second stop request queued behind the first")
	}
}

// TestControlOpRoundTrip: an operation's request and reply cross as
// typed values; a malformed or oversized request is refused with 400 and
// the operation's name, a handler's failure reaches the client with its
// status and message (wrapping the sentinel its code names), and a server unreachable is a transport error.
func TestControlOpRoundTrip(t *testing.T) {
	type reply struct {
		Echo string `json:"echo"`
	}
	op := controlOp[snapshotBody, reply]{"echo", http.MethodPost, http.StatusOK}
	mux := http.NewServeMux()
	op.register(mux, func(_ context.Context, req snapshotBody) (reply, error) {
		switch req.Dir {
		case "conflict":
			return reply{}, errors.New("cannot now")
		case "bad":
			return reply{}, badRequest("bad thing %d", 7)
		case "suspending":
			return reply{}, fmt.Errorf("wrapped: %w", &controlError{http.StatusConflict, ErrBeingSuspended})
		}
		return reply{Echo: req.Dir}, nil
	})
	path := filepath.Join(t.TempDir(), "echo.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(l)
	hc := controlClient(path)
	ctx := context.Background()
	if got, err := op.call(ctx, hc, snapshotBody{Dir: "hello"}); err != nil || got.Echo != "hello" {
		t.Errorf("call = %+v, %v; want the echo", got, err)
	}
	if _, err := op.call(ctx, hc, snapshotBody{Dir: "conflict"}); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "cannot now") {
		t.Errorf("a handler's failure = %v; want 409 and its message", err)
	}
	if _, err := op.call(ctx, hc, snapshotBody{Dir: "bad"}); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "bad thing 7") {
		t.Errorf("a refused request = %v; want 400 and its message", err)
	}
	// A known sentinel crosses the socket: the client's error wraps it.
	if _, err := op.call(ctx, hc, snapshotBody{Dir: "suspending"}); !errors.Is(err, ErrBeingSuspended) || !strings.Contains(err.Error(), "409") {
		t.Errorf("a refusal for a suspension under way = %v; want 409 wrapping ErrBeingSuspended", err)
	}
	if _, err := op.call(ctx, hc, snapshotBody{Dir: "conflict"}); errors.Is(err, ErrBeingSuspended) {
		t.Errorf("another refusal = %v wraps ErrBeingSuspended", err)
	}
	for _, body := range []string{"{not json", `{"dir":"` + strings.Repeat("x", maxControlRequest) + `"}`} {
		resp, err := hc.Post("http://supervisor/v1/echo", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("a request of %d bytes, malformed or oversized: %s; want 400", len(body), resp.Status)
		}
	}
	// No body at all (a client from before the operation took one) is
	// the zero request.
	if resp, err := hc.Post("http://supervisor/v1/echo", "application/json", nil); err != nil {
		t.Fatal(err)
	} else if resp.Body.Close(); resp.StatusCode != http.StatusOK {
		t.Errorf("a request without a body: %s; want 200, the zero request", resp.Status)
	}
	// The header rules' refusals cross it too.
	for _, sentinel := range []error{sandbox.ErrNoInterception, sandbox.ErrOutsideCA} {
		found := false
		for _, e := range controlErrorCodes {
			found = found || e == sentinel
		}
		if !found {
			t.Errorf("%v has no code across the socket", sentinel)
		}
	}
	srv.Close()
	var te *transportError
	if _, err := op.call(ctx, hc, snapshotBody{Dir: "hello"}); !errors.As(err, &te) {
		t.Errorf("a call to a closed server = %v; want a transport error", err)
	}
}

// TestControlLendsFiles: files lent with a request reach its handler, as
// descriptors of the same files, and only that request's; a connection
// lends at most maxLentFiles; the snapshot operation refuses files lent
// without a parent, and a lent parent that is not a snapshot chain, with
// 400 before it touches the sandbox.
func TestControlLendsFiles(t *testing.T) {
	type reply struct {
		Got []string `json:"got"`
	}
	op := controlOp[noBody, reply]{"lent", http.MethodPost, http.StatusOK}
	mux := http.NewServeMux()
	op.register(mux, func(ctx context.Context, _ noBody) (reply, error) {
		var r reply
		for _, f := range lentFiles(ctx) {
			b, err := io.ReadAll(io.NewSectionReader(f, 0, 64))
			if err != nil {
				r.Got = append(r.Got, "error: "+err.Error())
			} else {
				r.Got = append(r.Got, string(b))
			}
			f.Close()
		}
		return r, nil
	})
	dir := t.TempDir()
	path := filepath.Join(dir, "lend.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux, ConnContext: withLendingConn}
	go srv.Serve(lendingListener{l.(*net.UnixListener)})
	defer srv.Close()
	var files []*os.File
	for i := range maxLentFiles + 3 {
		p := filepath.Join(dir, fmt.Sprint(i))
		if err := os.WriteFile(p, []byte(fmt.Sprint("file ", i)), 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		files = append(files, f)
	}
	ctx := context.Background()
	if got, err := op.call(ctx, lendingClient(path, files[:2]), noBody{}); err != nil || !slices.Equal(got.Got, []string{"file 0", "file 1"}) {
		t.Errorf("two files lent: the handler got %+v, %v; want their contents", got, err)
	}
	if got, err := op.call(ctx, controlClient(path), noBody{}); err != nil || len(got.Got) != 0 {
		t.Errorf("none lent: the handler got %+v, %v; want none", got, err)
	}
	if got, err := op.call(ctx, lendingClient(path, files), noBody{}); err != nil || len(got.Got) != maxLentFiles {
		t.Errorf("%d files lent: the handler got %+v, %v; want the first %d", len(files), got, err, maxLentFiles)
	}

	c := &control{stopc: make(chan stopRequest, 1)}
	cpath := filepath.Join(dir, ControlSocket)
	csrv, err := c.serve(cpath, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer csrv.Close()
	if _, err := opSnapshot.call(ctx, lendingClient(cpath, files[:2]), snapshotBody{Dir: "/a/b"}); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "without a parent") {
		t.Errorf("a snapshot with files lent and no parent = %v; want 400", err)
	}
	if _, err := opSnapshot.call(ctx, lendingClient(cpath, files[:2]), snapshotBody{Dir: "/a/b", Parent: "/a/p"}); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "the parent") {
		t.Errorf("a snapshot over a lent parent that is no snapshot = %v; want 400 naming the parent", err)
	}
}

// TestControlRefusesSuspendingAPod: a supervisor whose host mounts beneath
// its shares while it runs (a containerd pod's) refuses to be suspended,
// snapshotted or forked, saying why, before it touches the sandbox.
func TestControlRefusesSuspendingAPod(t *testing.T) {
	c := &control{stopc: make(chan stopRequest, 1), hostMounts: true}
	path := filepath.Join(t.TempDir(), ControlSocket)
	srv, err := c.serve(path, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	if _, err := opSuspend.call(context.Background(), controlClient(path), suspendBody{}); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "pod's VM cannot be suspended") {
		t.Errorf("suspending a pod's VM = %v; want 409 saying why not", err)
	}
	for _, fork := range []bool{false, true} {
		if _, err := opSnapshot.call(context.Background(), controlClient(path), snapshotBody{Dir: "/a/b", Fork: fork}); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "pod's VM cannot be snapshotted or forked") {
			t.Errorf("a snapshot (fork %v) of a pod's VM = %v; want 409 saying why not", fork, err)
		}
	}
}
