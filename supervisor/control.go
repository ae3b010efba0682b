package supervisor

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/ratelimit"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// The control protocol between a supervisor (the server, on its
// sandbox's control.sock) and its clients: HTTP with JSON bodies, every
// operation once in one table, controlOps, with its method, path, request
// and reply types and the status it answers on success. The server
// registers each operation's handler through the table and the clients
// call each through it, so neither writes a route; a unit test holds the
// server's routes to the table (as the agent's operations are one table,
// agent.Ops).

// noBody is the request or reply of an operation that has none.
type noBody struct{}

// stopBody is the stop operation's request.
type stopBody struct {
	Timeout time.Duration `json:"timeout_ns"`
	Kill    bool          `json:"kill"`
}

// snapshotBody is the snapshot operation's request: an absolute
// directory, whether the snapshot records an inventory, and the absolute
// directory of a parent it is a layer over (sandbox.SnapshotOptions).
type snapshotBody struct {
	Dir       string `json:"dir"`
	Inventory bool   `json:"inventory,omitempty"`
	Parent    string `json:"parent,omitempty"`
	Fork      bool   `json:"fork,omitempty"`
}

// ttlBody is the TTL operation's request: the sandbox's new TTL, counted
// from its start (0: none).
type ttlBody struct {
	TTL time.Duration `json:"ttl_ns"`
}

// controlOp is one operation of the control protocol, with request type
// Req and reply type Resp (noBody for none).
type controlOp[Req, Resp any] struct {
	name   string // its path is /v1/NAME
	method string
	ok     int // the status of success
}

// The operations.
var (
	opStop     = controlOp[stopBody, noBody]{"stop", http.MethodPost, http.StatusAccepted}
	opPause    = controlOp[noBody, noBody]{"pause", http.MethodPost, http.StatusNoContent}
	opResume   = controlOp[noBody, noBody]{"resume", http.MethodPost, http.StatusNoContent}
	opSnapshot = progressOp[snapshotBody]{controlOp[snapshotBody, noBody]{"snapshot", http.MethodPost, http.StatusNoContent}}
	opSuspend  = controlOp[suspendBody, noBody]{"suspend", http.MethodPost, http.StatusAccepted}
	opStats    = controlOp[noBody, sandbox.Stats]{"stats", http.MethodGet, http.StatusOK}
	opLimits   = controlOp[ratelimit.Limits, ratelimit.Limits]{"limits", http.MethodPut, http.StatusOK}
	opTTL      = controlOp[ttlBody, noBody]{"ttl", http.MethodPut, http.StatusNoContent}
	opNetwork  = controlOp[networkBody, noBody]{"network", http.MethodPut, http.StatusNoContent}
	opHeaders  = controlOp[headersBody, noBody]{"headers", http.MethodPut, http.StatusNoContent}
	opEgress   = controlOp[egressBody, noBody]{"egress-proxy", http.MethodPut, http.StatusNoContent}
)

// suspendBody says how to suspend: WithoutMemory keeps the disk alone.
type suspendBody struct {
	WithoutMemory bool `json:"without_memory,omitempty"`
}

// networkBody is the network policy to put in force (nil: public-only).
type networkBody struct {
	Policy *netstack.Policy `json:"policy"`
}

// controlRoute is what the table says of an operation, whatever its types.
type controlRoute interface {
	opName() string
	pattern() string
	// clientRequest is the request a client sends for the operation
	// (with a zero request body).
	clientRequest(context.Context) (*http.Request, error)
}

// controlOps is the protocol's table.
var controlOps = []controlRoute{opStop, opPause, opResume, opSnapshot, opSuspend, opStats, opLimits, opTTL, opNetwork, opHeaders, opEgress}

func (o controlOp[Req, Resp]) opName() string  { return o.name }
func (o controlOp[Req, Resp]) path() string    { return "/v1/" + o.name }
func (o controlOp[Req, Resp]) pattern() string { return o.method + " " + o.path() }

func (o controlOp[Req, Resp]) clientRequest(ctx context.Context) (*http.Request, error) {
	var req Req
	return o.newRequest(ctx, req)
}

// Bounds of a request body the server reads and of a reply a client reads.
const (
	maxControlRequest = 4 << 10
	maxControlReply   = 64 << 10
)

// controlError is a handler's failure with the status to answer it with.
type controlError struct {
	status int
	err    error
}

func (e *controlError) Error() string { return e.err.Error() }
func (e *controlError) Unwrap() error { return e.err }

// controlErrorCodes are the errors a client tells apart, each answered
// with its code in the errorCodeHeader: the client's error then wraps the
// same one, so that errors.Is works across the socket as in the process.
var controlErrorCodes = map[string]error{
	"being-suspended": ErrBeingSuspended,
	"no-interception": sandbox.ErrNoInterception,
	"outside-ca":      sandbox.ErrOutsideCA,
}

const errorCodeHeader = "Capsa-Error"

// remoteError is the server's refusal, as the client has it.
type remoteError struct {
	status string // the HTTP status line's text: "409 Conflict"
	msg    string
	is     error // the sentinel its code names, or nil
}

