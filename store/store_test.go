package store

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

func open(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatalf("Open = %v", err)
	}
	return s
}

func TestCreateGetUpdateRemove(t *testing.T) {
	s := open(t)
	spec := sandbox.Spec{CPUs: 2, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"sleep", "infinity"}}}
	l, err := s.Create(&Record{Name: "w", Spec: spec})
	if err != nil {
		t.Fatalf("Create(w) = %v", err)
	}
	defer l.Close()
	if err := s.Update("w", func(r *Record) error { r.State, r.PID = Running, os.Getpid(); return nil }); err != nil {
		t.Fatalf("Update(w) = %v", err)
	}
	r, err := s.Get("w")
	if err != nil || r.State != Running || r.Spec.CPUs != 2 || r.Spec.Main.Argv[0] != "sleep" || r.ID == "" {
		t.Fatalf("Get(w) = %+v, %v; want running with its spec", r, err)
	}
	if _, err := s.Create(&Record{Name: "w"}); !errors.Is(err, ErrExists) {
		t.Fatalf("Create(w) again = %v, want ErrExists", err)
	}
	if err := s.Remove("w"); err == nil {
		t.Fatal("Remove(w) of a running sandbox succeeded")
	}
	if fi, err := os.Stat(s.SandboxDir("w")); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("sandbox dir = %v, %v; want mode 0700", fi, err)
	}
	// The supervisor records the end, then lets go of the lock.
	code := 3
	s.Update("w", func(r *Record) error { r.State, r.ExitCode = Exited, &code; return nil })
	l.Close()
	if r, _ := s.Get("w"); r.State != Exited || *r.ExitCode != 3 {
		t.Fatalf("Get(w) after its end = %+v, want exited 3", r)
	}
	if _, err := s.Create(&Record{Name: "w"}); !errors.Is(err, ErrExists) {
		t.Fatalf("Create(w) over an exited record = %v, want ErrExists", err)
	}
	if err := s.Remove("w"); err != nil {
		t.Fatalf("Remove(w) = %v", err)
	}
	if _, err := s.Get("w"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get(w) after Remove = %v, want ErrNotFound", err)
	}
	if _, err := os.Stat(s.SandboxDir("w")); !os.IsNotExist(err) {
		t.Fatalf("sandbox dir after Remove: %v, want gone", err)
	}
	l2, err := s.Create(&Record{Name: "w"})
	if err != nil {
		t.Fatalf("Create(w) after Remove = %v", err)
	}
	l2.Close()
}

// A record that says running while nobody holds its lock belongs to a
// supervisor that died: it reads as crashed, and rm cleans it.
func TestCrashedSupervisor(t *testing.T) {
	s := open(t)
	l, err := s.Create(&Record{Name: "c"})
	if err != nil {
		t.Fatal(err)
	}
	s.Update("c", func(r *Record) error { r.State, r.PID = Running, 12345; return nil })
	l.Close() // as a SIGKILL would
	rs, err := s.List()
	if err != nil || len(rs) != 1 || rs[0].State != Crashed || rs[0].Reason == "" {
		t.Fatalf("List() = %+v, %v; want c crashed with a reason", rs, err)
	}
	if err := s.Remove("c"); err != nil {
		t.Fatalf("Remove(c) = %v", err)
	}
}

func TestConcurrentCreate(t *testing.T) {
	s := open(t)
	const n = 8
	var wg sync.WaitGroup
	errs := make([]error, n)
	locks := make([]*Lock, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			locks[i], errs[i] = s.Create(&Record{Name: "same"})
		}()
	}
	wg.Wait()
	won := 0
	for i, err := range errs {
		switch {
		case err == nil:
			won++
			defer locks[i].Close()
		case !errors.Is(err, ErrExists):
			t.Errorf("Create(same) = %v, want ErrExists for the losers", err)
		}
	}
	if won != 1 {
		t.Fatalf("%d of %d concurrent Create(same) succeeded, want 1", won, n)
	}
}

func TestNames(t *testing.T) {
	s := open(t)
	for _, bad := range []string{"", "../x", "a/b", "-x", "a b", string(make([]byte, 64))} {
		if _, err := s.Create(&Record{Name: bad}); err == nil {
			t.Errorf("Create(%q) succeeded", bad)
		}
		if _, err := s.Get(bad); err == nil {
			t.Errorf("Get(%q) succeeded", bad)
		}
	}
	name, err := s.NewName()
	if err != nil || CheckName(name) != nil {
		t.Fatalf("NewName() = %q, %v", name, err)
	}
}

