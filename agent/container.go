package agent

// Container processes: what a containerd pod's containers are in a capsa
// guest (package shim, on the host). The agent starts such a process as
// itself, `capsa-agent container-exec`, in a mount namespace of its own;
// that helper mounts what the container's OCI spec asks for into the
// container's root (a directory the host shares into the guest), pivots
// into it, takes the spec's rlimits and ids, and executes the process. It
// follows what runc does for a container's filesystem, capabilities and
// seccomp profile (seccomp.go), reduced to what a guest that is already
// the isolation boundary needs (the VM is the pod's boundary, as Kata's);
// a container's cgroup (cgroup.go) is made by the agent, which starts the
// helper in it.
//
// Every path in the container's root is resolved with openat2's
// RESOLVE_IN_ROOT: the root is an image's tree, and a symbolic link in it
// must not move a mount outside it.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// FeatureContainers: exec requests may carry a Container.
const FeatureContainers = "containers"

// ContainerExecArg is the agent's first argument when it runs as the
// helper that enters a container and executes its process.
const ContainerExecArg = "container-exec"

// containerEnv carries the helper's request from the agent.
const containerEnv = "CAPSA_CONTAINER_EXEC"

// Bounds on a container request the agent accepts.
const (
	maxContainerMounts  = 256
	maxContainerRlimits = 32
	maxContainerGroups  = 256
)

// Container, in an exec request, runs the process as a container's: in a
// mount namespace of its own, pivoted into Root with Mounts mounted, with
// Rlimits, as UID:GID with Groups. The request's Env is then the process's
// whole environment (the agent adds none of its own), its Dir is a path in
// the container, and its User must be empty.
type Container struct {
	Root            string           `json:"root"` // a guest directory
	Readonly        bool             `json:"readonly,omitempty"`
	Mounts          []ContainerMount `json:"mounts,omitempty"`
	UID             uint32           `json:"uid"`
	GID             uint32           `json:"gid"`
	Groups          []uint32         `json:"groups,omitempty"`
	Rlimits         []Rlimit         `json:"rlimits,omitempty"`
	NoNewPrivileges bool             `json:"no_new_privileges,omitempty"`
	// Capabilities are the process's capability sets by their OCI
	// names (CAP_CHOWN, ...); nil: the agent's own (all).
	Capabilities *Capabilities `json:"capabilities,omitempty"`
	// MaskedPaths are hidden (an empty read-only tmpfs over a directory,
	// /dev/null over a file) and ReadonlyPaths made read-only, after the
	// mounts, as the OCI spec's linux.maskedPaths and readonlyPaths.
	MaskedPaths   []string `json:"masked_paths,omitempty"`
	ReadonlyPaths []string `json:"readonly_paths,omitempty"`
	// Seccomp is the process's seccomp profile; nil: none.
	Seccomp *Seccomp `json:"seccomp,omitempty"`
	// Cgroup is the container's cgroup in the guest (cgroup.go), which
	// the process starts in, in a cgroup namespace of its own; nil: the
	// agent's.
	Cgroup *ContainerCgroup `json:"cgroup,omitempty"`
}

// Capabilities are a process's five capability sets, as the OCI spec has
// them.
type Capabilities struct {
	Bounding    []string `json:"bounding,omitempty"`
	Effective   []string `json:"effective,omitempty"`
	Permitted   []string `json:"permitted,omitempty"`
	Inheritable []string `json:"inheritable,omitempty"`
	Ambient     []string `json:"ambient,omitempty"`
}

