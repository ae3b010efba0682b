package store

import (
	"context"
	"errors"
	"fmt"
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
// created records the sandbox name as capsa create leaves it: Created,
// its lock free.
func created(t *testing.T, s *Store, name string) {
	t.Helper()
	l, err := s.Create(&Record{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Update(name, func(r *Record) error { r.State = Created; return nil }); err != nil {
		t.Fatal(err)
	}
	l.Close()
}

func TestStart(t *testing.T) {
	s := open(t)
	created(t, s, "c")
	if r, err := s.Get("c"); err != nil || r.State != Created {
		t.Fatalf("Get(c) of a created sandbox = %+v, %v; want created (not crashed)", r, err)
	}
	l, err := s.Start("c", func(r *Record) { r.Reboot = true })
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

// TestWhileStopped: a stopped sandbox's record is changed under its lock,
// and a Start at the same time waits for the change and begins from the
// changed record; a starting or running one is left to its supervisor.
func TestWhileStopped(t *testing.T) {
	s := open(t)
	created(t, s, "c")
	// A Start while the change holds the lock waits for it.
	inside := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		stopped, err := s.WhileStopped("c", func(r *Record) error {
			if r.State != Created {
				return fmt.Errorf("the record given: %s, want created", r.State)
			}
			close(inside)
			time.Sleep(300 * time.Millisecond)
			return s.Update("c", func(r *Record) error { r.Spec.MemoryMiB = 777; return nil })
		})
		if err == nil && !stopped {
			err = errors.New("WhileStopped of a created sandbox did not run its change")
		}
		done <- err
	}()
	<-inside
	l, err := s.Start("c")
	if err != nil {
		t.Fatalf("Start during a change of the record: %v; want it to wait for the change", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if r, _ := s.getRaw("c"); r.State != Creating || r.Spec.MemoryMiB != 777 {
		t.Errorf("the started record: %s, memory %d MiB; want creating, 777", r.State, r.Spec.MemoryMiB)
	}
	// Starting (its lock held): not changed here.
	ran := false
	if stopped, err := s.WhileStopped("c", func(*Record) error { ran = true; return nil }); stopped || ran || err != nil {
		t.Errorf("WhileStopped of a starting sandbox = %v, %v, ran %v; want false, nil, not run", stopped, err, ran)
	}
	// Its supervisor gone without a word: folded in, then changed.
	l.Close()
	if stopped, err := s.WhileStopped("c", func(r *Record) error { ran = !r.Alive(); return nil }); !stopped || !ran || err != nil {
		t.Errorf("WhileStopped after its supervisor died = %v, %v, given a stopped record %v; want true, nil, true", stopped, err, ran)
	}
	if _, err := s.WhileStopped("none", func(*Record) error { return nil }); !errors.Is(err, ErrNotFound) {
		t.Errorf("WhileStopped(none) = %v, want ErrNotFound", err)
	}
}

// TestSettingsLock: a second holder of a sandbox's settings lock waits
// for the first (its ctx ends the wait, saying why), and gets it once the
// first lets go; the liveness lock is another, taken meanwhile.
func TestSettingsLock(t *testing.T) {
	s := open(t)
	created(t, s, "c")
	ctx := context.Background()
	l, err := s.SettingsLock(ctx, "c")
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := s.SettingsLock(short, "c"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a second settings lock while one is held: %v; want the wait ended by ctx", err)
	}
	if stopped, err := s.WhileStopped("c", func(*Record) error { return nil }); !stopped || err != nil {
		t.Errorf("WhileStopped while the settings lock is held = %v, %v; want it run", stopped, err)
	}
	got := make(chan error, 1)
	go func() {
		l2, err := s.SettingsLock(ctx, "c")
		if err == nil {
			l2.Close()
		}
		got <- err
	}()
	time.Sleep(30 * time.Millisecond)
	l.Close()
	select {
	case err := <-got:
		if err != nil {
			t.Errorf("the settings lock after it was let go: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("the settings lock was not taken after it was let go")
	}
	if _, err := s.SettingsLock(ctx, "../x"); err == nil {
		t.Error("a settings lock of a bad name was taken")
	}
}
