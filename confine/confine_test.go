package confine

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/kvm"
)

// childEnv makes the test binary the confined child: it applies the layer
// named, tries each call of calls() and prints what each got, as JSON.
const childEnv = "CONFINE_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "jail" {
		os.Exit(jailChild())
	}
	if os.Getenv(childEnv) == "follow-host" {
		os.Exit(followHost())
	}
	if os.Getenv(childEnv) == "follow-jail" {
		os.Exit(followJail())
	}
	if os.Getenv(childEnv) == "caps" {
		os.Exit(capsChild())
	}
	if layer := os.Getenv(childEnv); layer != "" {
		os.Exit(child(layer))
	}
	os.Exit(m.Run())
}

// recorder returns what a confined child calls with each thing it tried
// and the error it got: got[name] becomes "ok" or the error's text, which
// the child prints for the test.
func recorder(got map[string]string) func(name string, err error) {
	return func(name string, err error) {
		got[name] = "ok"
		if err != nil {
			got[name] = err.Error()
		}
	}
}

// attempt is one call the child tries: its name, and the call.
type attempt struct {
	name string
	call func() error
}

func sys(nr uintptr, a ...uintptr) func() error {
	return func() error {
		var args [6]uintptr
		copy(args[:], a)
		_, _, e := unix.Syscall6(nr, args[0], args[1], args[2], args[3], args[4], args[5])
		if e != 0 {
			return e
		}
		return nil
	}
}

func calls(dir string) []attempt {
	return []attempt{
		// Allowed.
		{"getpid", sys(unix.SYS_GETPID)},
		{"file write and read", func() error {
			p := filepath.Join(dir, "f")
			if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
				return err
			}
			_, err := os.ReadFile(p)
			return err
		}},
		{"rename across directories", func() error {
			// What a guest's mv a/f b/f in a share asks of the VMM
			// (Landlock's "refer" right).
			a, b := filepath.Join(dir, "ra"), filepath.Join(dir, "rb")
			for _, d := range []string{a, b} {
				if err := os.MkdirAll(d, 0o700); err != nil {
					return err
				}
			}
			if err := os.WriteFile(filepath.Join(a, "f"), nil, 0o600); err != nil {
				return err
			}
			return os.Rename(filepath.Join(a, "f"), filepath.Join(b, "f"))
		}},
		{"tcp socket", func() error {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
			unix.Close(fd)
			return err
		}},
		{"unix socket", func() error {
			fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
			unix.Close(fd)
			return err
		}},
		{"udp socket, as Go's net makes it", func() error {
			fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
			unix.Close(fd)
			return err
		}},
		{"netlink route socket (the host's addresses)", func() error {
			fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
			unix.Close(fd)
			return err
		}},
		{"signal to itself", func() error { return unix.Tgkill(os.Getpid(), unix.Gettid(), 0) }},
		{"mmap rw", func() error {
			b, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
			if err == nil {
				unix.Munmap(b)
			}
			return err
		}},
		{"new threads", func() error {
			var wg sync.WaitGroup
			for i := 0; i < 8; i++ {
				wg.Add(1)
				go func() { runtime.LockOSThread(); wg.Done() }() // the thread exits with the goroutine
			}
			wg.Wait()
			return nil
		}},
		{"KVM_RUN on a file", func() error {
			f, err := os.Create(filepath.Join(dir, "g"))
			if err != nil {
				return err
			}
			defer f.Close()
			_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), 0xAE80, 0)
			if e == unix.ENOTTY || e == unix.EINVAL {
				return nil // reached the kernel, which refused it for what it is
			}
			return e
		}},
		{"KVM_GET_CLOCK on a file", func() error {
			f, err := os.Create(filepath.Join(dir, "h"))
			if err != nil {
				return err
			}
			defer f.Close()
			_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(kvm.RunningIoctls()[len(kvm.RunningIoctls())-1]), 0)
			if e == unix.ENOTTY || e == unix.EINVAL || e == unix.EFAULT {
				return nil
			}
			return e
		}},
		// Refused.
		{"execve", func() error { return unix.Exec("/bin/true", []string{"true"}, nil) }},
		{"fork", func() error {
			_, err := syscall.ForkExec("/bin/true", []string{"true"}, nil)
			return err
		}},
		{"ptrace", sys(unix.SYS_PTRACE, unix.PTRACE_TRACEME)},
		{"mount", func() error { return unix.Mount("none", dir, "tmpfs", 0, "") }},
		{"mmap exec", func() error {
			_, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_EXEC, unix.MAP_PRIVATE|unix.MAP_ANON)
			return err
		}},
		{"packet socket", func() error {
			_, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
			return err
		}},
		{"raw IPv4 socket", func() error {
			_, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_ICMP)
			return err
		}},
		{"raw IPv6 socket", func() error {
			_, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_RAW)
			return err
		}},
		{"netlink socket of another protocol", func() error {
			_, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_AUDIT)
			return err
		}},
		{"KVM_CREATE_VM", sys(unix.SYS_IOCTL, 0, 0xAE01)},
		{"kill another process", func() error { return unix.Kill(os.Getppid(), 0) }},
		{"bpf", sys(unix.SYS_BPF)},
		{"perf_event_open", sys(unix.SYS_PERF_EVENT_OPEN)},
		{"process_vm_readv", sys(unix.SYS_PROCESS_VM_READV, uintptr(os.Getppid()))},
		{"unshare", func() error { return unix.Unshare(unix.CLONE_NEWUSER) }},
		{"setrlimit", func() error {
			return unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 64, Max: 64})
		}},
	}
}