// capNumbers are the capabilities by name (linux/capability.h).
var capNumbers = map[string]int{
	"CAP_CHOWN": unix.CAP_CHOWN, "CAP_DAC_OVERRIDE": unix.CAP_DAC_OVERRIDE, "CAP_DAC_READ_SEARCH": unix.CAP_DAC_READ_SEARCH,
	"CAP_FOWNER": unix.CAP_FOWNER, "CAP_FSETID": unix.CAP_FSETID, "CAP_KILL": unix.CAP_KILL, "CAP_SETGID": unix.CAP_SETGID,
	"CAP_SETUID": unix.CAP_SETUID, "CAP_SETPCAP": unix.CAP_SETPCAP, "CAP_LINUX_IMMUTABLE": unix.CAP_LINUX_IMMUTABLE,
	"CAP_NET_BIND_SERVICE": unix.CAP_NET_BIND_SERVICE, "CAP_NET_BROADCAST": unix.CAP_NET_BROADCAST, "CAP_NET_ADMIN": unix.CAP_NET_ADMIN,
	"CAP_NET_RAW": unix.CAP_NET_RAW, "CAP_IPC_LOCK": unix.CAP_IPC_LOCK, "CAP_IPC_OWNER": unix.CAP_IPC_OWNER,
	"CAP_SYS_MODULE": unix.CAP_SYS_MODULE, "CAP_SYS_RAWIO": unix.CAP_SYS_RAWIO, "CAP_SYS_CHROOT": unix.CAP_SYS_CHROOT,
	"CAP_SYS_PTRACE": unix.CAP_SYS_PTRACE, "CAP_SYS_PACCT": unix.CAP_SYS_PACCT, "CAP_SYS_ADMIN": unix.CAP_SYS_ADMIN,
	"CAP_SYS_BOOT": unix.CAP_SYS_BOOT, "CAP_SYS_NICE": unix.CAP_SYS_NICE, "CAP_SYS_RESOURCE": unix.CAP_SYS_RESOURCE,
	"CAP_SYS_TIME": unix.CAP_SYS_TIME, "CAP_SYS_TTY_CONFIG": unix.CAP_SYS_TTY_CONFIG, "CAP_MKNOD": unix.CAP_MKNOD,
	"CAP_LEASE": unix.CAP_LEASE, "CAP_AUDIT_WRITE": unix.CAP_AUDIT_WRITE, "CAP_AUDIT_CONTROL": unix.CAP_AUDIT_CONTROL,
	"CAP_SETFCAP": unix.CAP_SETFCAP, "CAP_MAC_OVERRIDE": unix.CAP_MAC_OVERRIDE, "CAP_MAC_ADMIN": unix.CAP_MAC_ADMIN,
	"CAP_SYSLOG": unix.CAP_SYSLOG, "CAP_WAKE_ALARM": unix.CAP_WAKE_ALARM, "CAP_BLOCK_SUSPEND": unix.CAP_BLOCK_SUSPEND,
	"CAP_AUDIT_READ": unix.CAP_AUDIT_READ, "CAP_PERFMON": unix.CAP_PERFMON, "CAP_BPF": unix.CAP_BPF,
	"CAP_CHECKPOINT_RESTORE": unix.CAP_CHECKPOINT_RESTORE,
}

// capMask is the set of named capabilities as a bit mask; an unknown name
// is an error.
func capMask(names []string) (uint64, error) {
	var m uint64
	for _, n := range names {
		c, ok := capNumbers[n]
		if !ok {
			return 0, fmt.Errorf("container capability %q: not one this guest knows", n)
		}
		m |= 1 << c
	}
	return m, nil
}

// check refuses unknown capability names.
func (c *Capabilities) check() error {
	for _, set := range [][]string{c.Bounding, c.Effective, c.Permitted, c.Inheritable, c.Ambient} {
		if _, err := capMask(set); err != nil {
			return err
		}
	}
	return nil
}

// dropBounding drops what is not in the bounding set and keeps the
// capabilities across the change of user: it runs before setuid, on the
// thread that will exec (capabilities are a thread's).
func (c *Capabilities) dropBounding() error {
	bounding, _ := capMask(c.Bounding)
	last := lastCap()
	for i := 0; i <= last; i++ {
		if bounding&(1<<i) == 0 {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(i), 0, 0, 0); err != nil {
				return fmt.Errorf("drop capability %d from the bounding set: %w", i, err)
			}
		}
	}
	return unix.Prctl(unix.PR_SET_KEEPCAPS, 1, 0, 0, 0)
}