// TestStart: only a created sandbox starts, once, and a created one is not
// mistaken for a crashed one.
func TestStart(t *testing.T) {
	s := open(t)
	l, err := s.Create(&Record{Name: "c"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Update("c", func(r *Record) error { r.State = Created; return nil }); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if r, err := s.Get("c"); err != nil || r.State != Created {
		t.Fatalf("Get(c) of a created sandbox = %+v, %v; want created (not crashed)", r, err)
	}
	l, err = s.Start("c", func(r *Record) { r.Reboot = true })
	if err != nil {
		t.Fatalf("Start(c) = %v", err)
	}
	if r, _ := s.Get("c"); r.State != Creating || !r.Reboot {
		t.Errorf("Start(c, set Reboot) left state %s, Reboot %v; want creating, true", r.State, r.Reboot)
	}
	if _, err := s.Start("c", func(r *Record) { r.Reboot = false }); err == nil {
		t.Error("Start(c) while its lock is held succeeded")
	}
	if r, _ := s.Get("c"); !r.Reboot {
		t.Error("a refused Start changed the record")
	}
	l.Close()
	s.Update("c", func(r *Record) error { r.State = Exited; return nil })
	if _, err := s.Start("c"); err == nil {
		t.Error("Start of an exited sandbox succeeded")
	}
	if _, err := s.Start("none"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Start(none) = %v, want ErrNotFound", err)
	}
}

// TestSuspended: a suspended sandbox is not alive (no supervisor holds
// it, and List does not call it crashed), and Start restores it; while its
// old supervisor holds the lock, WaitUnlocked waits and Start refuses.
func TestSuspended(t *testing.T) {
	s := open(t)
	l, err := s.Create(&Record{Name: "z"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Update("z", func(r *Record) error { r.State = Suspended; return nil }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	if err := s.WaitUnlocked(ctx, "z"); err == nil {
		t.Error("WaitUnlocked while the lock is held returned no error at its deadline")
	}
	cancel()
	if _, err := s.Start("z"); err == nil {
		t.Error("Start of a suspended sandbox whose lock is held succeeded")
	}
	go func() { time.Sleep(50 * time.Millisecond); l.Close() }()
	if err := s.WaitUnlocked(context.Background(), "z"); err != nil {
		t.Fatalf("WaitUnlocked once the lock goes = %v", err)
	}
	rs, err := s.List()
	if err != nil || len(rs) != 1 || rs[0].State != Suspended || rs[0].Alive() {
		t.Fatalf("List() = %+v, %v; want z suspended, not alive (not crashed)", rs, err)
	}
	l, err = s.Start("z")
	if err != nil {
		t.Fatalf("Start of a suspended sandbox = %v", err)
	}
	defer l.Close()
	if r, _ := s.Get("z"); r.State != Creating {
		t.Errorf("Start(z) left state %s, want creating", r.State)
	}
}

func TestRemoveStale(t *testing.T) {
	s := open(t)
	old := time.Now().Add(-time.Hour)
	mk := func(name string) string {
		d := s.SandboxDir(name)
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(d, "console.log"), []byte("x"), 0o600)
		os.Chtimes(d, old, old)
		return d
	}
	mk("gone")
	young := mk("young")
	now := time.Now()
	os.Chtimes(young, now, now)
	held := mk("held")
	l, err := s.lock("held")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	os.Chtimes(held, old, old)
	kept, err := s.Create(&Record{Name: "kept"})
	if err != nil {
		t.Fatal(err)
	}
	kept.Close()
	os.Chtimes(s.SandboxDir("kept"), old, old)
	s.RemoveStale(time.Minute)
	for _, c := range []struct {
		name string
		want bool
	}{{"gone", false}, {"young", true}, {"held", true}, {"kept", true}} {
		_, err := os.Stat(s.SandboxDir(c.name))
		if got := err == nil; got != c.want {
			t.Errorf("after RemoveStale, %s's directory exists = %v, want %v", c.name, got, c.want)
		}
	}
}