func child(layer string) int {
	dir := os.Getenv("CONFINE_TEST_DIR")
	var err error
	switch layer {
	case "seccomp":
		err = installSeccomp(os.Getpid(), false)
	case "all":
		_, err = Apply(Config{Write: []string{dir}, Name: "test"}, slog.New(slog.DiscardHandler))
	}
	if err != nil {
		fmt.Println(err)
		return 3
	}
	got := map[string]string{}
	try := recorder(got)
	for _, a := range calls(dir) {
		try(a.name, a.call())
	}
	if layer == "all" {
		_, err := os.ReadFile(os.Getenv("CONFINE_TEST_OUTSIDE"))
		try("read outside", err)
	}
	json.NewEncoder(os.Stdout).Encode(got)
	return 0
}

// runChild runs the test binary as a child confined by layer and returns
// what each call got.
func runChild(t *testing.T, layer string, env ...string) map[string]string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append([]string{childEnv + "=" + layer, "CONFINE_TEST_DIR=" + t.TempDir()}, env...)...)
	return childResult(t, cmd, "the confined child")
}

// childResult runs cmd, a child of this test binary, and decodes what it
// printed: what it found, by name; who names the child in failures.
func childResult(t *testing.T, cmd *exec.Cmd, who string) map[string]string {
	t.Helper()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v\n%s", who, err, out)
	}
	got := map[string]string{}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%s printed %q: %v", who, out, err)
	}
	return got
}

// TestSeccompAllowlist runs a child that installs the filter and tries
// what a VMM does and what it must not.
func TestSeccompAllowlist(t *testing.T) {
	if !seccomp.Supported() {
		t.Skip("no seccomp on this host")
	}
	got := runChild(t, "seccomp")
	allowed := []string{"getpid", "file write and read", "rename across directories", "tcp socket", "mmap rw", "new threads", "KVM_RUN on a file", "KVM_GET_CLOCK on a file", "unix socket", "udp socket, as Go's net makes it", "netlink route socket (the host's addresses)", "signal to itself"}
	for _, name := range allowed {
		if got[name] != "ok" {
			t.Errorf("confined %s = %q, want ok", name, got[name])
		}
	}
	for _, a := range calls("") {
		if slicesContains(allowed, a.name) {
			continue
		}
		if got[a.name] != unix.EPERM.Error() {
			t.Errorf("confined %s = %q, want %q", a.name, got[a.name], unix.EPERM.Error())
		}
	}
}

func slicesContains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// TestApply: with every layer, files outside what was given are out of
// reach where the host has Landlock.
func TestApply(t *testing.T) {
	if !seccomp.Supported() {
		t.Skip("no seccomp on this host")
	}
	outside := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(outside, []byte("s"), 0o600); err != nil {
		t.Fatal(err)
	}
	got := runChild(t, "all", "CONFINE_TEST_OUTSIDE="+outside)
	if got["file write and read"] != "ok" || got["execve"] != unix.EPERM.Error() {
		t.Errorf("confined child: write in its directory %q, execve %q; want ok, EPERM", got["file write and read"], got["execve"])
	}
	abi, err := landlockABI()
	if (err != nil || abi >= 2) && got["rename across directories"] != "ok" {
		t.Errorf("confined child: rename between two directories it may write = %q, want ok", got["rename across directories"])
	}
	if err != nil {
		t.Logf("no Landlock here (%v): reading outside = %q", err, got["read outside"])
		return
	}
	if !strings.Contains(got["read outside"], "permission denied") {
		t.Errorf("confined child reading %s = %q, want permission denied", outside, got["read outside"])
	}
}

// TestPolicyAssembles: every name in the allowlist is a system call of
// this architecture, and the program fits a BPF filter.
func TestPolicyAssembles(t *testing.T) {
	p := Policy(1234, true)
	insts, err := p.Assemble()
	if err != nil {
		t.Fatalf("Policy.Assemble() = %v", err)
	}
	if len(insts) > 4096 {
		t.Errorf("the filter has %d instructions, more than BPF's 4096", len(insts))
	}
	if errors.Is(err, errUnavailable) {
		t.Fatal("unreachable")
	}
}