// apply sets the effective, permitted and inheritable sets and raises the
// ambient ones: after setuid, before exec.
func (c *Capabilities) apply() error {
	eff, _ := capMask(c.Effective)
	perm, _ := capMask(c.Permitted)
	inh, _ := capMask(c.Inheritable)
	amb, _ := capMask(c.Ambient)
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	data[0] = unix.CapUserData{Effective: uint32(eff), Permitted: uint32(perm), Inheritable: uint32(inh)}
	data[1] = unix.CapUserData{Effective: uint32(eff >> 32), Permitted: uint32(perm >> 32), Inheritable: uint32(inh >> 32)}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("set the capabilities: %w", err)
	}
	for i := 0; i <= lastCap(); i++ {
		if amb&(1<<i) != 0 {
			if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_RAISE, uintptr(i), 0, 0); err != nil {
				return fmt.Errorf("raise ambient capability %d: %w", i, err)
			}
		}
	}
	return nil
}

// lastCap is the guest kernel's highest capability.
func lastCap() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return unix.CAP_LAST_CAP
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 || n > 63 {
		return unix.CAP_LAST_CAP
	}
	return n
}

// ContainerMount is one of a container's mounts, as the OCI spec has it;
// a bind mount's Source is a guest path.
type ContainerMount struct {
	Destination string   `json:"destination"`
	Type        string   `json:"type,omitempty"`
	Source      string   `json:"source,omitempty"`
	Options     []string `json:"options,omitempty"`
}

// Rlimit is a resource limit by its OCI name (RLIMIT_NOFILE, ...).
type Rlimit struct {
	Type string `json:"type"`
	Soft uint64 `json:"soft"`
	Hard uint64 `json:"hard"`
}

var rlimitNumbers = map[string]int{
	"RLIMIT_AS": unix.RLIMIT_AS, "RLIMIT_CORE": unix.RLIMIT_CORE, "RLIMIT_CPU": unix.RLIMIT_CPU,
	"RLIMIT_DATA": unix.RLIMIT_DATA, "RLIMIT_FSIZE": unix.RLIMIT_FSIZE, "RLIMIT_LOCKS": unix.RLIMIT_LOCKS,
	"RLIMIT_MEMLOCK": unix.RLIMIT_MEMLOCK, "RLIMIT_MSGQUEUE": unix.RLIMIT_MSGQUEUE, "RLIMIT_NICE": unix.RLIMIT_NICE,
	"RLIMIT_NOFILE": unix.RLIMIT_NOFILE, "RLIMIT_NPROC": unix.RLIMIT_NPROC, "RLIMIT_RSS": unix.RLIMIT_RSS,
	"RLIMIT_RTPRIO": unix.RLIMIT_RTPRIO, "RLIMIT_RTTIME": unix.RLIMIT_RTTIME, "RLIMIT_SIGPENDING": unix.RLIMIT_SIGPENDING,
	"RLIMIT_STACK": unix.RLIMIT_STACK,
}