func (e *remoteError) Error() string { return e.status + ": " + e.msg }
func (e *remoteError) Unwrap() error { return e.is }

// badRequest is a request the server refuses (400).
func badRequest(format string, args ...any) error {
	return &controlError{http.StatusBadRequest, fmt.Errorf(format, args...)}
}

// register serves o on mux with h, which gets the decoded, bounded
// request and returns the reply; an error is answered with its status
// (a controlError's, else 409 Conflict: the sandbox could not do it now).
func (o controlOp[Req, Resp]) register(mux *http.ServeMux, h func(context.Context, Req) (Resp, error)) {
	mux.HandleFunc(o.pattern(), func(w http.ResponseWriter, r *http.Request) {
		var req Req
		if _, none := any(req).(noBody); !none {
			// No body is the zero request (a client from before the
			// operation took one).
			if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxControlRequest)).Decode(&req); err != nil && !errors.Is(err, io.EOF) {
				http.Error(w, fmt.Sprintf("bad %s request: %v", o.name, err), http.StatusBadRequest)
				return
			}
		}
		resp, err := h(r.Context(), req)
		if err != nil {
			writeError(w, err)
			return
		}
		if _, none := any(resp).(noBody); none {
			w.WriteHeader(o.ok)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(o.ok)
		json.NewEncoder(w).Encode(resp)
	})
}

// newRequest is the client's HTTP request for o with req.
func (o controlOp[Req, Resp]) newRequest(ctx context.Context, req Req) (*http.Request, error) {
	var body io.Reader
	if _, none := any(req).(noBody); !none {
		b, err := json.Marshal(req)
		if err != nil {
			return nil, err
		}
		body = bytes.NewReader(b)
	}
	return http.NewRequestWithContext(ctx, o.method, "http://supervisor"+o.path(), body)
}

// call makes o on the supervisor hc reaches and decodes its reply. An
// error says the operation and the server's answer; one that never
// reached the server wraps the transport's error.
func (o controlOp[Req, Resp]) call(ctx context.Context, hc *http.Client, req Req) (*Resp, error) {
	r, err := o.newRequest(ctx, req)
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(r)
	if err != nil {
		return nil, &transportError{err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxControlReply))
	if err != nil {
		return nil, &transportError{err}
	}
	if resp.StatusCode != o.ok {
		// An unknown code is no sentinel: the message stands alone.
		return nil, &remoteError{resp.Status, printable(strings.TrimSpace(string(body))), controlErrorCodes[resp.Header.Get(errorCodeHeader)]}
	}
	var out Resp
	if _, none := any(out).(noBody); !none {
		if err := json.Unmarshal(body, &out); err != nil {
			return nil, fmt.Errorf("bad reply: %w", err)
		}
	}
	return &out, nil
}

// transportError is a call that did not get the server's answer.
type transportError struct{ err error }

func (e *transportError) Error() string { return e.err.Error() }
func (e *transportError) Unwrap() error { return e.err }

// controlClient talks HTTP over a supervisor's control socket.
func controlClient(path string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}}}
}

// progressOp is an operation whose reply streams its progress to a
// client that accepts it (progressType): the server answers 200 with one
// JSON line (progressLine) per event, at most progressEvery apart for one
// step, and last the outcome (an error, its status and code; none: done).
// A failure before the first event is answered as a controlOp's is, with
// its status, and so is every request that does not accept the stream (a
// client from before it: its ok, 204, on success, as then). Its name, route
// and request are its controlOp's; register and call are its own.
type progressOp[Req any] struct {
	controlOp[Req, noBody]
}

// progressLine is one line of a progressOp's reply.
type progressLine struct {
	Progress *sandbox.Progress `json:"progress,omitempty"`
	Done     bool              `json:"done,omitempty"`
	Error    string            `json:"error,omitempty"`
	Status   int               `json:"status,omitempty"`
	Code     string            `json:"code,omitempty"`
}

const (
	// progressType is the stream's media type, which a client asks for
	// in its Accept header.
	progressType = "application/x-ndjson"
	// progressEvery is how often a step's progress is sent at most.
	progressEvery = 100 * time.Millisecond
	// maxProgressLine bounds a line a client reads, and maxProgress the
	// whole stream.
	maxProgressLine = 8 << 10
	maxProgress     = 16 << 20
)

