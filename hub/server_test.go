package hub

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/hub/proto"
)

// serve returns a client whose every connection a real proto.Serve
// answers with one session (as a sandbox's VMM does).
func serve(t *testing.T, s *Session) *proto.Client {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c := &proto.Client{Dial: func(context.Context) (net.Conn, error) {
		a, b := net.Pipe()
		go proto.Serve(ctx, b, s, slog.New(slog.DiscardHandler))
		return a, nil
	}}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestWire(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	h := openHub(t, t.TempDir())
	c := serve(t, h.As(Grants{Identity: "guest", Topics: []string{"t"}, Prefixes: []string{"g/"}}))
	v, err := c.CAS(ctx, "g/k", 0, []byte("1"))
	if err != nil {
		t.Fatalf("CAS over the wire = %v", err)
	}
	if _, err := c.CAS(ctx, "g/k", 0, []byte("2")); !errors.Is(err, proto.ErrVersionMismatch) || !strings.Contains(err.Error(), "version mismatch") {
		t.Fatalf("CAS(absent) of an existing key over the wire = %v, want version mismatch", err)
	}
	if _, err := c.Get(ctx, "secret"); !errors.Is(err, proto.ErrPermission) {
		t.Fatalf("Get(ungranted) over the wire = %v, want permission", err)
	}
	if e, err := c.Get(ctx, "g/k"); err != nil || e.Version != v || string(e.Value) != "1" {
		t.Fatalf("Get(g/k) over the wire = %+v, %v", e, err)
	}
	// The host sees what the guest stored, and the sender is the
	// session's, not the guest's word.
	m, err := c.Publish(ctx, "t", []byte("hello"))
	if err != nil || m.Sender != "guest" {
		t.Fatalf("Publish over the wire = %+v, %v; want sender guest", m, err)
	}
	got := make(chan proto.Message, 1)
	sctx, scancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- c.Subscribe(sctx, "t", 0, func(m proto.Message) error { got <- m; return nil })
	}()
	if m := <-got; string(m.Payload) != "hello" {
		t.Fatalf("Subscribe over the wire delivered %+v", m)
	}
	scancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Subscribe after cancel = %v, want context.Canceled", err)
	}
	evs := make(chan proto.Event, 1)
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	go c.Watch(wctx, "g/", func(e proto.Event) error { evs <- e; return nil })
	time.Sleep(100 * time.Millisecond)
	if _, err := h.As(host).Set(ctx, "g/k", []byte("from host")); err != nil {
		t.Fatal(err)
	}
	if e := <-evs; string(e.Value) != "from host" {
		t.Fatalf("Watch over the wire = %+v", e)
	}
}

// TestServeBadInput sends what a hostile guest might: each gets an error
// line, and the server neither hangs nor reads past its bound.
func TestServeBadInput(t *testing.T) {
	h := openHub(t, t.TempDir())
	for _, tc := range []struct {
		name, in, code string
	}{
		{"not JSON", "hello\n", "invalid"},
		{"unknown op", `{"id":3,"op":"kv.nuke"}` + "\n", "invalid"},
		{"empty key", `{"id":4,"op":"kv.get"}` + "\n", "invalid"},
		{"control char", `{"id":5,"op":"kv.get","key":"a\u0001"}` + "\n", "invalid"},
		{"line too long", `{"id":6,"op":"kv.set","key":"k","value":"` + strings.Repeat("A", proto.MaxLine) + "\"}\n", "limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := net.Pipe()
			defer a.Close()
			go proto.Serve(context.Background(), b, h.As(Grants{Identity: "g", Prefixes: []string{""}}), slog.New(slog.DiscardHandler))
			go a.Write([]byte(tc.in))
			a.SetDeadline(time.Now().Add(10 * time.Second))
			line, err := bufio.NewReader(a).ReadBytes('\n')
			if err != nil || !bytes.Contains(line, []byte(`"code":"`+tc.code+`"`)) {
				t.Fatalf("Serve(%s) answered %q, %v; want code %s", tc.name, line, err, tc.code)
			}
		})
	}
}

func FuzzServe(f *testing.F) {
	f.Add([]byte(`{"id":1,"op":"kv.set","key":"k","value":"eA=="}` + "\n" + `{"id":2,"op":"kv.get","key":"k"}` + "\n"))
	f.Add([]byte(`{"id":1,"op":"mailbox.publish","topic":"t","payload":"eA=="}` + "\n" + `{"id":2,"op":"mailbox.read","topic":"t","from":-5,"max":-1}` + "\n"))
	f.Add([]byte(`{"id":1,"op":"kv.cas","key":"k","version":18446744073709551615}` + "\n"))
	h, err := Open(f.TempDir())
	if err != nil {
		f.Fatal(err)
	}
	defer h.Close()
	f.Fuzz(func(t *testing.T, in []byte) {
		// No stream ops: they wait for changes by design.
		if bytes.Contains(in, []byte("watch")) || bytes.Contains(in, []byte("subscribe")) {
			return
		}
		a, b := net.Pipe()
		done := make(chan struct{})
		go func() {
			proto.Serve(context.Background(), b, h.As(Grants{Identity: "g", Topics: []string{"*"}, Prefixes: []string{""}, Limits: Limits{Rate: 1e9}}), slog.New(slog.DiscardHandler))
			close(done)
		}()
		go func() {
			a.Write(in)
			a.Close()
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("Serve(%q) did not end after the peer closed", in)
		}
	})
}
