package store

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/confine"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestStatusOfARun: while its supervisor holds the lock, a record shows
// the run its status reports; once the supervisor has gone, the end is
// folded into the record and the status goes. The database itself is
// written only here, by the store.
func TestStatusOfARun(t *testing.T) {
	s := open(t)
	l, err := s.Create(&Record{Name: "r", Spec: sandbox.Spec{CPUs: 2}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	started := time.Now().Add(-time.Second).Round(0)
	err = s.WriteStatus("r", &Status{Run: Run{State: Running, Started: started, Env: []string{"A=1"}, Dir: "/w",
		Ports: []string{"127.0.0.1:8080->80/tcp"}, Confinement: &confine.Layers{Seccomp: "on"}}})
	if err != nil {
		t.Fatalf("WriteStatus = %v", err)
	}
	r, err := s.Get("r")
	if err != nil || r.State != Running || !r.Started.Equal(started) || r.Dir != "/w" || len(r.Ports) != 1 || r.Confinement == nil || r.Spec.CPUs != 2 {
		t.Fatalf("Get(r) while it runs = %+v, %v; want its status laid over its record", r, err)
	}
	if raw, _ := s.getRaw("r"); raw.State != Creating {
		t.Errorf("the database says %s while the supervisor runs; want creating (the status is not written into it)", raw.State)
	}
	if err := s.WriteStatus("r", &Status{Run: Run{State: Paused, Started: started}}); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Get("r"); r.State != Paused {
		t.Errorf("Get(r) after a pause = %s; want paused", r.State)
	}
	code := 3
	if err := s.WriteStatus("r", &Status{Run: Run{State: Exited, Started: started, ExitCode: &code, Reason: "its main process ended"}}); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Get("r"); r.State != Exited || r.ExitCode == nil || *r.ExitCode != 3 || r.Alive() {
		t.Errorf("Get(r) after its end, lock still held = %+v; want exited 3", r)
	}
	l.Close()
	r, err = s.Get("r")
	if err != nil || r.State != Exited || *r.ExitCode != 3 || r.Reason != "its main process ended" || r.Ended.IsZero() {
		t.Fatalf("Get(r) after the supervisor went = %+v, %v; want exited 3 with its reason", r, err)
	}
	if raw, _ := s.getRaw("r"); raw.State != Exited {
		t.Errorf("the database says %s; want the end folded in", raw.State)
	}
	if _, err := os.Stat(filepath.Join(s.SandboxDir("r"), statusFile)); !os.IsNotExist(err) {
		t.Errorf("the status after the fold: %v; want it gone", err)
	}
}

// TestStatusCannotChangeTheRecord: a supervisor, possibly compromised,
// writes a status that would change what the sandbox is (its shares, its
// snapshot, its name), a state no run has, a link, a FIFO, too much. Each
// is refused, named in the record, and the sandbox is crashed once its
// supervisor has gone; the description is never changed.
func TestStatusCannotChangeTheRecord(t *testing.T) {
	big := `{"state":"running","reason":"` + strings.Repeat("x", maxStatusBytes) + `"}`
	for _, tc := range []struct {
		name, want string
		make       func(path string) error
	}{
		{"description", "unknown field", writeString(`{"state":"running","spec":{"shares":[{"host":"/","guest":"/h"}]}}`)},
		{"restore from", "unknown field", writeString(`{"state":"suspended","restore_from":"/etc"}`)},
		{"created", `state "created"`, writeString(`{"state":"created"}`)},
		{"two objects", "data after", writeString(`{"state":"running"}{"state":"exited"}`)},
		{"too big", "larger than", writeString(big)},
		{"too many ports", "at most", writeString(`{"state":"running","ports":[` + strings.Repeat(`"p",`, maxStatusList) + `"p"]}`)},
		{"link", "symbolic links", func(path string) error {
			other := filepath.Join(filepath.Dir(path), "other.json")
			if err := os.WriteFile(other, []byte(`{"state":"exited"}`), 0o600); err != nil {
				return err
			}
			return os.Symlink(other, path)
		}},
		{"fifo", "not a regular file", func(path string) error { return syscall.Mkfifo(path, 0o600) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := open(t)
			l, err := s.Create(&Record{Name: "h", Spec: sandbox.Spec{CPUs: 1}, PID: 1})
			if err != nil {
				t.Fatal(err)
			}
			if err := tc.make(filepath.Join(s.SandboxDir("h"), statusFile)); err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			var r *Record
			go func() { r, err = s.Get("h"); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("Get hangs on the status")
			}
			if err != nil || r.State != Creating || !strings.Contains(r.Reason, tc.want) {
				t.Errorf("Get(h) while held = %s %q, %v; want creating, the status refused (%s)", r.State, r.Reason, err, tc.want)
			}
			l.Close()
			r, err = s.Get("h")
			if err != nil || r.State != Crashed || !strings.Contains(r.Reason, tc.want) || r.Spec.CPUs != 1 || len(r.Spec.Shares) != 0 || r.RestoreFrom != "" {
				t.Errorf("Get(h) after = %+v, %v; want crashed, naming %q, its description as recorded", r, err, tc.want)
			}
		})
	}
}

func writeString(s string) func(string) error {
	return func(path string) error { return os.WriteFile(path, []byte(s), 0o600) }
}

// TestStatusSuspended: a run that ends suspended restores from the
// sandbox's own directory, whatever else its status says; at its TTL it
// keeps none. Start takes it up again and clears the status.
func TestStatusSuspended(t *testing.T) {
	s := open(t)
	l, err := s.Create(&Record{Name: "z", TTL: time.Hour, PauseAtTTL: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteStatus("z", &Status{TTLPassed: true, Run: Run{State: Suspended, Reason: "suspended to disk at its TTL"}}); err != nil {
		t.Fatal(err)
	}
	l.Close()
	r, err := s.Get("z")
	if err != nil || r.State != Suspended || r.RestoreFrom != s.SuspendDir("z") || r.TTL != 0 || r.PID != 0 {
		t.Fatalf("Get(z) = %+v, %v; want suspended, restoring from %s, no TTL", r, err, s.SuspendDir("z"))
	}
	l, err = s.Start("z")
	if err != nil {
		t.Fatalf("Start(z) = %v", err)
	}
	defer l.Close()
	if r, _ := s.Get("z"); r.State != Creating {
		t.Errorf("Get(z) after Start = %s; want creating (the suspension's status is gone)", r.State)
	}
}

// TestStatusAutoRemove: a record that asked to go when its sandbox ends
// goes, with its directory, when the store next reads it; the name is
// free again. A suspended one stays for its resume.
func TestStatusAutoRemove(t *testing.T) {
	s := open(t)
	l, err := s.Create(&Record{Name: "a", AutoRemove: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteStatus("a", &Status{Run: Run{State: Exited}}); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if rs, err := s.List(); err != nil || len(rs) != 0 {
		t.Errorf("List after an --rm sandbox ended = %v, %v; want none", rs, err)
	}
	if _, err := s.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(a) = %v; want ErrNotFound", err)
	}
	if _, err := os.Stat(s.SandboxDir("a")); !os.IsNotExist(err) {
		t.Errorf("its directory: %v; want it gone", err)
	}

	// Not yet read when the name is taken again: Create folds it first.
	l, err = s.Create(&Record{Name: "a", AutoRemove: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteStatus("a", &Status{Run: Run{State: Exited}}); err != nil {
		t.Fatal(err)
	}
	l.Close()
	l, err = s.Create(&Record{Name: "a"})
	if err != nil {
		t.Fatalf("Create(a) over an ended --rm sandbox = %v", err)
	}
	if _, err := s.lock("a"); !errors.Is(err, ErrExists) {
		t.Errorf("the new record's lock: %v; want it held (on the directory's new lock file)", err)
	}
	l.Close()

	l, err = s.Create(&Record{Name: "s", AutoRemove: true})
	if err != nil {
		t.Fatal(err)
	}
	s.WriteStatus("s", &Status{Run: Run{State: Suspended}})
	l.Close()
	if r, err := s.Get("s"); err != nil || r.State != Suspended {
		t.Errorf("Get(s), suspended with --rm = %v, %v; want it kept", r, err)
	}
}

// TestWriteStatusCutsALongReason: the supervisor's own long reason (a
// boot's error) is cut to what a status holds, not refused.
func TestWriteStatusCutsALongReason(t *testing.T) {
	s := open(t)
	l, err := s.Create(&Record{Name: "c"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := s.WriteStatus("c", &Status{Run: Run{State: Exited, Reason: strings.Repeat("é", maxStatusText)}}); err != nil {
		t.Fatalf("WriteStatus with a long reason = %v", err)
	}
	st, err := s.readStatus("c")
	if err != nil || len(st.Reason) > maxStatusText || !strings.HasSuffix(st.Reason, " ...") {
		t.Errorf("readStatus = %d bytes, %v; want at most %d, cut", len(st.Reason), err, maxStatusText)
	}
}

// FuzzReadStatus: whatever a supervisor writes as its status, reading it
// neither panics nor takes a status that fails the checks, and laying an
// accepted one over a record changes no part of its description.
func FuzzReadStatus(f *testing.F) {
	f.Add([]byte(`{"state":"running","ports":["127.0.0.1:1->2/tcp"],"env":["A=1"]}`))
	f.Add([]byte(`{"state":"suspended","ttl_passed":true}`))
	f.Add([]byte(`{"state":"exited","exit_code":3,"reason":"x"}`))
	f.Add([]byte(`{"state":"created"}`))
	s, err := Open(f.TempDir())
	if err != nil {
		f.Fatal(err)
	}
	if err := os.MkdirAll(s.SandboxDir("f"), 0o700); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if err := os.WriteFile(filepath.Join(s.SandboxDir("f"), statusFile), b, 0o600); err != nil {
			t.Fatal(err)
		}
		st, err := s.readStatus("f")
		if err != nil {
			return
		}
		if err := st.check(); err != nil {
			t.Fatalf("readStatus took %q, which check refuses: %v", b, err)
		}
		r := Record{Name: "f", Spec: sandbox.Spec{CPUs: 3}, RestoreFrom: "/kept", AutoRemove: true, Labels: map[string]string{"k": "v"}}
		s.overlay(&r, st)
		if r.Name != "f" || r.Spec.CPUs != 3 || !r.AutoRemove || r.Labels["k"] != "v" ||
			(r.RestoreFrom != "/kept" && r.RestoreFrom != s.SuspendDir("f")) {
			t.Fatalf("the status %q changed the record's description: %+v", b, r)
		}
	})
}
