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
	if err := opSnapshot.call(ctx, hc, snapshotBody{Dir: "rel/dir"}, snapshotSteps, nil); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "absolute") {
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
	if err := opSnapshot.call(ctx, lendingClient(cpath, files[:2]), snapshotBody{Dir: "/a/b"}, snapshotSteps, nil); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "without a parent") {
		t.Errorf("a snapshot with files lent and no parent = %v; want 400", err)
	}
	if err := opSnapshot.call(ctx, lendingClient(cpath, files[:2]), snapshotBody{Dir: "/a/b", Parent: "/a/p"}, snapshotSteps, nil); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "the parent") {
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
		if err := opSnapshot.call(context.Background(), controlClient(path), snapshotBody{Dir: "/a/b", Fork: fork}, snapshotSteps, nil); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "pod's VM cannot be snapshotted or forked") {
			t.Errorf("a snapshot (fork %v) of a pod's VM = %v; want 409 saying why not", fork, err)
		}
	}
}

// TestProgressOp: an operation that streams its progress. The client
// gets each step's first and last events and, between them, few (the
// server sends one each progressEvery); an operation with nothing to
// report is a plain success; a failure before any event keeps its status,
// and one after it still reaches the client with its status and
// sentinel; events of steps the client does not know, or with counts out
// of range, are dropped, and its messages' control characters made
// printable; a client from before the stream gets the outcome alone; and a
// client that does not read never holds up the handler's reports (they
// may come while its sandbox is paused).
func TestProgressOp(t *testing.T) {
	op := progressOp[snapshotBody]{controlOp[snapshotBody, noBody]{"work", http.MethodPost, http.StatusNoContent}}
	const n = 2000
	handled := make(chan time.Duration, 1)
	mux := http.NewServeMux()
	op.register(mux, func(_ context.Context, req snapshotBody, report func(sandbox.Progress)) error {
		switch req.Dir {
		case "quiet":
			return nil
		case "early":
			return badRequest("bad thing %d", 7)
		case "steps":
			report(sandbox.Progress{Step: sandbox.StepInventory})
			for i := range n + 1 {
				report(sandbox.Progress{Step: sandbox.StepMemory, Done: int64(i) << 12, Total: n << 12, Bytes: true})
			}
			return nil
		case "hostile":
			report(sandbox.Progress{Step: "\x1b[2Jnot a step"})
			report(sandbox.Progress{Step: sandbox.StepMemory, Done: 9, Total: 3})
			report(sandbox.Progress{Step: sandbox.StepRootDisk, Done: -1})
			return fmt.Errorf("late \x1b[2J: %w", &controlError{http.StatusConflict, ErrBeingSuspended})
		case "flood":
			start := time.Now()
			pad := strings.Repeat("x", 200)
			for i := range 20000 {
				report(sandbox.Progress{Step: fmt.Sprintf("step %d %s", i, pad)})
			}
			handled <- time.Since(start)
			return nil
		}
		return errors.New("no such case")
	})
	path := filepath.Join(t.TempDir(), "work.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(l)
	defer srv.Close()
	hc := controlClient(path)
	ctx := context.Background()

	var got []sandbox.Progress
	collect := func(p sandbox.Progress) { got = append(got, p) }
	if err := op.call(ctx, hc, snapshotBody{Dir: "quiet"}, snapshotSteps, collect); err != nil || len(got) != 0 {
		t.Errorf("quiet = %v with %d events; want success, none", err, len(got))
	}
	if err := op.call(ctx, hc, snapshotBody{Dir: "early"}, snapshotSteps, collect); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "bad thing 7") {
		t.Errorf("a refusal before any progress = %v; want 400 and its message", err)
	}
	if err := op.call(ctx, hc, snapshotBody{Dir: "steps"}, snapshotSteps, collect); err != nil {
		t.Fatalf("steps = %v", err)
	}
	if len(got) < 3 || len(got) > n/4 {
		t.Fatalf("got %d events of %d; want the steps' first and last and few between", len(got), n+2)
	}
	first, last := got[1], got[len(got)-1]
	if got[0].Step != sandbox.StepInventory || first.Step != sandbox.StepMemory || first.Done != 0 || last.Done != last.Total || last.Total != n<<12 || !last.Bytes {
		t.Errorf("events %+v ... %+v; want the inventory, then memory from 0 to its total", got[:2], last)
	}
	for i := 2; i < len(got); i++ {
		if got[i].Done < got[i-1].Done {
			t.Errorf("event %d went back: %+v after %+v", i, got[i], got[i-1])
		}
	}
	got = nil
	err = op.call(ctx, hc, snapshotBody{Dir: "hostile"}, snapshotSteps, collect)
	if !errors.Is(err, ErrBeingSuspended) || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "late ?[2J") {
		t.Errorf("a failure after progress = %v; want 409 wrapping ErrBeingSuspended, its escape made printable", err)
	}
	if len(got) != 0 {
		t.Errorf("events of unknown steps or counts out of range reached the client: %+v", got)
	}

	// A client from before the stream (no Accept) gets the outcome alone,
	// as it did: 204, or the refusal with its status and code.
	for _, c := range []struct {
		dir    string
		status int
		code   string
	}{{"steps", http.StatusNoContent, ""}, {"early", http.StatusBadRequest, ""}, {"hostile", http.StatusConflict, "being-suspended"}} {
		resp, err := hc.Post("http://supervisor/v1/work", "application/json", strings.NewReader(`{"dir":"`+c.dir+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status || resp.Header.Get(errorCodeHeader) != c.code {
			t.Errorf("%s without Accept: %s, code %q; want %d, %q", c.dir, resp.Status, resp.Header.Get(errorCodeHeader), c.status, c.code)
		}
	}

	// A client that sends the request and never reads the reply.
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /v1/work HTTP/1.1\r\nHost: supervisor\r\nAccept: %s\r\nContent-Length: 16\r\n\r\n{\"dir\":\"flood\"}\n", progressType)
	select {
	case took := <-handled:
		if took > 5*time.Second {
			t.Errorf("20000 reports to a client that does not read took %v", took)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the handler's reports blocked on a client that does not read")
	}
}