// Check refuses a container request the helper could not honour, before
// anything starts.
func (c *Container) Check() error {
	if !filepath.IsAbs(c.Root) || filepath.Clean(c.Root) == "/" {
		return fmt.Errorf("container root %q: want an absolute guest directory other than /", c.Root)
	}
	if len(c.Mounts) > maxContainerMounts || len(c.Rlimits) > maxContainerRlimits || len(c.Groups) > maxContainerGroups {
		return fmt.Errorf("container: more than %d mounts, %d rlimits or %d groups", maxContainerMounts, maxContainerRlimits, maxContainerGroups)
	}
	for _, m := range c.Mounts {
		if !filepath.IsAbs(m.Destination) {
			return fmt.Errorf("container mount %q: the destination is not absolute", m.Destination)
		}
		if _, _, _, err := mountFlags(m); err != nil {
			return err
		}
	}
	if c.Capabilities != nil {
		if err := c.Capabilities.check(); err != nil {
			return err
		}
	}
	if len(c.MaskedPaths)+len(c.ReadonlyPaths) > maxContainerMounts {
		return fmt.Errorf("container: more than %d masked and read-only paths", maxContainerMounts)
	}
	for _, p := range append(append([]string(nil), c.MaskedPaths...), c.ReadonlyPaths...) {
		if !filepath.IsAbs(p) {
			return fmt.Errorf("container path %q to mask or make read-only: not absolute", p)
		}
	}
	if c.Seccomp != nil {
		if err := c.Seccomp.Check(); err != nil {
			return fmt.Errorf("container: %w", err)
		}
	}
	if c.Cgroup != nil {
		if err := c.Cgroup.Check(); err != nil {
			return err
		}
	}
	for _, r := range c.Rlimits {
		if _, ok := rlimitNumbers[r.Type]; !ok {
			return fmt.Errorf("container rlimit %q: not a resource limit this guest knows", r.Type)
		}
		if r.Soft > r.Hard {
			return fmt.Errorf("container rlimit %s: soft %d above hard %d", r.Type, r.Soft, r.Hard)
		}
	}
	return nil
}

// containerRequest is what the agent hands the helper.
type containerRequest struct {
	Container Container `json:"container"`
	Argv      []string  `json:"argv"`
	Env       []string  `json:"env,omitempty"`
	Dir       string    `json:"dir,omitempty"`
}

// containerCommand is how the agent starts req's process in its container:
// the helper, in a mount namespace of its own.
func containerCommand(req *ExecRequest, argv []string) (path string, args, env []string, err error) {
	data, err := json.Marshal(containerRequest{Container: *req.Container, Argv: argv, Env: req.Env, Dir: req.Dir})
	if err != nil {
		return "", nil, nil, err
	}
	return "/proc/self/exe", []string{argv[0], ContainerExecArg}, []string{containerEnv + "=" + string(data)}, nil
}

// ContainerExec is the helper's main: it enters the container and
// executes its process, or says on stderr why not and returns 127 (the
// shell's "could not run").
func ContainerExec() int {
	// Capabilities and no_new_privs are a thread's: the one that execs
	// must be the one that set them.
	runtime.LockOSThread()
	var req containerRequest
	if err := json.Unmarshal([]byte(os.Getenv(containerEnv)), &req); err != nil {
		fmt.Fprintf(os.Stderr, "capsa-agent: container: bad request: %v\n", err)
		return 127
	}
	err := enterContainer(&req)
	fmt.Fprintf(os.Stderr, "capsa-agent: container: %v\n", err)
	return 127
}

