package agent

import (
	"encoding/binary"
	"strings"
	"testing"

	seccompprofile "github.com/containerd/containerd/contrib/seccomp"
	"github.com/elastic/go-seccomp-bpf/arch"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// call is a system call as the filter sees it.
type call struct {
	arch uint32
	nr   uint32
	args [6]uint64
}

// run executes the compiled filter on c in x/net/bpf's interpreter, which
// loads words big-endian: each 32-bit field is written so, at the offset
// the kernel's little-endian seccomp_data has it.
func run(t *testing.T, prog []bpf.Instruction, c call) uint32 {
	t.Helper()
	vm, err := bpf.NewVM(prog)
	if err != nil {
		t.Fatalf("the filter does not load: %v", err)
	}
	in := make([]byte, 64)
	binary.BigEndian.PutUint32(in[offNr:], c.nr)
	binary.BigEndian.PutUint32(in[offArch:], c.arch)
	for i, a := range c.args {
		binary.BigEndian.PutUint32(in[offArgs+8*i:], uint32(a))
		binary.BigEndian.PutUint32(in[offArgs+8*i+4:], uint32(a>>32))
	}
	out, err := vm.Run(in)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	return uint32(out)
}

func x64(nr uintptr, args ...uint64) call {
	c := call{arch: unix.AUDIT_ARCH_X86_64, nr: uint32(nr)}
	copy(c.args[:], args)
	return c
}

// toAgent is the shim's mapping, written again here (the agent does not
// import the shim).
func toAgent(sc *specs.LinuxSeccomp) *Seccomp {
	out := &Seccomp{DefaultAction: string(sc.DefaultAction), DefaultErrno: sc.DefaultErrnoRet}
	for _, r := range sc.Syscalls {
		rule := SeccompRule{Names: r.Names, Action: string(r.Action), Errno: r.ErrnoRet}
		for _, a := range r.Args {
			rule.Args = append(rule.Args, SeccompArg{Index: a.Index, Value: a.Value, ValueTwo: a.ValueTwo, Op: string(a.Op)})
		}
		out.Rules = append(out.Rules, rule)
	}
	return out
}

const (
	allow  = unix.SECCOMP_RET_ALLOW
	eperm  = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
	enosys = unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)
)

// TestSeccompContainerdDefault runs containerd's default profile (what
// Kubernetes' RuntimeDefault gives a container without CAP_SYS_ADMIN)
// through the compiled filter, call by call.
func TestSeccompContainerdDefault(t *testing.T) {
	spec := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_NET_BIND_SERVICE"}}}}
	prog, err := toAgent(seccompprofile.DefaultProfile(spec)).compile()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("containerd's default profile: %d instructions", len(prog))
	const thread = unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD | unix.CLONE_SYSVSEM
	for _, tc := range []struct {
		name string
		c    call
		want uint32
	}{
		{"read", x64(unix.SYS_READ, 0, 0, 10), allow},
		{"execve", x64(unix.SYS_EXECVE), allow},
		{"clone of a thread", x64(unix.SYS_CLONE, thread), allow},
		{"clone into a new user namespace", x64(unix.SYS_CLONE, unix.CLONE_NEWUSER|uint64(unix.SIGCHLD)), eperm},
		{"clone into a new mount namespace", x64(unix.SYS_CLONE, unix.CLONE_NEWNS), eperm},
		{"clone3 (ENOSYS: the C library falls back to clone)", x64(unix.SYS_CLONE3), enosys},
		{"unshare", x64(unix.SYS_UNSHARE, unix.CLONE_NEWUSER), eperm},
		{"mount", x64(unix.SYS_MOUNT), eperm},
		{"keyctl", x64(unix.SYS_KEYCTL), eperm},
		{"personality(PER_LINUX)", x64(unix.SYS_PERSONALITY, 0), allow},
		{"personality(query)", x64(unix.SYS_PERSONALITY, 0xffffffff), allow},
		{"personality(other)", x64(unix.SYS_PERSONALITY, 0x0400000), eperm},
		{"personality with high bits", x64(unix.SYS_PERSONALITY, 1<<32), eperm},
		{"an i386 call", call{arch: unix.AUDIT_ARCH_I386, nr: 3}, enosys},
		{"an x32 call", x64(x32Bit | unix.SYS_READ), enosys},
		{"a number no kernel has", x64(999), eperm},
	} {
		if got := run(t, prog, tc.c); got != tc.want {
			t.Errorf("%s: filter returns %#x, want %#x", tc.name, got, tc.want)
		}
	}
}

