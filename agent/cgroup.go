package agent

// A container's cgroup in the guest: each of a pod's containers gets
// /sys/fs/cgroup/capsa/<container id>, with the memory, pids and CPU
// limits of its spec, and every process of the container (its init and
// its execs) starts in it (clone3's CLONE_INTO_CGROUP) and in a cgroup
// namespace of its own, so the container's /sys/fs/cgroup is its cgroup,
// as runc gives on a cgroup v2 host. The VM bounds the pod; these bound
// one container against the others and give each its own figures and
// its own OOM count (memory.events), which the shim reads.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// CgroupRoot is where the guest's cgroup v2 hierarchy is mounted (by the
// agent, the first time a container needs it).
const CgroupRoot = "/sys/fs/cgroup"

// containerCgroups holds the containers' cgroups.
const containerCgroups = CgroupRoot + "/capsa"

// ContainerCgroup is a container's cgroup, named by the container's id.
type ContainerCgroup struct {
	Name   string       `json:"name"`
	Limits CgroupLimits `json:"limits"`
}

// CgroupLimits are a container's resource limits; zero is none.
type CgroupLimits struct {
	MemoryMax int64  `json:"memory_max,omitempty"` // bytes
	PidsMax   int64  `json:"pids_max,omitempty"`
	CPUQuota  int64  `json:"cpu_quota,omitempty"`  // µs of CPU per CPUPeriod
	CPUPeriod uint64 `json:"cpu_period,omitempty"` // µs; 100000 when zero
	CPUWeight uint64 `json:"cpu_weight,omitempty"` // 1 to 10000
}

