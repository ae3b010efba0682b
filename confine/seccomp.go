package confine

import (
	"fmt"
	"slices"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/kvm"
)

// The seccomp allowlist of a running VMM process: everything it calls
// once its sandbox is built, and nothing else. Unlisted calls fail with
// EPERM (the process goes on and the operation that needed it fails with
// a clear error, rather than the whole VMM dying on a path nobody tested);
// execve and friends, ptrace, mount, bpf, perf_event_open, process_vm_*,
// new namespaces and new KVM VMs are among the unlisted. Each group says
// who needs it.

// hotSyscalls are checked early (see Policy); each is also listed in its
// group below, for the reader, and taken out of the rest.
var hotSyscalls = []string{"futex", "epoll_pwait", "read", "write", "nanosleep", "pread64", "pwrite64", "preadv", "pwritev", "sched_yield"}

// syscallGroups are the unconditional groups.
var syscallGroups = []struct {
	who   string
	names []string
}{
	{"the Go runtime: threads, memory, signals, scheduling, timers", []string{
		"futex", "sched_yield", "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday",
		"munmap", "madvise", "mremap", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack",
		"gettid", "getpid", "getppid", "exit", "exit_group", "restart_syscall", "arch_prctl",
		"sched_getaffinity", "getrlimit", "setitimer", "timer_create", "timer_settime", "timer_delete",
		"getrandom", "uname", "getuid", "geteuid", "getgid", "getegid", "getrusage", "sysinfo", "getcwd",
	}},
	{"the C library's threads, in a cgo build", []string{"rseq", "set_robust_list"}},
	{"the Go runtime's poller and every descriptor: reads, writes, epoll, pipes, eventfds (also KVM's irqfds and ioeventfds)", []string{
		"read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
		"close", "close_range", "dup", "dup3", "fcntl", "lseek", "pipe2", "eventfd2",
		"epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll",
		"splice", "sendfile", "copy_file_range", "tee",
	}},
	{"p9fs (shares and volumes), virtio-blk, snapshots, logs, the store and the hub: files under what Landlock allows", []string{
		"openat", "openat2", "newfstatat", "fstat", "statx", "statfs", "fstatfs", "getdents64",
		"mkdirat", "unlinkat", "renameat", "renameat2", "linkat", "symlinkat", "readlinkat",
		"fchmod", "fchmodat", "fchown", "fchownat", "utimensat", "mknodat", "faccessat", "faccessat2",
		"ftruncate", "fallocate", "fsync", "fdatasync", "sync_file_range", "flock",
		"getxattr", "lgetxattr", "fgetxattr", "setxattr", "lsetxattr", "fsetxattr",
		"listxattr", "llistxattr", "flistxattr", "removexattr", "lremovexattr", "fremovexattr",
		"inotify_init1", "inotify_add_watch", "inotify_rm_watch", "mincore", "msync",
	}},
	{"the NAT, published ports, the hybrid vsock and control sockets, DNS", []string{
		"connect", "bind", "listen", "accept", "accept4", "getsockname", "getpeername",
		"setsockopt", "getsockopt", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown",
	}},
}

