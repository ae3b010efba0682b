package agent

// A container's seccomp profile (the OCI spec's linux.seccomp, which
// containerd fills with its default profile for Kubernetes' RuntimeDefault
// and `ctr run --seccomp`), compiled to a classic BPF filter the
// container-exec helper loads on the thread that executes the process.
// Its starting point is what runc does with libseccomp: rules match a
// system call by name and, optionally, by its arguments; a rule whose
// arguments repeat an index matches when any of them does, otherwise when
// all do; unknown names are skipped (a profile names calls newer kernels
// have); a call no rule matches takes the default action.
//
// capsa writes the compiler itself, on golang.org/x/net/bpf's
// instructions: libseccomp needs cgo, and go-seccomp-bpf (which confine
// uses for the VMM's own fixed filter) has no masked comparison, no
// default errno, and does not read the call's number again after a
// rule's arguments failed to match, which an OCI profile's several rules
// for one call need.

import (
	"fmt"
	"unsafe"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// Seccomp is a container's seccomp profile, as the OCI spec has it, for
// the x86-64 guest: a call of another ABI (i386, x32) fails with ENOSYS
// whatever the profile says.
type Seccomp struct {
	DefaultAction string        `json:"default_action"`
	DefaultErrno  *uint         `json:"default_errno,omitempty"`
	Flags         []string      `json:"flags,omitempty"`
	Rules         []SeccompRule `json:"rules,omitempty"`
}

// SeccompRule is one of a profile's syscall entries.
type SeccompRule struct {
	Names  []string     `json:"names"`
	Action string       `json:"action"`
	Errno  *uint        `json:"errno,omitempty"`
	Args   []SeccompArg `json:"args,omitempty"`
}

// SeccompArg compares argument Index with Value (and ValueTwo, for
// SCMP_CMP_MASKED_EQ: (arg & Value) == ValueTwo).
type SeccompArg struct {
	Index    uint   `json:"index"`
	Value    uint64 `json:"value"`
	ValueTwo uint64 `json:"value_two,omitempty"`
	Op       string `json:"op"`
}

// Bounds on a profile the agent accepts; the kernel's own bound on the
// compiled filter is bpfMaxInstructions.
const (
	maxSeccompRules    = 1024
	maxSeccompNames    = 4096 // over all rules
	maxSeccompArgs     = 6
	bpfMaxInstructions = 4096
)

// seccomp_data's layout (linux/seccomp.h): nr, arch, instruction pointer,
// six 64-bit arguments, in the machine's (little-endian) order.
const (
	offNr   = 0
	offArch = 4
	offArgs = 16
)

// x32Bit marks a call of the x32 ABI.
const x32Bit = 0x40000000

var seccompActions = map[string]uint32{
	"SCMP_ACT_KILL":         unix.SECCOMP_RET_KILL_THREAD,
	"SCMP_ACT_KILL_THREAD":  unix.SECCOMP_RET_KILL_THREAD,
	"SCMP_ACT_KILL_PROCESS": unix.SECCOMP_RET_KILL_PROCESS,
	"SCMP_ACT_TRAP":         unix.SECCOMP_RET_TRAP,
	"SCMP_ACT_ERRNO":        unix.SECCOMP_RET_ERRNO,
	"SCMP_ACT_TRACE":        unix.SECCOMP_RET_TRACE,
	"SCMP_ACT_ALLOW":        unix.SECCOMP_RET_ALLOW,
	"SCMP_ACT_LOG":          unix.SECCOMP_RET_LOG,
}

var seccompFlags = map[string]uintptr{
	"SECCOMP_FILTER_FLAG_LOG":        unix.SECCOMP_FILTER_FLAG_LOG,
	"SECCOMP_FILTER_FLAG_SPEC_ALLOW": unix.SECCOMP_FILTER_FLAG_SPEC_ALLOW,
}

// action is the filter's return value for an OCI action and errno.
func action(name string, errno *uint) (uint32, error) {
	a, ok := seccompActions[name]
	if !ok {
		if name == "SCMP_ACT_NOTIFY" {
			return 0, fmt.Errorf("seccomp action %s: capsa has no listener to notify", name)
		}
		return 0, fmt.Errorf("seccomp action %q: not one capsa knows", name)
	}
	if a == unix.SECCOMP_RET_ERRNO || a == unix.SECCOMP_RET_TRACE {
		e := uint(unix.EPERM)
		if errno != nil {
			e = *errno
		}
		if e > maxErrno {
			return 0, fmt.Errorf("seccomp errno %d: above %d", e, maxErrno)
		}
		a |= uint32(e)
	}
	return a, nil
}

// Check refuses a profile the helper could not load.
func (s *Seccomp) Check() error {
	_, err := s.compile()
	return err
}

// condRule is one way a call matches on its arguments: all of args.
type condRule struct {
	args   []SeccompArg
	action uint32
}

// callRules is what a profile says of one call.
type callRules struct {
	nr          uint32
	conditional []condRule
	always      *uint32
}

// compile turns the profile into its filter.
func (s *Seccomp) compile() ([]bpf.Instruction, error) {
	def, err := action(s.DefaultAction, s.DefaultErrno)
	if err != nil {
		return nil, fmt.Errorf("seccomp default action: %w", err)
	}
	for _, f := range s.Flags {
		if _, ok := seccompFlags[f]; !ok {
			return nil, fmt.Errorf("seccomp flag %q: not one capsa applies", f)
		}
	}
	if len(s.Rules) > maxSeccompRules {
		return nil, fmt.Errorf("seccomp: %d rules, more than %d", len(s.Rules), maxSeccompRules)
	}
	var calls []*callRules
	byNr := map[uint32]*callRules{}
	names := 0
	for i, r := range s.Rules {
		names += len(r.Names)
		if names > maxSeccompNames {
			return nil, fmt.Errorf("seccomp: more than %d names", maxSeccompNames)
		}
		act, err := action(r.Action, r.Errno)
		if err != nil {
			return nil, fmt.Errorf("seccomp rule %d: %w", i, err)
		}
		alts, err := alternatives(r.Args)
		if err != nil {
			return nil, fmt.Errorf("seccomp rule %d: %w", i, err)
		}
		for _, name := range r.Names {
			nr, ok := arch.X86_64.SyscallNames[name]
			if !ok {
				continue // a call this kernel's ABI does not have
			}
			c := byNr[uint32(nr)]
			if c == nil {
				c = &callRules{nr: uint32(nr)}
				byNr[c.nr] = c
				calls = append(calls, c)
			}
			if alts == nil {
				if c.always != nil && *c.always != act {
					return nil, fmt.Errorf("seccomp rule %d: %s has two unconditional actions", i, name)
				}
				c.always = &act
				continue
			}
			for _, a := range alts {
				c.conditional = append(c.conditional, condRule{args: a, action: act})
			}
		}
	}

	prog := []bpf.Instruction{
		bpf.LoadAbsolute{Off: offArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: unix.AUDIT_ARCH_X86_64, SkipTrue: 1},
		bpf.RetConstant{Val: unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)},
		bpf.LoadAbsolute{Off: offNr, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: x32Bit, SkipFalse: 1},
		bpf.RetConstant{Val: unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)},
	}
	// Calls matched by number alone first, while the accumulator holds
	// the number; then each call with argument rules, in a block that
	// loads the number again.
	for _, c := range calls {
		if len(c.conditional) == 0 {
			prog = append(prog,
				bpf.JumpIf{Cond: bpf.JumpEqual, Val: c.nr, SkipFalse: 1},
				bpf.RetConstant{Val: *c.always})
		}
	}
	for _, c := range calls {
		if len(c.conditional) == 0 {
			continue
		}
		var block []bpf.Instruction
		for _, r := range c.conditional {
			block = append(block, matchAll(r.args, r.action)...)
		}
		if c.always != nil {
			block = append(block, bpf.RetConstant{Val: *c.always})
		}
		prog = append(prog, bpf.LoadAbsolute{Off: offNr, Size: 4})
		if len(block) <= 255 {
			prog = append(prog, bpf.JumpIf{Cond: bpf.JumpEqual, Val: c.nr, SkipFalse: uint8(len(block))})
		} else {
			prog = append(prog,
				bpf.JumpIf{Cond: bpf.JumpEqual, Val: c.nr, SkipTrue: 1},
				bpf.Jump{Skip: uint32(len(block))})
		}
		prog = append(prog, block...)
	}
	prog = append(prog, bpf.RetConstant{Val: def})
	if len(prog) > bpfMaxInstructions {
		return nil, fmt.Errorf("seccomp: the profile compiles to %d instructions, more than the kernel's %d", len(prog), bpfMaxInstructions)
	}
	return prog, nil
}