// enterContainer does the helper's work; it only returns on failure.
func enterContainer(req *containerRequest) error {
	c := &req.Container
	if len(req.Argv) == 0 {
		return errors.New("no process arguments")
	}
	if err := c.Check(); err != nil {
		return err
	}
	root := filepath.Clean(c.Root)
	// The agent started this process in a mount namespace of its own
	// (private, as Go makes it): a bind of the root on itself makes it a
	// mount point pivot_root accepts.
	if err := unix.Mount(root, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind the root %s: %w", root, err)
	}
	devTmpfs := false
	for _, m := range c.Mounts {
		if err := mountIn(root, m); err != nil {
			return err
		}
		if filepath.Clean(m.Destination) == "/dev" && m.Type == "tmpfs" {
			devTmpfs = true
		}
	}
	if devTmpfs {
		if err := populateDev(root); err != nil {
			return err
		}
	}
	for _, p := range c.MaskedPaths {
		if err := maskPath(root, p); err != nil {
			return err
		}
	}
	for _, p := range c.ReadonlyPaths {
		if err := readonlyPath(root, p); err != nil {
			return err
		}
	}
	if err := unix.Chdir(root); err != nil {
		return fmt.Errorf("enter the root: %w", err)
	}
	switch err := unix.PivotRoot(".", "."); {
	case err == nil:
		if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
			return fmt.Errorf("detach the guest's root: %w", err)
		}
	case errors.Is(err, unix.EINVAL):
		// The guest's root is its initramfs, which pivot_root refuses
		// to move: the container's root moves over it instead, as runc
		// does on a ramdisk. The pod's boundary is the VM either way.
		if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move the root %s over the guest's: %w", root, err)
		}
		if err := unix.Chroot("."); err != nil {
			return fmt.Errorf("chroot into %s: %w", root, err)
		}
	default:
		return fmt.Errorf("pivot_root into %s: %w", root, err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if c.Readonly {
		if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
			return fmt.Errorf("make the root read-only: %w", err)
		}
	}
	for _, r := range c.Rlimits {
		if err := unix.Setrlimit(rlimitNumbers[r.Type], &unix.Rlimit{Cur: r.Soft, Max: r.Hard}); err != nil {
			return fmt.Errorf("rlimit %s: %w", r.Type, err)
		}
	}
	if c.Seccomp != nil && !c.NoNewPrivileges {
		// Loading a filter without no_new_privs takes CAP_SYS_ADMIN,
		// which the next steps may drop.
		if err := c.Seccomp.load(); err != nil {
			return err
		}
	}
	if c.Capabilities != nil {
		if err := c.Capabilities.dropBounding(); err != nil {
			return err
		}
	}
	groups := make([]int, len(c.Groups))
	for i, g := range c.Groups {
		groups[i] = int(g)
	}
	if err := syscall.Setgroups(groups); err != nil {
		return fmt.Errorf("supplementary groups: %w", err)
	}
	if err := syscall.Setgid(int(c.GID)); err != nil {
		return fmt.Errorf("group %d: %w", c.GID, err)
	}
	if err := syscall.Setuid(int(c.UID)); err != nil {
		return fmt.Errorf("user %d: %w", c.UID, err)
	}
	if c.Capabilities != nil {
		if err := c.Capabilities.apply(); err != nil {
			return err
		}
	}
	if c.NoNewPrivileges {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("no_new_privs: %w", err)
		}
	}
	dir := req.Dir
	if dir == "" {
		dir = "/"
	}
	if err := unix.Chdir(dir); err != nil {
		return fmt.Errorf("working directory %s: %w", dir, err)
	}
	path := req.Argv[0]
	if !strings.Contains(path, "/") {
		search := envValue(req.Env, "PATH")
		if search == "" {
			search = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
		}
		p, err := lookPath(path, search)
		if err != nil {
			return err
		}
		path = p
	}
	if c.Seccomp != nil && c.NoNewPrivileges {
		// As late as can be, so that the profile governs the process
		// and as little of the helper as possible.
		if err := c.Seccomp.load(); err != nil {
			return err
		}
	}
	if err := syscall.Exec(path, req.Argv, req.Env); err != nil {
		return fmt.Errorf("exec %s: %w", req.Argv[0], err)
	}
	return nil
}

// mountOptions are the mount options that are flags. rw and the defaults
// are none; propagation is private in the container's own namespace.
var mountOptions = map[string]uintptr{
	"ro": unix.MS_RDONLY, "nosuid": unix.MS_NOSUID, "nodev": unix.MS_NODEV, "noexec": unix.MS_NOEXEC,
	"noatime": unix.MS_NOATIME, "nodiratime": unix.MS_NODIRATIME, "relatime": unix.MS_RELATIME,
	"strictatime": unix.MS_STRICTATIME, "sync": unix.MS_SYNCHRONOUS,
	"bind": unix.MS_BIND, "rbind": unix.MS_BIND | unix.MS_REC,
	"rw": 0, "defaults": 0, "suid": 0, "dev": 0, "exec": 0, "atime": 0, "diratime": 0,
	"private": 0, "rprivate": 0, "slave": 0, "rslave": 0, "shared": 0, "rshared": 0, "unbindable": 0, "runbindable": 0,
}