// TestSeccompComparisons checks each comparison at and around its value,
// across the 32-bit halves the filter compares separately.
func TestSeccompComparisons(t *testing.T) {
	const v = 0x1_0000_0005
	values := []uint64{0, 4, 5, 6, 0xffff_ffff, 1 << 32, v - 1, v, v + 1, 0x2_0000_0000, 0x1_0000_0000_0000, ^uint64(0)}
	for op, want := range map[string]func(a uint64) bool{
		"SCMP_CMP_EQ":        func(a uint64) bool { return a == v },
		"SCMP_CMP_NE":        func(a uint64) bool { return a != v },
		"SCMP_CMP_GT":        func(a uint64) bool { return a > v },
		"SCMP_CMP_GE":        func(a uint64) bool { return a >= v },
		"SCMP_CMP_LT":        func(a uint64) bool { return a < v },
		"SCMP_CMP_LE":        func(a uint64) bool { return a <= v },
		"SCMP_CMP_MASKED_EQ": func(a uint64) bool { return a&0xff_0000_00ff == 0x1_0000_0005 },
	} {
		arg := SeccompArg{Index: 2, Value: v, Op: op}
		if op == "SCMP_CMP_MASKED_EQ" {
			arg = SeccompArg{Index: 2, Value: 0xff_0000_00ff, ValueTwo: 0x1_0000_0005, Op: op}
		}
		s := &Seccomp{DefaultAction: "SCMP_ACT_ERRNO", Rules: []SeccompRule{{Names: []string{"ioctl"}, Action: "SCMP_ACT_ALLOW", Args: []SeccompArg{arg}}}}
		prog, err := s.compile()
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range append(values, 0x1_0000_0105, 0x11_0000_0005) {
			got := run(t, prog, x64(unix.SYS_IOCTL, 0, 0, a)) == allow
			if got != want(a) {
				t.Errorf("%s %#x: arg %#x matched %v, want %v", op, v, a, got, want(a))
			}
		}
	}
}

// TestSeccompRules: all of a rule's arguments must match, except where an
// index repeats (any of them); argument rules of one call are tried in
// turn, then its unconditional rule; errno values are each rule's.
func TestSeccompRules(t *testing.T) {
	errno := func(e uint) *uint { return &e }
	s := &Seccomp{DefaultAction: "SCMP_ACT_ERRNO", DefaultErrno: errno(uint(unix.EACCES)), Rules: []SeccompRule{
		{Names: []string{"socket"}, Action: "SCMP_ACT_ERRNO", Errno: errno(uint(unix.EAFNOSUPPORT)), Args: []SeccompArg{
			{Index: 0, Value: unix.AF_VSOCK, Op: "SCMP_CMP_EQ"}}},
		{Names: []string{"socket"}, Action: "SCMP_ACT_ALLOW"},
		{Names: []string{"kill"}, Action: "SCMP_ACT_ALLOW", Args: []SeccompArg{
			{Index: 0, Value: 1, Op: "SCMP_CMP_GT"}, {Index: 1, Value: 9, Op: "SCMP_CMP_NE"}}},
		{Names: []string{"fcntl"}, Action: "SCMP_ACT_ALLOW", Args: []SeccompArg{
			{Index: 1, Value: 1, Op: "SCMP_CMP_EQ"}, {Index: 1, Value: 3, Op: "SCMP_CMP_EQ"}}},
		{Names: []string{"getpid", "no_such_call_anywhere"}, Action: "SCMP_ACT_KILL_PROCESS"},
	}}
	prog, err := s.compile()
	if err != nil {
		t.Fatal(err)
	}
	eacces := unix.SECCOMP_RET_ERRNO | uint32(unix.EACCES)
	for _, tc := range []struct {
		name string
		c    call
		want uint32
	}{
		{"socket(AF_VSOCK)", x64(unix.SYS_SOCKET, unix.AF_VSOCK), unix.SECCOMP_RET_ERRNO | uint32(unix.EAFNOSUPPORT)},
		{"socket(AF_INET)", x64(unix.SYS_SOCKET, unix.AF_INET), allow},
		{"kill(2, SIGTERM)", x64(unix.SYS_KILL, 2, 15), allow},
		{"kill(2, SIGKILL)", x64(unix.SYS_KILL, 2, 9), eacces},
		{"kill(1, SIGTERM)", x64(unix.SYS_KILL, 1, 15), eacces},
		{"fcntl(F_GETFD)", x64(unix.SYS_FCNTL, 0, 1), allow},
		{"fcntl(F_GETFL)", x64(unix.SYS_FCNTL, 0, 3), allow},
		{"fcntl(F_SETFL)", x64(unix.SYS_FCNTL, 0, 4), eacces},
		{"getpid", x64(unix.SYS_GETPID), unix.SECCOMP_RET_KILL_PROCESS},
		{"read", x64(unix.SYS_READ), eacces},
	} {
		if got := run(t, prog, tc.c); got != tc.want {
			t.Errorf("%s: filter returns %#x, want %#x", tc.name, got, tc.want)
		}
	}
}