// alternatives are the argument lists a rule matches on, any one of
// which is enough: none (nil) for a rule on the number alone, one with
// all its arguments, or, where an index repeats, each argument alone
// (runc's reading of such a rule).
func alternatives(args []SeccompArg) ([][]SeccompArg, error) {
	if len(args) == 0 {
		return nil, nil
	}
	if len(args) > maxSeccompArgs {
		return nil, fmt.Errorf("%d argument comparisons, more than %d", len(args), maxSeccompArgs)
	}
	seen := map[uint]bool{}
	repeated := false
	for _, a := range args {
		if a.Index >= 6 {
			return nil, fmt.Errorf("argument index %d: a call has 6", a.Index)
		}
		if _, ok := comparisons[a.Op]; !ok {
			return nil, fmt.Errorf("argument comparison %q: not one capsa knows", a.Op)
		}
		repeated = repeated || seen[a.Index]
		seen[a.Index] = true
	}
	if !repeated {
		return [][]SeccompArg{args}, nil
	}
	out := make([][]SeccompArg, len(args))
	for i := range args {
		out[i] = args[i : i+1]
	}
	return out, nil
}

// fail marks a jump to the end of the rule (the rule does not match).
const fail = 0xff

// comparisons emit the test of one 64-bit argument against a value, from
// 32-bit loads: high word first, then the low one where the high words
// leave it open. A skip of fail is patched to leave the rule.
var comparisons = map[string]func(a SeccompArg) []bpf.Instruction{
	"SCMP_CMP_EQ": func(a SeccompArg) []bpf.Instruction {
		hi, lo := split(a.Value)
		return []bpf.Instruction{ldHi(a), jeq(hi, 0, fail), ldLo(a), jeq(lo, 0, fail)}
	},
	"SCMP_CMP_NE": func(a SeccompArg) []bpf.Instruction {
		hi, lo := split(a.Value)
		return []bpf.Instruction{ldHi(a), jeq(hi, 0, 2), ldLo(a), jeq(lo, fail, 0)}
	},
	"SCMP_CMP_GT": func(a SeccompArg) []bpf.Instruction {
		hi, lo := split(a.Value)
		return []bpf.Instruction{ldHi(a), jgt(hi, 3, 0), jeq(hi, 0, fail), ldLo(a), jgt(lo, 0, fail)}
	},
	"SCMP_CMP_GE": func(a SeccompArg) []bpf.Instruction {
		hi, lo := split(a.Value)
		return []bpf.Instruction{ldHi(a), jgt(hi, 3, 0), jeq(hi, 0, fail), ldLo(a), jge(lo, 0, fail)}
	},
	"SCMP_CMP_LT": func(a SeccompArg) []bpf.Instruction {
		hi, lo := split(a.Value)
		return []bpf.Instruction{ldHi(a), jgt(hi, fail, 0), jeq(hi, 0, 2), ldLo(a), jge(lo, fail, 0)}
	},
	"SCMP_CMP_LE": func(a SeccompArg) []bpf.Instruction {
		hi, lo := split(a.Value)
		return []bpf.Instruction{ldHi(a), jgt(hi, fail, 0), jeq(hi, 0, 2), ldLo(a), jgt(lo, fail, 0)}
	},
	"SCMP_CMP_MASKED_EQ": func(a SeccompArg) []bpf.Instruction {
		mhi, mlo := split(a.Value)
		hi, lo := split(a.ValueTwo)
		return []bpf.Instruction{
			ldHi(a), bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: mhi}, jeq(hi, 0, fail),
			ldLo(a), bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: mlo}, jeq(lo, 0, fail),
		}
	},
}

