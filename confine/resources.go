package confine

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// setRlimits fixes the limits a compromised VMM could otherwise raise or
// use: no core dumps (a core would hold the guest's memory), and the
// descriptor and process limits held where they are (hard = soft), so
// the process cannot take more than it has been given. Address space is
// not limited: guest memory is one large mapping.
func setRlimits() (string, error) {
	var done []string
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{}); err != nil {
		return "", fmt.Errorf("confine: RLIMIT_CORE: %w", err)
	}
	done = append(done, "core=0")
	for _, r := range []struct {
		res  int
		name string
	}{{unix.RLIMIT_NOFILE, "nofile"}, {unix.RLIMIT_NPROC, "nproc"}} {
		var l unix.Rlimit
		if err := unix.Getrlimit(r.res, &l); err != nil {
			return "", fmt.Errorf("confine: get %s: %w", r.name, err)
		}
		l.Max = l.Cur
		if err := unix.Setrlimit(r.res, &l); err != nil {
			return "", fmt.Errorf("confine: set %s: %w", r.name, err)
		}
		done = append(done, fmt.Sprintf("%s=%s", r.name, limitString(l.Cur)))
	}
	return strings.Join(done, " "), nil
}

func limitString(v uint64) string {
	if v == unix.RLIM_INFINITY {
		return "unlimited"
	}
	return strconv.FormatUint(v, 10)
}

// cgroupRoot is where cgroup v2 is mounted.
const cgroupRoot = "/sys/fs/cgroup"

// joinCgroup moves the process into a cgroup of its own, named name,
// below its current one, with memory.max = memory (when not 0), pids.max
// = pids and, when cpus is not 0, cpu.max = cpus CPUs' time a period,
// where cgroup v2 is delegated to it: its current cgroup's
// subtree_control already gives children the memory and pids controllers,
// and it may make a child there. Otherwise it returns errUnavailable,
// saying why. Without the cpu controller delegated the cgroup has no
// cpu.max, and the report says so.
func joinCgroup(name string, memory int64, pids int, cpus float64) (string, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(cgroupRoot, &fs); err != nil || fs.Type != unix.CGROUP2_SUPER_MAGIC {
		return "", fmt.Errorf("%w: no cgroup v2 at %s", errUnavailable, cgroupRoot)
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", fmt.Errorf("%w: %v", errUnavailable, err)
	}
	var rel string
	for sc := bufio.NewScanner(bytes.NewReader(self)); sc.Scan(); {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			rel = p
		}
	}
	if rel == "" {
		return "", fmt.Errorf("%w: not in a cgroup v2 hierarchy", errUnavailable)
	}
	parent := filepath.Join(cgroupRoot, filepath.Clean("/"+rel))
	ctl, err := os.ReadFile(filepath.Join(parent, "cgroup.subtree_control"))
	if err != nil {
		return "", fmt.Errorf("%w: %v", errUnavailable, err)
	}
	have := strings.Fields(string(ctl))
	for _, c := range []string{"memory", "pids"} {
		if !slices.Contains(have, c) {
			return "", fmt.Errorf("%w: %s does not delegate the %s controller to its children", errUnavailable, parent, c)
		}
	}
	dir := filepath.Join(parent, "capsa-"+name+"-"+strconv.Itoa(os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return "", fmt.Errorf("%w: %v", errUnavailable, err)
	}
	write := func(file, v string) error { return os.WriteFile(filepath.Join(dir, file), []byte(v), 0) }
	err = write("pids.max", strconv.Itoa(pids))
	if err == nil && memory > 0 {
		err = write("memory.max", strconv.FormatInt(memory, 10))
	}
	cpu := "cpu.max none"
	switch {
	case cpus <= 0:
	case !slices.Contains(have, "cpu"):
		cpu = "cpu.max off: " + parent + " does not delegate the cpu controller"
	case err == nil:
		v := cpuMax(cpus)
		err = write("cpu.max", v)
		cpu = "cpu.max " + v
	}
	if err == nil {
		err = write("cgroup.procs", strconv.Itoa(os.Getpid()))
	}
	if err != nil {
		os.Remove(dir)
		return "", fmt.Errorf("%w: %v", errUnavailable, err)
	}
	return fmt.Sprintf("%s (memory.max %d, pids.max %d, %s)", dir, memory, pids, cpu), nil
}

// cpuPeriod is cpu.max's period, in microseconds (the kernel's default).
const cpuPeriod = 100000

// cpuMax is cpu.max's value for cpus CPUs: "QUOTA PERIOD", the quota at
// least the kernel's least, 1 ms.
func cpuMax(cpus float64) string {
	return fmt.Sprintf("%d %d", max(int64(cpus*cpuPeriod+0.5), 1000), cpuPeriod)
}

// errUnavailable marks a layer the host cannot give (an old kernel, no
// delegation): the others still apply, and the report says why.
var errUnavailable = errors.New("unavailable")
