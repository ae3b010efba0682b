package supervisor

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
)

// TestJailCommand: both kinds of VMM process are started for the jail the
// same way: in a new mount namespace, with their temporary directory,
// keeping what the caller set (a supervisor's session, its environment).
func TestJailCommand(t *testing.T) {
	cmd := exec.Command("/bin/true")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	jailCommand(cmd, "/state/sandboxes/a/tmp")
	if cmd.SysProcAttr.Cloneflags&syscall.CLONE_NEWNS == 0 || !cmd.SysProcAttr.Setsid {
		t.Errorf("SysProcAttr = %+v; want a new mount namespace and the session kept", cmd.SysProcAttr)
	}
	if got := cmd.Env[len(cmd.Env)-1]; got != "TMPDIR=/state/sandboxes/a/tmp" {
		t.Errorf("the last of the environment is %q; want TMPDIR, which overrides the caller's", got)
	}
	if len(cmd.Env) < len(os.Environ()) {
		t.Errorf("the environment lost the caller's: %d entries, the caller has %d", len(cmd.Env), len(os.Environ()))
	}

	fg := exec.Command("/bin/true")
	fg.Env = []string{"A=1"}
	jailCommand(fg, "/tmp/capsa-run-1", foregroundJailEnv+"=/tmp/capsa-run-1")
	if want := []string{"A=1", foregroundJailEnv + "=/tmp/capsa-run-1", "TMPDIR=/tmp/capsa-run-1"}; !slices.Equal(fg.Env, want) {
		t.Errorf("a foreground run's environment = %q; want %q", fg.Env, want)
	}
	if fg.SysProcAttr == nil || fg.SysProcAttr.Cloneflags&syscall.CLONE_NEWNS == 0 {
		t.Errorf("a foreground run's SysProcAttr = %+v; want a new mount namespace", fg.SysProcAttr)
	}
}

// TestVMMPlaces: a supervisor and a foreground run are confined by one
// rule (vmmProcess.config) and differ only in their place: the
// supervisor also writes and owns its sandbox's directory and writes the
// store's snapshots, never the records' database; a foreground run
// writes nothing of the store's but the hub's files its sandbox uses.
func TestVMMPlaces(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	user := &JailUser{UID: 1000, GID: 1000}
	rec := &store.Record{Name: "a", JailUser: user}
	spec := sandbox.Spec{MemoryMiB: 256}
	hub := filepath.Join(st.Dir(), "hub.db")
	read, write := []string{"/src"}, []string{"/work", hub}

	sup := (&vmmProcess{place: place(st, rec)}).config(read, write, true, spec)
	dir, snaps := st.SandboxDir("a"), st.SnapshotsDir()
	if !slices.Contains(sup.Write, dir) || !slices.Contains(sup.Write, snaps) || !slices.Contains(sup.Write, "/work") {
		t.Errorf("a supervisor writes %q; want its sandbox's paths, its directory and the snapshots", sup.Write)
	}
	for _, p := range sup.Write {
		if strings.HasSuffix(p, "state.db") {
			t.Errorf("a supervisor writes the records' database %s", p)
		}
	}
	if !slices.Equal(sup.Own, []string{dir}) || sup.User != user || sup.Name != "a" || sup.Follow != nil || !sup.HostFiles {
		t.Errorf("a supervisor's config = %+v; want its directory its own, its user, its name, jailed", sup)
	}
	if !slices.Contains(sup.Shared, hub) || !slices.Contains(sup.Shared, snaps) {
		t.Errorf("a supervisor's jail user is let into %q; want the hub's file and the snapshots", sup.Shared)
	}
	if want := int64(256<<20) + VMMOverhead; sup.MemoryBytes != want {
		t.Errorf("a supervisor's memory bound = %d; want %d", sup.MemoryBytes, want)
	}
	pod := (&vmmProcess{place: place(st, &store.Record{Name: "p", HostMounts: true})}).config(read, write, true, spec)
	if !slices.Equal(pod.Follow, write) {
		t.Errorf("a pod's supervisor (host mounts) follows the host's mounts beneath %q; want its sandbox's writable paths %q", pod.Follow, write)
	}

	fg := (&vmmProcess{place: vmmPlace{Name: "run", User: user, StateDir: st.Dir(), Own: []string{"/tmp/capsa-run-1"}, Terminal: true}}).config(read, write, true, spec)
	if !slices.Equal(fg.Write, write) || !slices.Equal(fg.Read, read) {
		t.Errorf("a foreground run reads %q and writes %q; want only its sandbox's %q and %q", fg.Read, fg.Write, read, write)
	}
	if !slices.Equal(fg.Shared, []string{hub}) || !fg.Terminal || fg.MemoryBytes != sup.MemoryBytes {
		t.Errorf("a foreground run's config = %+v; want the hub's file shared, the terminal kept, the supervisor's memory bound", fg)
	}
}

// TestForegroundNeedsJail: a foreground run starts itself again in a
// mount namespace only when it is to be jailed (confined, as root) and is
// not already the process started so.
func TestForegroundNeedsJail(t *testing.T) {
	t.Setenv(foregroundJailEnv, "")
	if (Foreground{NoConfine: true}).NeedsJail() {
		t.Error("an unconfined run needs a jail")
	}
	if got, want := (Foreground{}).NeedsJail(), os.Geteuid() == 0; got != want {
		t.Errorf("a confined run as uid %d: NeedsJail = %v; want %v", os.Geteuid(), got, want)
	}
	t.Setenv(foregroundJailEnv, t.TempDir())
	if (Foreground{}).NeedsJail() {
		t.Error("the process started in its own mount namespace needs another")
	}
}

// TestQuitCatcherBeforeTheVM: a SIGQUIT before any sandbox is watched
// (a boot that hangs) is answered with the process's goroutines, and the
// process goes on instead of dying of it.
func TestQuitCatcherBeforeTheVM(t *testing.T) {
	got := make(chan string, 1)
	q := CatchQuit(func(state string) { got <- state })
	defer q.Stop()
	if err := syscall.Kill(os.Getpid(), syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if !strings.HasPrefix(s, "no VM runs; the process's goroutines:") || !strings.Contains(s, "TestQuitCatcherBeforeTheVM") {
			t.Errorf("on SIGQUIT before the VM: %.200q; want the goroutines, this test's among them", s)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no answer to SIGQUIT")
	}
}