// containerName is containerd's rule for an identifier.
var containerName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,75}$`)

// ContainerCgroupPath is the guest path of the named container's cgroup.
func ContainerCgroupPath(name string) string { return filepath.Join(containerCgroups, name) }

// Check refuses a name that is not an identifier and limits out of range.
func (g *ContainerCgroup) Check() error {
	if !containerName.MatchString(g.Name) {
		return fmt.Errorf("container cgroup %q: not a container identifier", g.Name)
	}
	return g.Limits.Check()
}

// Check refuses limits the kernel would.
func (l CgroupLimits) Check() error {
	switch {
	case l.MemoryMax < 0 || l.PidsMax < 0 || l.CPUQuota < 0:
		return errors.New("container limits: a negative limit")
	case l.CPUPeriod != 0 && (l.CPUPeriod < 1000 || l.CPUPeriod > 1000000):
		return fmt.Errorf("container limits: CPU period %d µs, want 1000 to 1000000", l.CPUPeriod)
	case l.CPUQuota != 0 && l.CPUQuota < 1000:
		return fmt.Errorf("container limits: CPU quota %d µs, want at least 1000", l.CPUQuota)
	case l.CPUWeight > 10000:
		return fmt.Errorf("container limits: CPU weight %d, want 1 to 10000", l.CPUWeight)
	}
	return nil
}

// Files are the cgroup interface files that set the limits, and what to
// write to each; a limit of zero writes "max" (none). The shim writes the
// same files to update a running container's limits.
func (l CgroupLimits) Files() [][2]string {
	limit := func(v int64) string {
		if v <= 0 {
			return "max"
		}
		return strconv.FormatInt(v, 10)
	}
	period := l.CPUPeriod
	if period == 0 {
		period = 100000
	}
	out := [][2]string{
		{"memory.max", limit(l.MemoryMax)},
		{"pids.max", limit(l.PidsMax)},
		{"cpu.max", limit(l.CPUQuota) + " " + strconv.FormatUint(period, 10)},
	}
	if l.CPUWeight > 0 {
		out = append(out, [2]string{"cpu.weight", strconv.FormatUint(l.CPUWeight, 10)})
	}
	return out
}

// cgroupControllers are what the containers' cgroups limit.
var cgroupControllers = []string{"memory", "pids", "cpu"}

// enterCgroup makes g's cgroup, with its limits, if it is not there yet
// (a container's first process; its execs join it), and returns it open,
// for the process to start in.
func enterCgroup(g *ContainerCgroup) (*os.File, error) {
	if err := g.Check(); err != nil {
		return nil, err
	}
	path := ContainerCgroupPath(g.Name)
	if f, err := os.Open(path); err == nil {
		return f, nil // an exec joins its container's cgroup as it is
	}
	if err := mountCgroupRoot(); err != nil {
		return nil, err
	}
	for _, dir := range []string{CgroupRoot, containerCgroups} {
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("container cgroups: %w", err)
		}
		for _, c := range cgroupControllers {
			if err := writeCgroupFile(dir, "cgroup.subtree_control", "+"+c); err != nil {
				return nil, fmt.Errorf("container cgroups: enable the %s controller: %w", c, err)
			}
		}
	}
	switch err := os.Mkdir(path, 0o755); {
	case err == nil:
		for _, f := range g.Limits.Files() {
			err := writeCgroupFile(path, f[0], f[1])
			if errors.Is(err, os.ErrNotExist) && strings.HasPrefix(f[1], "max") {
				continue // a kernel without that limit has none to lift
			}
			if err != nil {
				os.Remove(path)
				return nil, fmt.Errorf("container %s: %s %s: %w", g.Name, f[0], f[1], err)
			}
		}
	case !errors.Is(err, os.ErrExist):
		return nil, fmt.Errorf("container %s: make its cgroup: %w", g.Name, err)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("container %s: open its cgroup: %w", g.Name, err)
	}
	return f, nil
}

// writeCgroupFile writes one value to a cgroup interface file.
func writeCgroupFile(dir, name, value string) error {
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// mountCgroupRoot mounts the guest's cgroup v2 hierarchy at CgroupRoot
// unless it is there.
func mountCgroupRoot() error {
	var st unix.Statfs_t
	if err := unix.Statfs(CgroupRoot, &st); err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		return nil
	}
	if err := unix.Mount("cgroup2", CgroupRoot, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "nsdelegate"); err != nil {
		return fmt.Errorf("mount the guest's cgroup hierarchy: %w", err)
	}
	return nil
}

// ExecCgroups is where the guest's agent gives each command it starts
// outside a container a cgroup of its own (Server.ExecCgroups), with no
// limits: it is how the command's timeout finds everything the command
// started, however it forked, set up sessions or process groups, and ends
// it with one write to cgroup.kill, which the kernel applies to children
// still being forked too. Killing the process group instead raced a fork
// bomb's copies forking while the kill went through the group, and those
// it missed went on forking (TestHostileWorkloads: once in CI, the bomb
// outlived the exec and the sandbox stopped answering).
const ExecCgroups = CgroupRoot + "/capsa-exec"

// makeExecCgroup makes the cgroup dir/name for one command, and returns
// it open, for the command to start in (clone3's CLONE_INTO_CGROUP).
func makeExecCgroup(dir, name string) (*os.File, error) {
	if dir == ExecCgroups {
		if err := mountCgroupRoot(); err != nil {
			return nil, err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("exec cgroups: %w", err)
	}
	path := filepath.Join(dir, name)
	if err := os.Mkdir(path, 0o755); err != nil {
		return nil, fmt.Errorf("exec cgroup: %w", err)
	}
	f, err := os.Open(path)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("exec cgroup: %w", err)
	}
	return f, nil
}

// killCgroup ends every process in the cgroup at path (cgroup.kill),
// waits, for at most killLeftoversFor, until the kernel reports it empty,
// and removes it. A cgroup already gone (its command ended with nothing
// left behind) is no error.
func killCgroup(path string) error {
	if err := writeCgroupFile(path, "cgroup.kill", "1"); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("kill cgroup %s: %w", path, err)
	}
	deadline := time.Now().Add(killLeftoversFor)
	for {
		err := os.Remove(path)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s after its kill: %w", path, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