// matchAll is a rule: every comparison, then its action; a comparison
// that fails jumps past the action, to what follows.
func matchAll(args []SeccompArg, act uint32) []bpf.Instruction {
	var out []bpf.Instruction
	for _, a := range args {
		out = append(out, comparisons[a.Op](a)...)
	}
	out = append(out, bpf.RetConstant{Val: act})
	for i, in := range out {
		j, ok := in.(bpf.JumpIf)
		if !ok {
			continue
		}
		toEnd := uint8(len(out) - i - 1) // a rule is at most 6×6+1 instructions
		if j.SkipTrue == fail {
			j.SkipTrue = toEnd
		}
		if j.SkipFalse == fail {
			j.SkipFalse = toEnd
		}
		out[i] = j
	}
	return out
}

func split(v uint64) (hi, lo uint32) { return uint32(v >> 32), uint32(v) }

func ldHi(a SeccompArg) bpf.Instruction {
	return bpf.LoadAbsolute{Off: offArgs + 8*uint32(a.Index) + 4, Size: 4}
}

func ldLo(a SeccompArg) bpf.Instruction {
	return bpf.LoadAbsolute{Off: offArgs + 8*uint32(a.Index), Size: 4}
}

func jeq(v uint32, t, f uint8) bpf.Instruction {
	return bpf.JumpIf{Cond: bpf.JumpEqual, Val: v, SkipTrue: t, SkipFalse: f}
}

func jgt(v uint32, t, f uint8) bpf.Instruction {
	return bpf.JumpIf{Cond: bpf.JumpGreaterThan, Val: v, SkipTrue: t, SkipFalse: f}
}

func jge(v uint32, t, f uint8) bpf.Instruction {
	return bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: v, SkipTrue: t, SkipFalse: f}
}

// load compiles the profile and installs it on the calling thread (the
// one that will exec: a filter is a thread's, and execve hands it to the
// new program). Without no_new_privs the kernel wants CAP_SYS_ADMIN, so
// the helper loads it before it drops capabilities, as runc does.
func (s *Seccomp) load() error {
	prog, err := s.compile()
	if err != nil {
		return err
	}
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return fmt.Errorf("seccomp: assemble: %w", err)
	}
	filter := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	var flags uintptr
	for _, f := range s.Flags {
		flags |= seccompFlags[f]
	}
	fprog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	// seccomp(2) takes the program by address, which only unsafe can
	// give; x/sys/unix has no wrapper for it.
	if _, _, e := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, flags, uintptr(unsafe.Pointer(&fprog))); e != 0 {
		return fmt.Errorf("seccomp: load the container's filter: %w", e)
	}
	return nil
}