func TestSeccompRefuses(t *testing.T) {
	big := make([]string, 0, 600)
	for name := range arch.X86_64.SyscallNames {
		big = append(big, name)
	}
	for _, tc := range []struct {
		name, want string
		s          Seccomp
	}{
		{"unknown default", "default action", Seccomp{DefaultAction: "SCMP_ACT_MAYBE"}},
		{"notify", "SCMP_ACT_NOTIFY", Seccomp{DefaultAction: "SCMP_ACT_ALLOW", Rules: []SeccompRule{{Names: []string{"read"}, Action: "SCMP_ACT_NOTIFY"}}}},
		{"errno too big", "errno 70000", Seccomp{DefaultAction: "SCMP_ACT_ERRNO", DefaultErrno: new(uint(70000))}},
		{"argument index", "index 6", Seccomp{DefaultAction: "SCMP_ACT_ALLOW", Rules: []SeccompRule{{Names: []string{"read"}, Action: "SCMP_ACT_ERRNO", Args: []SeccompArg{{Index: 6, Op: "SCMP_CMP_EQ"}}}}}},
		{"comparison", "SCMP_CMP_SOMETIMES", Seccomp{DefaultAction: "SCMP_ACT_ALLOW", Rules: []SeccompRule{{Names: []string{"read"}, Action: "SCMP_ACT_ERRNO", Args: []SeccompArg{{Op: "SCMP_CMP_SOMETIMES"}}}}}},
		{"flag", "SECCOMP_FILTER_FLAG_TSYNC", Seccomp{DefaultAction: "SCMP_ACT_ALLOW", Flags: []string{"SECCOMP_FILTER_FLAG_TSYNC"}}},
		{"two actions", "two unconditional actions", Seccomp{DefaultAction: "SCMP_ACT_ALLOW", Rules: []SeccompRule{
			{Names: []string{"read"}, Action: "SCMP_ACT_ERRNO"}, {Names: []string{"read"}, Action: "SCMP_ACT_KILL"}}}},
		{"too long", "more than the kernel's 4096", Seccomp{DefaultAction: "SCMP_ACT_ALLOW", Rules: manyArgRules(big)}},
	} {
		if err := tc.s.Check(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Check = %v, want an error naming %q", tc.name, err, tc.want)
		}
	}
}

// manyArgRules gives every call six comparisons (37 instructions each).
func manyArgRules(names []string) []SeccompRule {
	args := make([]SeccompArg, 6)
	for i := range args {
		args[i] = SeccompArg{Index: uint(i), Op: "SCMP_CMP_LE", Value: 7}
	}
	return []SeccompRule{{Names: names, Action: "SCMP_ACT_ERRNO", Args: args}}
}

// FuzzSeccompCompile: any profile either compiles to a filter the
// interpreter accepts, within the kernel's bound, or is refused.
func FuzzSeccompCompile(f *testing.F) {
	f.Add("SCMP_ACT_ERRNO", "clone", "SCMP_CMP_MASKED_EQ", uint(0), uint64(0x7e020000), uint64(0), uint8(2), uint(1))
	f.Add("SCMP_ACT_ALLOW", "socket", "SCMP_CMP_EQ", uint(0), uint64(40), uint64(0), uint8(1), uint(97))
	f.Fuzz(func(t *testing.T, act, name, op string, index uint, v, v2 uint64, nrules uint8, errno uint) {
		s := &Seccomp{DefaultAction: act, DefaultErrno: &errno}
		for i := 0; i < int(nrules%8); i++ {
			s.Rules = append(s.Rules, SeccompRule{Names: []string{name, "read"}, Action: "SCMP_ACT_ALLOW",
				Args: []SeccompArg{{Index: index, Value: v, ValueTwo: v2, Op: op}, {Index: uint(i) % 7, Value: v2, Op: "SCMP_CMP_GE"}}})
		}
		prog, err := s.compile()
		if err != nil {
			return
		}
		if len(prog) > bpfMaxInstructions {
			t.Fatalf("%d instructions", len(prog))
		}
		if _, err := bpf.Assemble(prog); err != nil {
			t.Fatalf("assemble: %v", err)
		}
		run(t, prog, x64(unix.SYS_READ, v, v2))
	})
}