// conditional returns the groups that depend on arguments: threads but
// no processes, memory but never executable, signals to this process
// alone, sockets of the families the VMM uses, and the ioctls it issues.
func conditional(pid int, terminal bool) []seccomp.NameWithConditions {
	eq := func(arg uint32, v uint64) seccomp.Condition {
		return seccomp.Condition{Argument: arg, Operation: seccomp.Equal, Value: v}
	}
	var out []seccomp.NameWithConditions
	add := func(name string, conds ...seccomp.Condition) {
		out = append(out, seccomp.NameWithConditions{Name: name, Conditions: conds})
	}
	// ioctl first, KVM_RUN first among its requests: a running VM
	// makes it after every VM exit. Then the running VM's other KVM
	// requests, FICLONE (a snapshot's reflinked disk), and with a
	// terminal the calls that read and set its mode and size. (A
	// system call's conditions must all be in one place: the filter
	// does not look further once the number matched.)
	reqs := []uint64{kvm.RunIoctl()}
	for _, r := range kvm.RunningIoctls() {
		if r != kvm.RunIoctl() {
			reqs = append(reqs, r)
		}
	}
	reqs = append(reqs, unix.FICLONE)
	if terminal {
		reqs = append(reqs, unix.TCGETS, unix.TCSETS, unix.TCSETSW, unix.TCSETSF, unix.TIOCGWINSZ, unix.TIOCSWINSZ, unix.TIOCGPGRP)
	}
	for _, r := range reqs {
		add("ioctl", eq(1, r))
	}
	// The Go runtime makes threads with clone(CLONE_THREAD|...); a new
	// process (fork, vfork, clone3) is refused.
	add("clone", seccomp.Condition{Argument: 0, Operation: seccomp.BitsSet, Value: unix.CLONE_THREAD})
	// Memory: never executable (no code can be made and run).
	add("mmap", seccomp.Condition{Argument: 2, Operation: seccomp.BitsNotSet, Value: unix.PROT_EXEC})
	add("mprotect", seccomp.Condition{Argument: 2, Operation: seccomp.BitsNotSet, Value: unix.PROT_EXEC})
	// Signals: the runtime's preemption and the vCPUs' kicks go to this
	// process's own threads; kill(getpid()) is how it raises a signal.
	add("tgkill", eq(0, uint64(pid)))
	add("kill", eq(0, uint64(pid)))
	// Sockets: Unix of any type (hybrid vsock, control, the terminal's
	// peers); IPv4 and IPv6 streams and datagrams only (the NAT and
	// published ports: no raw socket, which could forge packets); and
	// netlink's route protocol only (the host's addresses, which the NAT
	// refuses to reach). Each type with any of its creation flags.
	add("socket", eq(0, unix.AF_UNIX))
	for _, flags := range []uint64{0, unix.SOCK_CLOEXEC, unix.SOCK_NONBLOCK, unix.SOCK_CLOEXEC | unix.SOCK_NONBLOCK} {
		for _, fam := range []uint64{unix.AF_INET, unix.AF_INET6} {
			add("socket", eq(0, fam), eq(1, unix.SOCK_STREAM|flags))
			add("socket", eq(0, fam), eq(1, unix.SOCK_DGRAM|flags))
		}
		add("socket", eq(0, unix.AF_NETLINK), eq(1, unix.SOCK_RAW|flags), eq(2, unix.NETLINK_ROUTE))
		add("socket", eq(0, unix.AF_NETLINK), eq(1, unix.SOCK_DGRAM|flags), eq(2, unix.NETLINK_ROUTE))
	}
	add("socketpair", eq(0, unix.AF_UNIX))
	// prlimit64 reads limits (the runtime and os) and sets none.
	add("prlimit64", eq(2, 0))
	return out
}

// Policy is the seccomp policy of a VMM process whose pid is pid;
// terminal allows the ioctls of a controlling terminal.
func Policy(pid int, terminal bool) seccomp.Policy {
	var names []string
	for _, g := range syscallGroups {
		names = append(names, g.names...)
	}
	// The filter runs on every system call and checks in order: the
	// runtime's futex, poller and I/O come first, so the common path is
	// a few instructions; KVM_RUN heads the conditional group. That
	// group must come after every allowing group: go-seccomp-bpf sends
	// a call whose number matched but whose arguments did not on to
	// what follows, and an allowing group there would let it through
	// (TestSeccompAllowlist catches that).
	hotNames := seccomp.SyscallGroup{Names: hotSyscalls, Action: seccomp.ActionAllow}
	var rest []string
	for _, n := range names {
		if !slices.Contains(hotSyscalls, n) {
			rest = append(rest, n)
		}
	}
	return seccomp.Policy{
		DefaultAction: seccomp.ActionErrno, // EPERM
		Syscalls: []seccomp.SyscallGroup{
			hotNames,
			{Names: rest, Action: seccomp.ActionAllow},
			{NamesWithCondtions: conditional(pid, terminal), Action: seccomp.ActionAllow},
			// clone3 passes its flags in memory, out of a filter's
			// reach: ENOSYS makes C libraries (a cgo build) fall back
			// to clone, whose flags are checked above.
			{Names: []string{"clone3"}, Action: seccomp.ActionErrno | seccomp.Action(unix.ENOSYS)},
		},
	}
}

// installSeccomp sets no_new_privs and installs Policy on every thread
// of the process (TSYNC).
func installSeccomp(pid int, terminal bool) error {
	if !seccomp.Supported() {
		return errUnavailable
	}
	f := seccomp.Filter{NoNewPrivs: true, Flag: seccomp.FilterFlagTSync, Policy: Policy(pid, terminal)}
	if err := seccomp.LoadFilter(f); err != nil {
		return fmt.Errorf("confine: seccomp: %w", err)
	}
	return nil
}