// mountFlags splits a mount's options into flags, flags for a bind's
// remount, and the filesystem's own data.
func mountFlags(m ContainerMount) (flags, remount uintptr, data string, err error) {
	var extra []string
	for _, o := range m.Options {
		if f, ok := mountOptions[o]; ok {
			flags |= f
			continue
		}
		if strings.ContainsAny(o, ",\x00") {
			return 0, 0, "", fmt.Errorf("container mount %s: bad option %q", m.Destination, o)
		}
		extra = append(extra, o)
	}
	if m.Type == "bind" {
		flags |= unix.MS_BIND
	}
	if flags&unix.MS_BIND != 0 {
		if !filepath.IsAbs(m.Source) {
			return 0, 0, "", fmt.Errorf("container mount %s: a bind mount's source %q is not an absolute guest path", m.Destination, m.Source)
		}
		remount = flags &^ (unix.MS_BIND | unix.MS_REC)
		flags &= unix.MS_BIND | unix.MS_REC
	} else {
		switch m.Type {
		case "proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2":
		default:
			return 0, 0, "", fmt.Errorf("container mount %s: type %q is not one a capsa guest mounts (want bind, proc, sysfs, tmpfs, devpts, mqueue or cgroup)", m.Destination, m.Type)
		}
	}
	return flags, remount, strings.Join(extra, ","), nil
}

// mountIn mounts m at its destination inside root.
func mountIn(root string, m ContainerMount) error {
	flags, remount, data, err := mountFlags(m)
	if err != nil {
		return err
	}
	isFile := false
	if flags&unix.MS_BIND != 0 {
		st, err := os.Stat(m.Source)
		if err != nil {
			return fmt.Errorf("container mount %s: %w", m.Destination, err)
		}
		isFile = !st.IsDir()
	}
	target, err := openIn(root, m.Destination, isFile)
	if err != nil {
		return fmt.Errorf("container mount %s: %w", m.Destination, err)
	}
	defer target.Close()
	at := fmt.Sprintf("/proc/self/fd/%d", target.Fd())
	typ, src := m.Type, m.Source
	switch {
	case flags&unix.MS_BIND != 0:
		typ = ""
	case typ == "cgroup":
		typ = "cgroup2" // the guest has the unified hierarchy alone
	}
	if src == "" {
		src = typ
	}
	if err := unix.Mount(src, at, typ, flags, data); err != nil {
		// A guest kernel without POSIX message queues or cgroups
		// leaves those mounts out, as a host without them would.
		if errors.Is(err, unix.ENODEV) && (typ == "mqueue" || typ == "cgroup2") {
			return nil
		}
		return fmt.Errorf("container mount %s (%s): %w", m.Destination, m.Type, err)
	}
	if remount != 0 {
		// The descriptor names the directory the bind now covers: the
		// remount needs the new mount, found again by its path.
		mounted, err := openIn(root, m.Destination, isFile)
		if err != nil {
			return fmt.Errorf("container mount %s: %w", m.Destination, err)
		}
		defer mounted.Close()
		at = fmt.Sprintf("/proc/self/fd/%d", mounted.Fd())
		if err := unix.Mount("", at, "", unix.MS_REMOUNT|unix.MS_BIND|remount, ""); err != nil {
			return fmt.Errorf("container mount %s: remount with its options: %w", m.Destination, err)
		}
	}
	return nil
}

