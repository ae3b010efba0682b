// Package confine is capsa's second wall: once a sandbox's VMM is built
// (guest memory mapped, devices opened, KVM descriptors made), the process
// that runs it gives up what it no longer needs, so that a guest that
// breaks a device model gets almost nothing of the host. Its starting
// point is Apply, which puts on every layer the host has and reports which
// it got (Layers):
//
//   - seccomp: an allowlist of system calls (Policy, in seccomp.go, each
//     group with who needs it), on every thread (TSYNC) and with
//     no_new_privs; anything else fails with EPERM. No execve, fork,
//     ptrace, mount, bpf, perf_event_open, process_vm_*, namespaces,
//     executable memory or new KVM VMs; ioctls by request number.
//   - Landlock (unprivileged, Linux 5.13+): file access only beneath the
//     paths the sandbox uses (its shares, volumes, disks, state files) and
//     read-only to the few system files the NAT's resolver reads.
//   - the jail (jail.go), when the process runs as root and was spawned
//     in a mount namespace of its own: a root holding only those paths,
//     bound at their own places (read-only where only read), and
//     optionally another user and group (Config.User) with no
//     capability.
//   - capabilities (caps.go): a VMM run by root keeps only those a file
//     server over other users' files needs (KeptCapabilities), and only
//     when it serves host files (Config.HostFiles); it loses the rest
//     from its bounding set too.
//   - a cgroup of its own with memory and pids limits, where cgroup v2 is
//     delegated to the user; rlimits always (no core dumps, descriptor and
//     process limits fixed where they are).
//
// A layer the host cannot give is reported with the reason, and the others
// still apply. Confinement is for the whole process and cannot be undone:
// the CLI and each detached sandbox's supervisor apply it; a program that
// embeds package sandbox decides for its own process (see docs/security.md).
package confine

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Config says what the confined process may still reach.
type Config struct {
	// Read and Write are the files and directories (and everything
	// beneath) the process may read, and read and change. Missing ones
	// are skipped.
	Read, Write []string
	// Terminal allows the ioctls of a controlling terminal (capsa run
	// -t).
	Terminal bool
	// Name names the cgroup (capsa-NAME-PID).
	Name string
	// MemoryBytes is the cgroup's memory.max: the guest's memory plus
	// the VMM's own bound. 0: no memory limit.
	MemoryBytes int64
	// Pids is the cgroup's pids.max (threads count); 0: DefaultPids.
	Pids int
	// CPUs is the cgroup's cpu.max in CPUs (1.5: 150 ms of CPU time each
	// 100 ms), where the host delegates the cpu controller. 0: no limit.
	CPUs float64
	// User, Own and Shared are for the jail (JailConfig), which a process
	// running as root in a mount namespace of its own enters: the user
	// and group it drops to (nil: it stays root), and capsa's files the
	// user must keep writing. A User the process cannot become is an
	// error.
	User        *User
	Own, Shared []string
	// HostFiles says the process serves host files it did not make
	// (shares, volumes, disks, files copied in), which may be other
	// users': run by root, it keeps KeptCapabilities for them.
	HostFiles bool
	// Follow are directories of Write beneath which the host mounts
	// while the process runs (a containerd pod's container roots): its
	// jail takes those mounts as they come (JailConfig.Follow).
	Follow []string
}

// DefaultPids bounds a VMM's threads: the Go runtime's, one per vCPU and
// the devices' workers.
const DefaultPids = 512

// SystemRead are the system files a VMM reads while it runs: the NAT's
// resolver configuration, TLS roots, time zones, and its own /proc entry
// (its descriptors, which p9fs reopens, and its statistics), and the
// cgroup files the Go runtime reads to size itself.
var SystemRead = []string{
	"/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/host.conf", "/etc/gai.conf", "/etc/services",
	"/etc/ssl", "/etc/pki", "/etc/ca-certificates", "/usr/share/ca-certificates", "/etc/localtime", "/usr/share/zoneinfo",
	"/proc/self", "/sys/fs/cgroup",
}

