package supervisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/tlsproxy"
)

func newManager(t *testing.T) *Manager {
	t.Helper()
	m, err := OpenManager(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestManagerUnknownNames: every operation on a name the state directory
// does not hold is an error naming it, as ErrNotFound, before anything is
// started or signalled; a bad name is refused as such.
func TestManagerUnknownNames(t *testing.T) {
	m := newManager(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for op, call := range map[string]func() error{
		"Get":    func() error { _, err := m.Get("nosuch"); return err },
		"Open":   func() error { _, err := m.Open(ctx, "nosuch"); return err },
		"Stop":   func() error { return m.Stop(ctx, "nosuch", time.Second, false) },
		"Remove": func() error { return m.Remove(ctx, "nosuch") },
		"Pause":  func() error { return m.Pause(ctx, "nosuch") },
		"Resume": func() error { return m.Resume(ctx, "nosuch") },
		"Start":  func() error { return m.Start(ctx, "nosuch") },
		"Logs":   func() error { return m.Logs(ctx, "nosuch", MainLog, -1, false, io.Discard) },
		"SaveSnapshot": func() error {
			_, err := m.SaveSnapshot(ctx, "nosuch", "snap", "", nil)
			return err
		},
		"Fork":             func() error { _, _, err := m.Fork(ctx, "nosuch", 1, nil); return err },
		"SetNetworkPolicy": func() error { return m.SetNetworkPolicy(ctx, "nosuch", nil) },
		"SetHeaderRules":   func() error { return m.SetHeaderRules(ctx, "nosuch", nil) },
	} {
		if err := call(); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "nosuch") {
			t.Errorf("%s(nosuch) = %v; want ErrNotFound naming it", op, err)
		}
	}
	if _, err := m.Get("no/slash"); err == nil || !strings.Contains(err.Error(), "no/slash") {
		t.Errorf("Get(no/slash) = %v; want the name refused", err)
	}
}

// TestManagerSetNetworkPolicy: a sandbox made without the NAT (no
// network, or a tap) gets no policy; one made with it that is not running
// gets the new policy in its record, for its next start, nil meaning
// public-only.
func TestManagerSetNetworkPolicy(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	base := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"true"}}}
	none, tapped, nat := base, base, base
	tapped.Network = &sandbox.NetworkSpec{Tap: &sandbox.TapSpec{Name: "tap0"}}
	nat.Network = &sandbox.NetworkSpec{Policy: netstack.AllowAll()}
	for name, spec := range map[string]sandbox.Spec{"none": none, "tapped": tapped, "nat": nat} {
		if _, err := m.Create(&Record{Name: name, Spec: spec}, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"none", "tapped"} {
		if err := m.SetNetworkPolicy(ctx, name, nil); !errors.Is(err, sandbox.ErrNoNAT) || !strings.Contains(err.Error(), name) {
			t.Errorf("SetNetworkPolicy(%s) = %v; want ErrNoNAT naming it", name, err)
		}
	}
	deny, err := netstack.ParsePolicy("deny-all", []string{"example.com:443"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.SetNetworkPolicy(ctx, "nat", deny); err != nil {
		t.Fatal(err)
	}
	if r, err := m.Get("nat"); err != nil || r.Spec.Network.Policy.String() != deny.String() {
		t.Errorf("the record after SetNetworkPolicy: %v, %v; want %v", r.Spec.Network.Policy, err, deny)
	}
	if err := m.SetNetworkPolicy(ctx, "nat", nil); err != nil {
		t.Fatal(err)
	}
	if r, _ := m.Get("nat"); r.Spec.Network.Policy.String() != netstack.PublicOnly().String() {
		t.Errorf("after SetNetworkPolicy(nil): %v; want public-only", r.Spec.Network.Policy)
	}
}

// TestManagerSetHeaderRules: rules go to the record (names) and the
// secrets file (values) of a sandbox that is not running, for its next
// start, the secrets' own values kept, and nothing else changed when
// they are refused: a sandbox without the NAT, bad rules, and, for one
// to be restored from a snapshot whose guest trusts a CA, a host beyond
// that CA's. None clears them.
func TestManagerSetHeaderRules(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	base := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"true"}}}
	plain, tapped, icpt := base, base, base
	plain.Network = &sandbox.NetworkSpec{Policy: netstack.AllowAll()}
	tapped.Network = &sandbox.NetworkSpec{Tap: &sandbox.TapSpec{Name: "tap0"}}
	icpt.Network = &sandbox.NetworkSpec{Policy: netstack.AllowAll(), Intercept: []string{"api.test"}}
	for name, spec := range map[string]sandbox.Spec{"plain": plain, "tapped": tapped, "icpt": icpt} {
		if _, err := m.Create(&Record{Name: name, Spec: spec}, map[string]string{"KEY": "value"}); err != nil {
			t.Fatal(err)
		}
	}
	rule := func(host string) []sandbox.HeaderRule {
		return []sandbox.HeaderRule{{Host: host, Headers: map[string]string{"authorization": "Bearer x"}}}
	}
	if err := m.SetHeaderRules(ctx, "tapped", rule("api.test")); !errors.Is(err, sandbox.ErrNoNAT) {
		t.Errorf("rules for a tapped sandbox: %v; want ErrNoNAT", err)
	}
	if err := m.SetHeaderRules(ctx, "plain", []sandbox.HeaderRule{{Host: "api.test", Headers: map[string]string{"Host": "x"}}}); err == nil {
		t.Error("a rule setting Host was taken")
	}
	// Never started: its CA is made for its rules when it starts.
	want := []sandbox.HeaderRule{
		{Host: "api.test", Headers: map[string]string{"Authorization": "Bearer x", "X-Team": "blue"}},
		{Host: "*.other.test", Headers: map[string]string{"X-Trace": "1"}},
	}
	given := []sandbox.HeaderRule{
		{Host: " API.test. ", Headers: map[string]string{"authorization": "Bearer x", "x-team": "blue"}},
		{Host: "*.Other.test", Headers: map[string]string{"X-Trace": "1"}},
	}
	if err := m.SetHeaderRules(ctx, "plain", given); err != nil {
		t.Fatal(err)
	}
	got, err := m.HeaderRules("plain")
	if err != nil || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("HeaderRules = %v, %v; want %v (hosts and names in their canonical forms)", got, err, want)
	}
	if secrets, _ := readSecrets(m.st, "plain"); secrets["KEY"] != "value" {
		t.Errorf("the secret's value after SetHeaderRules: %q", secrets["KEY"])
	}
	if r, _ := m.Get("plain"); len(r.Spec.Network.Headers) != 2 || strings.Contains(fmt.Sprint(r.Spec), "Bearer x") {
		t.Errorf("the record's rules: %+v; want two, with no value", r.Spec.Network.Headers)
	}
	if err := m.SetHeaderRules(ctx, "plain", nil); err != nil {
		t.Fatal(err)
	}
	if got, _ := m.HeaderRules("plain"); len(got) != 0 {
		t.Errorf("after clearing: %v", got)
	}
	if secrets, _ := readSecrets(m.st, "plain"); len(secrets) != 1 {
		t.Errorf("the secrets file after clearing the rules: %d keys; want the secret's alone", len(secrets))
	}
	// To be restored from a snapshot whose CA names api.test alone.
	ca, err := tlsproxy.NewCA([]string{"api.test"})
	if err != nil {
		t.Fatal(err)
	}
	caPEM, _ := ca.MarshalPEM()
	snap := filepath.Join(t.TempDir(), "snap")
	err = snapshot.WriteDisk(snap, snapshot.Manifest{Spec: json.RawMessage(`{}`), CPUs: 1, MemoryBytes: 1 << 20, ImageDigest: "sha256:x"}, map[string]snapshot.Extra{
		snapshot.RootDiskFile: func(p string) (string, error) { return "", os.WriteFile(p, nil, 0o600) },
		"tls-ca.pem":          func(p string) (string, error) { return "", os.WriteFile(p, caPEM, 0o600) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.st.Update("icpt", func(r *Record) error { r.RestoreFrom = snap; return nil }); err != nil {
		t.Fatal(err)
	}
	for _, host := range []string{"other.test", "test", "*.test"} {
		if err := m.SetHeaderRules(ctx, "icpt", rule(host)); !errors.Is(err, sandbox.ErrOutsideCA) || !strings.Contains(err.Error(), host) {
			t.Errorf("a rule for %s: %v; want ErrOutsideCA naming it", host, err)
		}
	}
	if r, _ := m.Get("icpt"); len(r.Spec.Network.Headers) != 0 {
		t.Errorf("the record after refused rules: %+v; want none", r.Spec.Network.Headers)
	}
	if err := m.SetHeaderRules(ctx, "icpt", rule("x.api.test")); err != nil {
		t.Errorf("a rule beneath the CA's host: %v", err)
	}
}

// TestManagerResumeCold: a resume without the memory is refused, naming
// why, for a sandbox of no image (nothing to boot from) and for one not
// paused, before anything starts; ResumeCold of an unknown name
// is ErrNotFound.
func TestManagerResumeCold(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	plain := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"true"}}}
	img := plain
	img.Image = &sandbox.ImageSpec{Ref: "example/app:1"}
	for name, spec := range map[string]sandbox.Spec{"plain": plain, "img": img} {
		if _, err := m.Create(&Record{Name: name, Spec: spec}, nil); err != nil {
			t.Fatal(err)
		}
		if err := m.st.Update(name, func(r *Record) error { r.State = Suspended; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.ResumeCold(ctx, "plain"); err == nil || !strings.Contains(err.Error(), "not an image sandbox") {
		t.Errorf("ResumeCold of a sandbox without an image = %v", err)
	}
	if err := m.st.Update("img", func(r *Record) error { r.State = Created; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := m.ResumeCold(ctx, "img"); err == nil || !strings.Contains(err.Error(), "not paused") {
		t.Errorf("ResumeCold of a sandbox not paused = %v", err)
	}
	if r, _ := m.Get("img"); r.Reboot {
		t.Errorf("a refused ResumeCold left Reboot set")
	}
	if err := m.ResumeCold(ctx, "nosuch"); !errors.Is(err, ErrNotFound) {
		t.Errorf("ResumeCold(nosuch) = %v; want ErrNotFound", err)
	}
}

// TestManagerCreateAndStart: Create records a sandbox in state Created
// without starting anything; a second one of the name is ErrExists; only
// a created sandbox starts.
func TestManagerCreateAndStart(t *testing.T) {
	m := newManager(t)
	spec := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"true"}}}
	name, err := m.Create(&Record{Name: "c", Spec: spec}, nil)
	if err != nil || name != "c" {
		t.Fatalf("Create = %q, %v", name, err)
	}
	if r, err := m.Get("c"); err != nil || r.State != Created {
		t.Fatalf("Get(c) = %+v, %v; want state created", r, err)
	}
	if _, err := m.Create(&Record{Name: "c", Spec: spec}, nil); !errors.Is(err, ErrExists) {
		t.Errorf("Create of a taken name = %v; want ErrExists", err)
	}
	named, err := m.Create(&Record{Spec: spec}, nil)
	if err != nil || CheckName(named) != nil {
		t.Errorf("Create without a name = %q, %v; want a new valid name", named, err)
	}
	recs, err := m.List()
	if err != nil || len(recs) != 2 {
		t.Errorf("List = %d records, %v; want 2", len(recs), err)
	}
	// An exited sandbox does not start again (the store refuses before
	// any supervisor is spawned).
	if err := m.st.Update("c", func(r *Record) error { r.State = Exited; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background(), "c"); err == nil || !strings.Contains(err.Error(), "only a created or suspended sandbox starts") {
		t.Errorf("Start of an exited sandbox = %v", err)
	}
}

// TestManagerSnapshotCatalog: the catalog lists only snapshot
// directories, with why one cannot be read; names are checked, a path is
// taken only where allowed, and removing a missing snapshot says so.
func TestManagerSnapshotCatalog(t *testing.T) {
	m := newManager(t)
	if infos, err := m.Snapshots(); err != nil || len(infos) != 0 {
		t.Errorf("Snapshots of a new directory = %v, %v; want none", infos, err)
	}
	if _, err := m.SnapshotDir("../x", false); err == nil {
		t.Error("SnapshotDir(../x) = nil error")
	}
	if _, err := m.SnapshotDir("/some/dir", false); err == nil {
		t.Error("SnapshotDir(a path) where only names are allowed = nil error")
	}
	if d, err := m.SnapshotDir("rel/dir", true); err != nil || !filepath.IsAbs(d) {
		t.Errorf("SnapshotDir(rel/dir, paths allowed) = %q, %v; want an absolute path", d, err)
	}
	d, err := m.SnapshotDir("s1", false)
	if err != nil || filepath.Dir(d) != filepath.Join(m.Dir(), "snapshots") {
		t.Fatalf("SnapshotDir(s1) = %q, %v; want it in the state directory's snapshots", d, err)
	}
	os.MkdirAll(d, 0o700)
	os.MkdirAll(filepath.Join(m.Dir(), "snapshots", ".fork-tmp"), 0o700)
	infos, err := m.Snapshots()
	if err != nil || len(infos) != 1 || infos[0].Name != "s1" || infos[0].Err == "" {
		t.Errorf("Snapshots = %+v, %v; want s1, unreadable, and no hidden directory", infos, err)
	}
	if _, err := m.InspectSnapshot(d, false); err == nil {
		t.Error("InspectSnapshot of an empty directory = nil error")
	}
	if _, err := m.RestoreDir(context.Background(), d, "", "", false, nil, nil); !errors.Is(err, ErrBadSnapshot) {
		t.Errorf("RestoreDir of an empty directory = %v; want ErrBadSnapshot", err)
	}
	if err := m.RemoveSnapshot("nosuch"); err == nil || !strings.Contains(err.Error(), "no snapshot called nosuch") {
		t.Errorf("RemoveSnapshot(nosuch) = %v", err)
	}
	if _, err := m.Restore(context.Background(), "../x", "", "", false, nil, nil); err == nil {
		t.Error("Restore of a bad snapshot name = nil error")
	}
	if _, err := m.Restore(context.Background(), "s1", "bad name", "", false, nil, nil); err == nil || !strings.Contains(err.Error(), "bad name") {
		t.Errorf("Restore as a bad sandbox name = %v", err)
	}
}

// countingListener counts the connections it accepts.
type countingListener struct {
	net.Listener
	n atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// TestManagerStatsKeepsHandles: Stats measures a running sandbox over its
// control socket (served here by the control protocol's own table) and
// keeps the handle, so a second measurement reuses its connection; a
// sandbox started again under the name gets a new one; one paused or
// ended is an error saying so, and its handle is let go.
func TestManagerStatsKeepsHandles(t *testing.T) {
	m := newManager(t)
	lock, err := m.st.Create(&Record{Name: "s", Spec: sandbox.Spec{CPUs: 1, MemoryMiB: 256}})
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	started := time.Now().Add(-time.Minute).Truncate(time.Second)
	setRec := func(state State, at time.Time) {
		t.Helper()
		if err := m.st.Update("s", func(r *Record) error { r.State, r.Started = state, at; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	setRec(Running, started)
	mux := http.NewServeMux()
	var served atomic.Int64
	opStats.register(mux, func(context.Context, noBody) (sandbox.Stats, error) {
		return sandbox.Stats{CPUs: int(served.Add(1))}, nil
	})
	l, err := net.Listen("unix", filepath.Join(m.st.SandboxDir("s"), ControlSocket))
	if err != nil {
		t.Fatal(err)
	}
	cl := &countingListener{Listener: l}
	srv := &http.Server{Handler: mux}
	go srv.Serve(cl)
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := 1; i <= 2; i++ {
		if s, err := m.Stats(ctx, "s"); err != nil || s.CPUs != i {
			t.Fatalf("Stats #%d = %+v, %v; want the server's answer %d", i, s, err, i)
		}
	}
	if n := cl.n.Load(); n != 1 {
		t.Errorf("two measurements made %d connections; want 1, the kept handle's", n)
	}
	setRec(Running, started.Add(time.Second)) // started again under the name
	if _, err := m.Stats(ctx, "s"); err != nil {
		t.Fatal(err)
	}
	if n := cl.n.Load(); n != 2 {
		t.Errorf("a measurement of a sandbox started again made %d connections in all; want a new one (2)", n)
	}
	// Paused, its start unchanged: refused as paused, the handle let go.
	again := started.Add(time.Second)
	setRec(Paused, again)
	if _, err := m.Stats(ctx, "s"); !errors.Is(err, ErrPaused) {
		t.Errorf("Stats of a paused sandbox = %v; want ErrPaused", err)
	}
	setRec(Running, again)
	if _, err := m.Stats(ctx, "s"); err != nil {
		t.Fatal(err)
	}
	setRec(Exited, again)
	if _, err := m.Stats(ctx, "s"); !errors.Is(err, ErrNotRunning) {
		t.Errorf("Stats of an ended sandbox = %v; want ErrNotRunning", err)
	}
	m.stats.mu.Lock()
	_, kept := m.stats.handles["s"]
	m.stats.mu.Unlock()
	if kept {
		t.Error("the ended sandbox's handle is still kept")
	}
}

// TestManagerSuspendedWithoutMemory: a suspended sandbox whose suspension
// holds its disk alone says so; one whose suspension cannot be read, one
// not suspended and an unknown name do not.
func TestManagerSuspendedWithoutMemory(t *testing.T) {
	m := newManager(t)
	spec := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"true"}}}
	if _, err := m.Create(&Record{Name: "s", Spec: spec}, nil); err != nil {
		t.Fatal(err)
	}
	if m.SuspendedWithoutMemory("s") || m.SuspendedWithoutMemory("nosuch") {
		t.Error("a sandbox never suspended, or none, says it is suspended without memory")
	}
	disk := filepath.Join(t.TempDir(), "disk")
	err := snapshot.WriteDisk(disk, snapshot.Manifest{Spec: json.RawMessage(`{}`), CPUs: 1, MemoryBytes: 1 << 20, ImageDigest: "sha256:x"},
		map[string]snapshot.Extra{snapshot.RootDiskFile: func(p string) (string, error) { return "", os.WriteFile(p, nil, 0o600) }})
	if err != nil {
		t.Fatal(err)
	}
	suspend := func(dir string) {
		if err := m.st.Update("s", func(r *Record) error { r.State, r.RestoreFrom = Suspended, dir; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	suspend(disk)
	if !m.SuspendedWithoutMemory("s") {
		t.Error("suspended with its disk alone: SuspendedWithoutMemory = false")
	}
	suspend(filepath.Join(t.TempDir(), "none"))
	if m.SuspendedWithoutMemory("s") {
		t.Error("a suspension that cannot be read says it holds no memory")
	}
}

func TestManagerSetEgressProxy(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	base := sandbox.Spec{CPUs: 1, MemoryMiB: 256, Main: sandbox.ProcessSpec{Argv: []string{"true"}}}
	plain, tapped, none := base, base, base
	plain.Network = &sandbox.NetworkSpec{Policy: netstack.AllowAll()}
	tapped.Network = &sandbox.NetworkSpec{Tap: &sandbox.TapSpec{Name: "tap0"}}
	for name, spec := range map[string]sandbox.Spec{"plain": plain, "tapped": tapped, "none": none} {
		if _, err := m.Create(&Record{Name: name, Spec: spec}, map[string]string{"KEY": "value"}); err != nil {
			t.Fatal(err)
		}
	}
	p := &sandbox.EgressProxy{Address: "192.0.2.1:1080", Username: "agent", Password: "pw-1"}
	for _, name := range []string{"tapped", "none"} {
		if err := m.SetEgressProxy(ctx, name, p); !errors.Is(err, sandbox.ErrNoNAT) {
			t.Errorf("a proxy for %s: %v; want ErrNoNAT", name, err)
		}
		if err := m.SetEgressProxy(ctx, name, nil); err != nil {
			t.Errorf("no proxy for %s, which has none: %v", name, err)
		}
	}
	if err := m.SetEgressProxy(ctx, "plain", &sandbox.EgressProxy{Address: "192.0.2.1:1080", Password: "x"}); err == nil {
		t.Error("a password without a username was taken")
	}
	// Never started: the record and the secrets file take it.
	if err := m.SetEgressProxy(ctx, "plain", p); err != nil {
		t.Fatal(err)
	}
	r, _ := m.Get("plain")
	if got := r.Spec.Network.EgressProxy; got == nil || *got != (sandbox.EgressProxySpec{Address: p.Address, Username: "agent"}) || strings.Contains(fmt.Sprint(r.Spec), "pw-1") {
		t.Errorf("the record's proxy: %+v; want the address and username, no password", got)
	}
	if secrets, _ := readSecrets(m.st, "plain"); secrets["KEY"] != "value" || len(secrets) != 2 {
		t.Errorf("the secrets file: %d keys, KEY %q; want the secret's and the password", len(secrets), secrets["KEY"])
	}
	// The workload of the record, with its secrets, has the password.
	secrets, _ := readSecrets(m.st, "plain")
	w := sandbox.FromSpec(r.Spec).Secrets(secrets)
	if spec, err := w.Spec(); err != nil || spec.Network.EgressProxy == nil {
		t.Errorf("the record's workload: %v, %+v", err, spec.Network)
	}
	if err := m.SetEgressProxy(ctx, "plain", nil); err != nil {
		t.Fatal(err)
	}
	if r, _ := m.Get("plain"); r.Spec.Network.EgressProxy != nil {
		t.Errorf("after clearing: %+v", r.Spec.Network.EgressProxy)
	}
	if secrets, _ := readSecrets(m.st, "plain"); len(secrets) != 1 {
		t.Errorf("the secrets file after clearing the proxy: %d keys; want the secret's alone", len(secrets))
	}
	// Starting (its lock held, its record Creating): waited for, not
	// rewritten behind its back; here it never runs, so ctx ends the wait.
	lock, err := m.st.Start("plain")
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	sctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if err := m.SetEgressProxy(sctx, "plain", p); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a proxy for a sandbox that is starting: %v; want the wait for it to end with ctx", err)
	}
	if err := m.SetHeaderRules(sctx, "plain", nil); err != nil {
		t.Errorf("no header rules for a starting sandbox that has none: %v; want nil, without waiting", err)
	}
	if r, _ := m.st.Get("plain"); r.Spec.Network.EgressProxy != nil {
		t.Errorf("a starting sandbox's record was rewritten: %+v", r.Spec.Network.EgressProxy)
	}
}

// runningSandbox records the sandbox name as running under m's store, its
// liveness lock held, and serves mux on its control socket, as its
// supervisor would, until the test ends.
func runningSandbox(t *testing.T, m *Manager, name string, spec sandbox.Spec, mux *http.ServeMux) {
	t.Helper()
	lock, err := m.st.Create(&Record{Name: name, Spec: spec})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lock.Close() })
	if err := m.st.Update(name, func(r *Record) error { r.State, r.Started = Running, time.Now(); return nil }); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", filepath.Join(m.st.SandboxDir(name), ControlSocket))
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
}

// TestManagerSettingsOneAtATime: changes of one running sandbox's header
// rules made at once by two managers (two front ends' processes, as far
// as the store can tell) reach the sandbox and its record in the same
// order, so that the record and the secrets file end with the rules the
// sandbox took last. The sandbox's control socket is served here by the
// control protocol's own table, answering the first change of each round
// slowly: without the settings lock, the second is answered first and
// recorded first, and the record ends with the change the sandbox took
// first.
func TestManagerSettingsOneAtATime(t *testing.T) {
	dir := t.TempDir()
	m1, err := OpenManager(dir)
	if err != nil {
		t.Fatal(err)
	}
	m2, err := OpenManager(dir)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var last string // the rules the sandbox took last (their X-Turn)
	var calls int
	mux := http.NewServeMux()
	opHeaders.register(mux, func(_ context.Context, req headersBody) (noBody, error) {
		mu.Lock()
		last = ""
		if len(req.Rules) == 1 {
			last = req.Rules[0].Headers["X-Turn"]
		}
		calls++
		slow := calls%2 == 1
		mu.Unlock()
		if slow {
			time.Sleep(100 * time.Millisecond)
		}
		return noBody{}, nil
	})
	runningSandbox(t, m1, "s", sandbox.Spec{CPUs: 1, MemoryMiB: 256, Network: &sandbox.NetworkSpec{Policy: netstack.AllowAll()}}, mux)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for round := range 4 {
		var wg sync.WaitGroup
		errs := make(chan error, 2)
		for i, m := range []*Manager{m1, m2} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				turn := fmt.Sprintf("%d.%d", round, i)
				rules := []sandbox.HeaderRule{{Host: "api.test", Headers: map[string]string{"X-Turn": turn}}}
				if err := m.SetHeaderRules(ctx, "s", rules); err != nil {
					errs <- err
				}
			}()
			time.Sleep(10 * time.Millisecond) // the second comes while the first is answered
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		got, err := m1.HeaderRules("s")
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		want := last
		mu.Unlock()
		if len(got) != 1 || got[0].Headers["X-Turn"] != want {
			t.Fatalf("round %d: the record's rules after two changes at once: %+v; want the one the sandbox took last, X-Turn %q", round, got, want)
		}
	}
}

// TestManagerUpdateNetwork: a proxy and a policy changed together reach a
// running sandbox in the order that lets nothing out directly that either
// would tunnel (a new proxy before the policy, a proxy taken away after
// it), and a step that fails says which were made before it. The
// sandbox's control socket is served here by the control protocol's own
// table.
func TestManagerUpdateNetwork(t *testing.T) {
	m := newManager(t)
	var mu sync.Mutex
	var order []string
	var refuse atomic.Bool
	mux := http.NewServeMux()
	opNetwork.register(mux, func(_ context.Context, req networkBody) (noBody, error) {
		if refuse.Load() {
			return noBody{}, errors.New("refused here")
		}
		mu.Lock()
		defer mu.Unlock()
		order = append(order, "policy "+req.Policy.String())
		return noBody{}, nil
	})
	opEgress.register(mux, func(_ context.Context, req egressBody) (noBody, error) {
		mu.Lock()
		defer mu.Unlock()
		via := "none"
		if req.Proxy != nil {
			via = req.Proxy.Address
		}
		order = append(order, "proxy "+via)
		return noBody{}, nil
	})
	runningSandbox(t, m, "s", sandbox.Spec{CPUs: 1, MemoryMiB: 256, Network: &sandbox.NetworkSpec{Policy: netstack.PublicOnly()}}, mux)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	taken := func() []string {
		mu.Lock()
		defer mu.Unlock()
		o := order
		order = nil
		return o
	}
	p := &sandbox.EgressProxy{Address: "192.0.2.1:1080"}
	if err := m.UpdateNetwork(ctx, "s", NetworkUpdate{Policy: netstack.AllowAll(), SetProxy: true, Proxy: p}); err != nil {
		t.Fatal(err)
	}
	if got, want := taken(), []string{"proxy 192.0.2.1:1080", "policy allow-all"}; !slices.Equal(got, want) {
		t.Errorf("a proxy set with a policy reached the sandbox as %q; want %q", got, want)
	}
	if err := m.UpdateNetwork(ctx, "s", NetworkUpdate{Policy: netstack.DenyAll(), SetProxy: true}); err != nil {
		t.Fatal(err)
	}
	if got, want := taken(), []string{"policy deny-all", "proxy none"}; !slices.Equal(got, want) {
		t.Errorf("a proxy taken away with a policy reached the sandbox as %q; want %q", got, want)
	}
	if r, _ := m.Get("s"); r.Spec.Network.EgressProxy != nil || r.Spec.Network.Policy.String() != "deny-all" {
		t.Errorf("the record after both: %+v, %s", r.Spec.Network.EgressProxy, r.Spec.Network.Policy)
	}
	// Another change under way (its settings lock held): waited for.
	held, err := m.st.SettingsLock(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancelShort()
	if err := m.SetNetworkPolicy(short, "s", netstack.AllowAll()); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a policy while another change holds the settings lock: %v; want the wait ended by ctx", err)
	}
	if err := m.UpdateNetwork(short, "s", NetworkUpdate{SetProxy: true, Proxy: p}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("an update while another change holds the settings lock: %v; want the wait ended by ctx", err)
	}
	// A malformed proxy is refused at once, not after the wait.
	bad := &sandbox.EgressProxy{Address: "192.0.2.1:1080", Password: "x"}
	if err := m.SetEgressProxy(short, "s", bad); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a password without a username while the lock is held: %v; want it refused without waiting", err)
	}
	var step *NetworkStepError
	if err := m.UpdateNetwork(short, "s", NetworkUpdate{SetProxy: true, Proxy: bad}); !errors.As(err, &step) || step.Step != StepProxy || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("an update with a malformed proxy while the lock is held: %v; want the proxy step refused without waiting", err)
	}
	held.Close()
	if got := taken(); len(got) != 0 {
		t.Errorf("changes that waited for the lock in vain reached the sandbox: %q", got)
	}
	refuse.Store(true)
	err = m.UpdateNetwork(ctx, "s", NetworkUpdate{Policy: netstack.AllowAll(), SetProxy: true, Proxy: p})
	if !errors.As(err, &step) || step.Step != StepPolicy || !slices.Equal(step.Made, []string{StepProxy}) ||
		!strings.Contains(err.Error(), "refused here") || !strings.Contains(err.Error(), "the egress proxy was changed before this") {
		t.Errorf("a policy refused after the proxy was set: %v; want the refusal, saying the proxy was changed", err)
	}
}