// openIn opens path inside root (O_PATH), resolving it as if root were /,
// and makes what is missing: directories, and the last component as an
// empty file if isFile (a bind mount's target for a file).
func openIn(root, path string, isFile bool) (*os.File, error) {
	rootFD, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(rootFD)
	rel := strings.TrimPrefix(filepath.Clean("/"+path), "/")
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS}
	if rel == "" {
		fd, err := unix.Openat2(rootFD, ".", how)
		if err != nil {
			return nil, err
		}
		return os.NewFile(uintptr(fd), path), nil
	}
	parts := strings.Split(rel, "/")
	for i := range parts {
		sub := strings.Join(parts[:i+1], "/")
		fd, err := unix.Openat2(rootFD, sub, how)
		if err == nil {
			if i == len(parts)-1 {
				return os.NewFile(uintptr(fd), path), nil
			}
			unix.Close(fd)
			continue
		}
		if !errors.Is(err, unix.ENOENT) {
			return nil, err
		}
		parent, err := unix.Openat2(rootFD, strings.Join(append([]string{"."}, parts[:i]...), "/"), &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
		if err != nil {
			return nil, err
		}
		if i == len(parts)-1 && isFile {
			var fd int
			fd, err = unix.Openat(parent, parts[i], unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o644)
			if err == nil {
				unix.Close(fd)
			}
		} else {
			err = unix.Mkdirat(parent, parts[i], 0o755)
		}
		unix.Close(parent)
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return nil, err
		}
		fd, err = unix.Openat2(rootFD, sub, how)
		if err != nil {
			return nil, err
		}
		if i == len(parts)-1 {
			return os.NewFile(uintptr(fd), path), nil
		}
		unix.Close(fd)
	}
	return nil, errors.New("unreachable")
}

// existingIn opens path inside root if it exists (nil if it does not).
func existingIn(root, path string) (*os.File, error) {
	rootFD, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(rootFD)
	fd, err := unix.Openat2(rootFD, strings.TrimPrefix(filepath.Clean("/"+path), "/"),
		&unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
	if errors.Is(err, unix.ENOENT) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), path), nil
}

// maskPath hides path in the container, if it exists: /dev/null bound over
// a file, an empty read-only tmpfs over a directory.
func maskPath(root, path string) error {
	f, err := existingIn(root, path)
	if err != nil || f == nil {
		return err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return err
	}
	at := fmt.Sprintf("/proc/self/fd/%d", f.Fd())
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		err = unix.Mount("tmpfs", at, "tmpfs", unix.MS_RDONLY, "size=0")
	} else {
		err = unix.Mount("/dev/null", at, "", unix.MS_BIND, "")
	}
	if err != nil {
		return fmt.Errorf("mask %s: %w", path, err)
	}
	return nil
}

// readonlyPath makes path, if it exists, read-only in the container.
func readonlyPath(root, path string) error {
	f, err := existingIn(root, path)
	if err != nil || f == nil {
		return err
	}
	at := fmt.Sprintf("/proc/self/fd/%d", f.Fd())
	err = unix.Mount(at, at, "", unix.MS_BIND|unix.MS_REC, "")
	f.Close()
	if err != nil {
		return fmt.Errorf("read-only %s: %w", path, err)
	}
	// The remount needs the new mount, found again by its path.
	g, err := existingIn(root, path)
	if err != nil || g == nil {
		return fmt.Errorf("read-only %s: %v", path, err)
	}
	defer g.Close()
	if err := unix.Mount("", fmt.Sprintf("/proc/self/fd/%d", g.Fd()), "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("read-only %s: %w", path, err)
	}
	return nil
}

// populateDev gives a container's tmpfs /dev the devices every container
// has, bound from the guest's own, and the usual links.
func populateDev(root string) error {
	for _, name := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		if err := mountIn(root, ContainerMount{Destination: "/dev/" + name, Source: "/dev/" + name, Options: []string{"bind"}}); err != nil {
			return err
		}
	}
	dev, err := openIn(root, "/dev", false)
	if err != nil {
		return err
	}
	defer dev.Close()
	d, err := os.Open(fmt.Sprintf("/proc/self/fd/%d", dev.Fd()))
	if err != nil {
		return err
	}
	defer d.Close()
	for name, to := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"} {
		if err := unix.Symlinkat(to, int(d.Fd()), name); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("/dev/%s: %w", name, err)
		}
	}
	return nil
}
