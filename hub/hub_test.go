package hub

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/hub/proto"
)

func openHub(t *testing.T, dir string) *Hub {
	t.Helper()
	h, err := Open(dir)
	if err != nil {
		t.Fatalf("Open(%s) = %v", dir, err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

var host = Grants{Host: true}

func TestCAS(t *testing.T) {
	ctx := context.Background()
	s := openHub(t, t.TempDir()).As(host)
	v1, err := s.CAS(ctx, "k", 0, []byte("a"))
	if err != nil || v1 == 0 {
		t.Fatalf("CAS(k, absent) = %d, %v; want a version", v1, err)
	}
	if _, err := s.CAS(ctx, "k", 0, []byte("b")); !errors.Is(err, proto.ErrVersionMismatch) {
		t.Fatalf("CAS(k, absent) on an existing key = %v, want version mismatch", err)
	}
	if _, err := s.CAS(ctx, "k", v1+5, []byte("b")); !errors.Is(err, proto.ErrVersionMismatch) {
		t.Fatalf("CAS(k, wrong version) = %v, want version mismatch", err)
	}
	v2, err := s.CAS(ctx, "k", v1, []byte("b"))
	if err != nil || v2 <= v1 {
		t.Fatalf("CAS(k, %d) = %d, %v; want a version above %d", v1, v2, err, v1)
	}
	if e, err := s.Get(ctx, "k"); err != nil || string(e.Value) != "b" || e.Version != v2 {
		t.Fatalf("Get(k) = %+v, %v; want b at %d", e, err, v2)
	}
	if err := s.Delete(ctx, "k"); err != nil {
		t.Fatalf("Delete(k) = %v", err)
	}
	if _, err := s.Get(ctx, "k"); !errors.Is(err, proto.ErrNotFound) {
		t.Fatalf("Get(deleted) = %v, want not found", err)
	}
	if _, err := s.CAS(ctx, "k", v2, []byte("c")); !errors.Is(err, proto.ErrVersionMismatch) {
		t.Fatalf("CAS(deleted key, old version) = %v, want version mismatch", err)
	}
	// Set again after a delete: the version keeps growing (no ABA).
	v3, err := s.CAS(ctx, "k", 0, []byte("c"))
	if err != nil || v3 <= v2 {
		t.Fatalf("CAS(k, absent) after delete = %d, %v; want above %d", v3, err, v2)
	}
	if err := s.Delete(ctx, "nope"); !errors.Is(err, proto.ErrNotFound) {
		t.Fatalf("Delete(nope) = %v, want not found", err)
	}
}

func TestDurable(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	h := openHub(t, dir)
	v, err := h.As(host).Set(ctx, "a/b", []byte("kept"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.As(host).Publish(ctx, "t", []byte("m0")); err != nil {
		t.Fatal(err)
	}
	h.Close()
	s := openHub(t, dir).As(host)
	if e, err := s.Get(ctx, "a/b"); err != nil || string(e.Value) != "kept" || e.Version != v {
		t.Fatalf("Get(a/b) after reopening = %+v, %v; want kept at %d", e, err, v)
	}
	if ms, err := s.Read(ctx, "t", 0, 10); err != nil || len(ms) != 1 || string(ms[0].Payload) != "m0" {
		t.Fatalf("Read(t, 0) after reopening = %v, %v; want m0", ms, err)
	}
}

func TestListPrefix(t *testing.T) {
	ctx := context.Background()
	s := openHub(t, t.TempDir()).As(host)
	for _, k := range []string{"a/1", "a/2", "b/1", "a0"} {
		if _, err := s.Set(ctx, k, []byte(k)); err != nil {
			t.Fatal(err)
		}
	}
	es, trunc, err := s.List(ctx, "a/")
	if err != nil || trunc || len(es) != 2 || es[0].Key != "a/1" || es[1].Key != "a/2" {
		t.Fatalf("List(a/) = %v, %v, %v; want a/1 and a/2", es, trunc, err)
	}
	if es, _, _ := s.List(ctx, ""); len(es) != 4 {
		t.Fatalf("List(\"\") = %d entries, want 4", len(es))
	}
}

// TestConcurrentCAS stands for several processes: each Hub has its own
// lock file descriptor, so they contend through flock as processes do.
func TestConcurrentCAS(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	const workers, each = 4, 50
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		s := openHub(t, dir).As(Grants{Identity: fmt.Sprintf("w%d", w), Prefixes: []string{"counter"}, Limits: Limits{Rate: 1e6}})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for done := 0; done < each; {
				var ver, n uint64
				e, err := s.Get(ctx, "counter")
				if err == nil {
					ver = e.Version
					n, _ = strconv.ParseUint(string(e.Value), 10, 64)
				} else if !errors.Is(err, proto.ErrNotFound) {
					errs <- err
					return
				}
				_, err = s.CAS(ctx, "counter", ver, []byte(strconv.FormatUint(n+1, 10)))
				if err == nil {
					done++
				} else if !errors.Is(err, proto.ErrVersionMismatch) {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	e, err := openHub(t, dir).As(host).Get(ctx, "counter")
	if err != nil || string(e.Value) != strconv.Itoa(workers*each) {
		t.Fatalf("Get(counter) = %q, %v; want %d", e.Value, err, workers*each)
	}
}

func TestWatch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dir := t.TempDir()
	s := openHub(t, dir).As(host)
	other := openHub(t, dir).As(host) // another "process" makes the changes
	if _, err := other.Set(ctx, "jobs/old", []byte("before")); err != nil {
		t.Fatal(err)
	}
	evs := make(chan proto.Event, 10)
	started := make(chan struct{})
	go func() {
		close(started)
		s.Watch(ctx, "jobs/", func(e proto.Event) error { evs <- e; return nil })
	}()
	<-started
	time.Sleep(100 * time.Millisecond) // let the watch take its starting revision
	v1, _ := other.Set(ctx, "jobs/1", []byte("x"))
	other.Set(ctx, "other/1", []byte("not watched"))
	other.Delete(ctx, "jobs/old")
	want := []proto.Event{{Key: "jobs/1", Value: []byte("x"), Version: v1}, {Key: "jobs/old", Deleted: true}}
	for i, w := range want {
		select {
		case e := <-evs:
			if e.Key != w.Key || !bytes.Equal(e.Value, w.Value) || e.Deleted != w.Deleted || (w.Version != 0 && e.Version != w.Version) {
				t.Fatalf("watch event %d = %+v, want %+v", i, e, w)
			}
		case <-ctx.Done():
			t.Fatalf("watch event %d: none within the timeout", i)
		}
	}
	select {
	case e := <-evs:
		t.Fatalf("an extra watch event %+v", e)
	case <-time.After(200 * time.Millisecond):
	}
}

func TestMailbox(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dir := t.TempDir()
	h := openHub(t, dir)
	a := h.As(Grants{Identity: "a", Topics: []string{"work/*"}})
	for i := 0; i < 3; i++ {
		m, err := a.Publish(ctx, "work/q", []byte{byte('0' + i)})
		if err != nil || m.Offset != uint64(i) || m.Sender != "a" {
			t.Fatalf("Publish #%d = %+v, %v; want offset %d from a", i, m, err, i)
		}
	}
	// A late subscriber reads the history from an offset, then new ones.
	got := make(chan proto.Message, 10)
	go openHub(t, dir).As(host).Subscribe(ctx, "work/q", 1, func(m proto.Message) error { got <- m; return nil })
	newOnly := make(chan proto.Message, 10)
	go h.As(host).Subscribe(ctx, "work/q", proto.New, func(m proto.Message) error { newOnly <- m; return nil })
	for _, want := range []uint64{1, 2} {
		if m := <-got; m.Offset != want {
			t.Fatalf("Subscribe(from 1) gave offset %d, want %d", m.Offset, want)
		}
	}
	time.Sleep(100 * time.Millisecond)
	if _, err := openHub(t, dir).As(Grants{Identity: "b", Topics: []string{"work/q"}}).Publish(ctx, "work/q", []byte("3")); err != nil {
		t.Fatal(err)
	}
	for _, ch := range []chan proto.Message{got, newOnly} {
		select {
		case m := <-ch:
			if m.Offset != 3 || m.Sender != "b" || string(m.Payload) != "3" {
				t.Fatalf("Subscribe delivered %+v, want offset 3 from b", m)
			}
		case <-ctx.Done():
			t.Fatal("no delivery of a new message")
		}
	}
	if len(newOnly) != 0 {
		t.Fatalf("a subscriber for new messages got history")
	}
}

func TestBoundedLog(t *testing.T) {
	ctx := context.Background()
	s := openHub(t, t.TempDir()).As(host)
	for i := 0; i < MaxMessages+5; i++ {
		if _, err := s.Publish(ctx, "t", []byte(strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	ms, err := s.Read(ctx, "t", 0, proto.MaxReadLen)
	if err != nil || len(ms) != MaxMessages || ms[0].Offset != 5 {
		t.Fatalf("Read(t, 0) = %d messages from offset %v, %v; want %d from 5", len(ms), ms[0].Offset, err, MaxMessages)
	}
	// The byte bound: 64 KiB payloads, so the log holds MaxTopicBytes.
	big := bytes.Repeat([]byte("x"), proto.MaxValue)
	for i := 0; i < 2*MaxTopicBytes/proto.MaxValue; i++ {
		if _, err := s.Publish(ctx, "big", big); err != nil {
			t.Fatal(err)
		}
	}
	ms, _ = s.Read(ctx, "big", 0, proto.MaxReadLen)
	if n := len(ms) * proto.MaxValue; n > MaxTopicBytes {
		t.Fatalf("topic big keeps %d bytes, want at most %d", n, MaxTopicBytes)
	}
}

func TestGrantsAndLimits(t *testing.T) {
	ctx := context.Background()
	h := openHub(t, t.TempDir())
	s := h.As(Grants{Identity: "sb", Topics: []string{"results"}, Prefixes: []string{"sb/"}, Limits: Limits{Keys: 2, Rate: 1e6}})
	checks := []struct {
		name string
		err  error
	}{
		{"Get(other)", func() error { _, err := s.Get(ctx, "other"); return err }()},
		{"Set(other)", func() error { _, err := s.Set(ctx, "other", nil); return err }()},
		{"List(\"\")", func() error { _, _, err := s.List(ctx, ""); return err }()},
		{"Publish(resultsX)", func() error { _, err := s.Publish(ctx, "resultsX", nil); return err }()},
		{"Read(other)", func() error { _, err := s.Read(ctx, "other", 0, 1); return err }()},
		{"Subscribe(other)", s.Subscribe(ctx, "other", 0, func(proto.Message) error { return nil })},
		{"Watch(\"\")", s.Watch(ctx, "", func(proto.Event) error { return nil })},
	}
	for _, c := range checks {
		if !errors.Is(c.err, proto.ErrPermission) {
			t.Errorf("%s = %v, want a permission error", c.name, c.err)
		}
	}
	for i := 0; i < 2; i++ {
		if _, err := s.Set(ctx, fmt.Sprintf("sb/%d", i), []byte("v")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Set(ctx, "sb/0", []byte("overwrite")); err != nil {
		t.Fatalf("Set(sb/0) within the key limit = %v", err)
	}
	if _, err := s.Set(ctx, "sb/2", []byte("v")); !errors.Is(err, proto.ErrLimit) {
		t.Fatalf("Set(a third key) = %v, want a limit error", err)
	}
	if err := s.Delete(ctx, "sb/1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Set(ctx, "sb/2", []byte("v")); err != nil {
		t.Fatalf("Set(sb/2) after a delete = %v", err)
	}
	if _, err := s.Set(ctx, "sb/big", make([]byte, proto.MaxValue+1)); !errors.Is(err, proto.ErrLimit) {
		t.Fatalf("Set(a value over %d bytes) = %v, want a limit error", proto.MaxValue, err)
	}
	slow := h.As(Grants{Identity: "slow", Prefixes: []string{""}, Limits: Limits{Rate: 1}})
	var err error
	for i := 0; i < 5 && err == nil; i++ {
		_, err = slow.Get(ctx, "x")
		if errors.Is(err, proto.ErrNotFound) {
			err = nil
		}
	}
	if !errors.Is(err, proto.ErrLimit) {
		t.Fatalf("5 gets at 1 a second = %v, want a limit error", err)
	}
}