// Layers says which layers a process got: "on" with details, or why
// not.
type Layers struct {
	Seccomp      string `json:"seccomp"`
	Landlock     string `json:"landlock"`
	Namespaces   string `json:"namespaces"`
	Capabilities string `json:"capabilities"`
	Cgroup       string `json:"cgroup"`
	Rlimits      string `json:"rlimits"`
}

func (l Layers) String() string {
	return fmt.Sprintf("seccomp: %s; landlock: %s; namespaces: %s; capabilities: %s; cgroup: %s; rlimits: %s", l.Seccomp, l.Landlock, l.Namespaces, l.Capabilities, l.Cgroup, l.Rlimits)
}

// Apply confines the calling process as c says, every thread of it, for
// good. Layers the host lacks are reported as off with the reason; an
// error means a layer the host has could not be put on (the process is
// then partly confined and should not go on).
func Apply(c Config, log *slog.Logger) (Layers, error) {
	var l Layers
	status := func(what string, detail string, err error) (string, error) {
		switch {
		case err == nil:
			return "on (" + detail + ")", nil
		case errors.Is(err, errUnavailable):
			log.Info("confine: a layer is not available on this host", "layer", what, "why", err)
			return "off: " + strings.TrimPrefix(err.Error(), errUnavailable.Error()+": "), nil
		}
		return "failed: " + err.Error(), err
	}
	pids := c.Pids
	if pids == 0 {
		pids = DefaultPids
	}
	var err error
	d, e := joinCgroup(c.Name, c.MemoryBytes, pids, c.CPUs)
	if l.Cgroup, err = status("cgroup", d, e); err != nil {
		return l, err
	}
	d, e = setRlimits()
	if l.Rlimits, err = status("rlimits", d, e); err != nil {
		return l, err
	}
	read := append(append([]string{}, SystemRead...), c.Read...)
	if os.Geteuid() != 0 {
		if c.User != nil {
			return l, errors.New("confine: jail: changing the user (" + c.User.String() + ") needs root")
		}
		l.Namespaces = "off: not root"
	} else {
		d, e = Jail(JailConfig{Read: read, Write: c.Write, Follow: c.Follow, User: c.User, Own: c.Own, Shared: c.Shared}, log)
		if e != nil && c.User != nil {
			return l, fmt.Errorf("confine: jail as %s: %w", c.User, e)
		}
		if l.Namespaces, err = status("namespaces", d, e); err != nil {
			return l, err
		}
	}
	// After the jail, which needs its mounts and chowns, and before
	// seccomp, which refuses capset.
	d, e = dropCapabilities(c.HostFiles)
	if l.Capabilities, err = status("capabilities", d, e); err != nil {
		return l, err
	}
	d, e = restrictPaths(read, c.Write)
	if l.Landlock, err = status("landlock", d, e); err != nil {
		return l, err
	}
	e = installSeccomp(os.Getpid(), c.Terminal)
	if l.Seccomp, err = status("seccomp", "allowlist, EPERM otherwise, all threads", e); err != nil {
		return l, err
	}
	return l, nil
}

// ProbeEnv, set to paths outside what the process may reach (a list, as
// PATH is written), makes a confined capsa process try, right after
// Apply, what confinement must refuse: running a program, reading each
// path, and tracing its parent. It is a test hook: the guest cannot set
// the VMM's environment.
const ProbeEnv = "CAPSA_TEST_CONFINE_PROBE"

// Probe tries what ProbeEnv asks and logs what happened to each: the
// reads as open, open2, open3 and so on.
func Probe(log *slog.Logger) {
	paths := filepath.SplitList(os.Getenv(ProbeEnv))
	if len(paths) == 0 {
		return
	}
	execErr := unix.Exec("/proc/self/exe", []string{"capsa", "version"}, nil)
	attrs := []any{"execve", errString(execErr)}
	for i, p := range paths {
		key := "open"
		if i > 0 {
			key = fmt.Sprintf("open%d", i+1)
		}
		_, err := os.ReadFile(p)
		attrs = append(attrs, key, errString(err))
	}
	ptraceErr := unix.PtraceAttach(os.Getppid())
	log.Warn("confine probe", append(attrs, "ptrace", errString(ptraceErr))...)
}

func errString(err error) string {
	if err == nil {
		return "allowed"
	}
	return err.Error()
}