// register serves o on mux with h, which gets the decoded, bounded request
// and a function to report progress with.
func (o progressOp[Req]) register(mux *http.ServeMux, h func(context.Context, Req, func(sandbox.Progress)) error) {
	mux.HandleFunc(o.pattern(), func(w http.ResponseWriter, r *http.Request) {
		var req Req
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxControlRequest)).Decode(&req); err != nil && !errors.Is(err, io.EOF) {
			http.Error(w, fmt.Sprintf("bad %s request: %v", o.name, err), http.StatusBadRequest)
			return
		}
		if !strings.Contains(r.Header.Get("Accept"), progressType) {
			// A client that takes no stream: the outcome alone.
			if err := h(r.Context(), req, func(sandbox.Progress) {}); err != nil {
				writeError(w, err)
				return
			}
			w.WriteHeader(o.ok)
			return
		}
		// The handler reports on its own goroutine, which may hold the
		// sandbox paused: events go through a queue to this writer, and
		// are dropped while the queue is full (a client not reading).
		var started bool
		events := make(chan progressLine, 16)
		written := make(chan struct{})
		enc := json.NewEncoder(w)
		flusher, _ := w.(http.Flusher)
		send := func(l progressLine) {
			if !started {
				w.Header().Set("Content-Type", progressType)
				w.WriteHeader(http.StatusOK)
				started = true
			}
			enc.Encode(l)
			if flusher != nil {
				flusher.Flush()
			}
		}
		go func() {
			defer close(written)
			for l := range events {
				send(l)
			}
		}()
		var (
			mu     sync.Mutex
			last   sandbox.Progress
			sent   time.Time
			closed bool
		)
		report := func(p sandbox.Progress) {
			mu.Lock()
			defer mu.Unlock()
			if closed {
				return
			}
			// A step's first and last events go; between them, one each
			// progressEvery.
			if p.Step == last.Step && p.Done != p.Total && time.Since(sent) < progressEvery {
				return
			}
			last, sent = p, time.Now()
			select {
			case events <- progressLine{Progress: &p}:
			default:
			}
		}
		end := func() {
			mu.Lock()
			defer mu.Unlock()
			if !closed {
				closed = true
				close(events)
			}
		}
		// A handler that panics leaves no writer behind, nor one that
		// writes after this returns.
		defer func() { end(); <-written }()
		err := h(r.Context(), req, report)
		end()
		<-written
		if err == nil {
			if !started {
				w.WriteHeader(http.StatusNoContent)
				return
			}
			send(progressLine{Done: true})
			return
		}
		if !started {
			writeError(w, err)
			return
		}
		status, code := errorStatus(err)
		send(progressLine{Error: err.Error(), Status: status, Code: code})
	})
}

// writeError answers a handler's err with its status and code
// (errorStatus) and its message.
func writeError(w http.ResponseWriter, err error) {
	status, code := errorStatus(err)
	if code != "" {
		w.Header().Set(errorCodeHeader, code)
	}
	http.Error(w, err.Error(), status)
}

// errorStatus is the status and error code a handler's err is answered
// with: a controlError's status, else 409 Conflict (the sandbox could not
// do it now); the code of the sentinel it wraps (controlErrorCodes), or "".
func errorStatus(err error) (status int, code string) {
	status = http.StatusConflict
	var ce *controlError
	if errors.As(err, &ce) {
		status = ce.status
	}
	for c, sentinel := range controlErrorCodes {
		if errors.Is(err, sentinel) {
			code = c
		}
	}
	return status, code
}

// call makes o on the supervisor hc reaches, passing each progress event
// whose step is one of steps to progress (when not nil), and returns its
// outcome. A server that answers 204 (done, with nothing to report)
// is done. Events the client does not know (another step, counts out of
// range) are dropped: the server is the VMM's process, which a guest may
// have taken.
func (o progressOp[Req]) call(ctx context.Context, hc *http.Client, req Req, steps []string, progress func(sandbox.Progress)) error {
	r, err := o.newRequest(ctx, req)
	if err != nil {
		return err
	}
	r.Header.Set("Accept", progressType)
	resp, err := hc.Do(r)
	if err != nil {
		return &transportError{err}
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusNoContent:
		return nil
	case http.StatusOK:
	default:
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxControlReply))
		if err != nil {
			return &transportError{err}
		}
		return &remoteError{resp.Status, printable(strings.TrimSpace(string(body))), controlErrorCodes[resp.Header.Get(errorCodeHeader)]}
	}
	sc := bufio.NewScanner(io.LimitReader(resp.Body, maxProgress))
	sc.Buffer(make([]byte, 0, 512), maxProgressLine)
	for sc.Scan() {
		var l progressLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return fmt.Errorf("bad reply: %w", err)
		}
		switch {
		case l.Done:
			return nil
		case l.Error != "":
			status := http.StatusText(l.Status)
			if status == "" {
				status = "error"
			}
			return &remoteError{fmt.Sprintf("%d %s", l.Status, status), printable(l.Error), controlErrorCodes[l.Code]}
		case l.Progress != nil && progress != nil && knownProgress(*l.Progress, steps):
			progress(*l.Progress)
		}
	}
	if err := sc.Err(); err != nil {
		return &transportError{err}
	}
	return &transportError{io.ErrUnexpectedEOF}
}

// printable is a supervisor's message as a terminal may show it: control
// characters (an escape sequence's among them) become '?', but for new
// lines and tabs. The supervisor is the VMM's process, which a guest may
// have taken.
func printable(msg string) string {
	return strings.Map(func(r rune) rune {
		if r != '\n' && r != '\t' && (unicode.IsControl(r) || r == utf8.RuneError) {
			return '?'
		}
		return r
	}, msg)
}

// knownProgress says whether p is one of steps, with counts in range.
func knownProgress(p sandbox.Progress, steps []string) bool {
	return slices.Contains(steps, p.Step) && p.Done >= 0 && p.Total >= 0 && (p.Total == 0 || p.Done <= p.Total)
}
