package shim

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	seccompprofile "github.com/containerd/containerd/contrib/seccomp"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// goodSpec is what `ctr run` gives a container, in brief.
func goodSpec() *specs.Spec {
	return &specs.Spec{
		Process: &specs.Process{Args: []string{"sh"}, Cwd: "/", Env: []string{"PATH=/bin"},
			Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN", "CAP_KILL"}}},
		Root: &specs.Root{Path: "rootfs"},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{
			{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			{Type: specs.MountNamespace}, {Type: specs.NetworkNamespace, Path: "/var/run/netns/cni-1"},
		}},
	}
}

func TestCheckSpecRefusesFieldByField(t *testing.T) {
	if err := checkSpec(goodSpec()); err != nil {
		t.Fatalf("checkSpec(ctr's spec) = %v, want nil", err)
	}
	file := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	withoutNS := func(typ specs.LinuxNamespaceType) func(*specs.Spec) {
		return func(s *specs.Spec) {
			var keep []specs.LinuxNamespace
			for _, n := range s.Linux.Namespaces {
				if n.Type != typ {
					keep = append(keep, n)
				}
			}
			s.Linux.Namespaces = keep
		}
	}
	for _, c := range []struct {
		name, want string
		change     func(*specs.Spec)
	}{
		{"no process", "process: missing", func(s *specs.Spec) { s.Process = nil }},
		{"no args", "process.args", func(s *specs.Spec) { s.Process.Args = nil }},
		{"no root", "root.path", func(s *specs.Spec) { s.Root = nil }},
		{"hooks", "hooks", func(s *specs.Spec) {
			s.Hooks = &specs.Hooks{CreateRuntime: []specs.Hook{{Path: "/usr/bin/nvidia-ctk"}}}
		}},
		{"privileged", "process.capabilities: CAP_SYS_ADMIN", func(s *specs.Spec) {
			s.Process.Capabilities.Bounding = append(s.Process.Capabilities.Bounding, "CAP_SYS_ADMIN")
		}},
		{"no linux", "linux: missing", func(s *specs.Spec) { s.Linux = nil }},
		{"devices", "linux.devices: /dev/nvidia0", func(s *specs.Spec) {
			s.Linux.Devices = []specs.LinuxDevice{{Path: "/dev/nvidia0", Type: "c", Major: 195}}
		}},
		{"host network", "hostNetwork", withoutNS(specs.NetworkNamespace)},
		{"host pid", "hostPID", withoutNS(specs.PIDNamespace)},
		{"host ipc", "hostIPC", withoutNS(specs.IPCNamespace)},
		{"seccomp notifications", "linux.seccomp.listenerPath", func(s *specs.Spec) {
			s.Linux.Seccomp = &specs.LinuxSeccomp{DefaultAction: specs.ActErrno, ListenerPath: "/run/seccomp-agent.sock"}
		}},
		{"relative mount", "mounts: destination", func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "etc/hosts", Type: "bind", Source: file})
		}},
		{"bind of /proc", "host's /proc", func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/host", Type: "bind", Source: "/proc/1/root"})
		}},
		{"bind of a device", "host's /dev", func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/kvm", Options: []string{"rbind"}, Source: "/dev/kvm"})
		}},
		{"bind of a missing path", "no such file", func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/x", Type: "bind", Source: file + "-missing"})
		}},
		{"relative bind source", "not an absolute host path", func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/x", Type: "bind", Source: "hosts"})
		}},
	} {
		s := goodSpec()
		c.change(s)
		err := checkSpec(s)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: checkSpec = %v, want an error naming %q", c.name, err, c.want)
		}
	}
	// A bind of a host file (CRI's /etc/hosts) and of /dev/shm are fine.
	s := goodSpec()
	s.Mounts = append(s.Mounts, specs.Mount{Destination: "/etc/hosts", Type: "bind", Source: file, Options: []string{"ro"}},
		specs.Mount{Destination: "/dev/shm", Type: "bind", Source: "/dev/shm"})
	if err := checkSpec(s); err != nil {
		t.Errorf("checkSpec with binds of a file and /dev/shm = %v, want nil", err)
	}
}

func TestContainerOfMapsTheProcessAndMounts(t *testing.T) {
	s := goodSpec()
	s.Root.Readonly = true
	s.Mounts = append(s.Mounts, specs.Mount{Destination: "/etc/hosts", Type: "bind", Source: "/host/hosts", Options: []string{"rbind", "ro"}})
	p := s.Process
	p.User = specs.User{UID: 1000, GID: 100, AdditionalGids: []uint32{27}}
	p.Rlimits = []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Soft: 1024, Hard: 4096}}
	p.NoNewPrivileges = true
	c, err := containerOf(s, p, "c1", "/capsa-pod/c1/rootfs", map[string]string{"/host/hosts": "/capsa-pod/c1/mounts/2"})
	if err != nil {
		t.Fatal(err)
	}
	if c.Root != "/capsa-pod/c1/rootfs" || !c.Readonly || c.UID != 1000 || c.GID != 100 || len(c.Groups) != 1 || c.Groups[0] != 27 || !c.NoNewPrivileges {
		t.Errorf("containerOf = %+v, want the spec's root, ids and no_new_privs", c)
	}
	if len(c.Rlimits) != 1 || c.Rlimits[0].Type != "RLIMIT_NOFILE" || c.Rlimits[0].Hard != 4096 {
		t.Errorf("rlimits = %+v", c.Rlimits)
	}
	last := c.Mounts[len(c.Mounts)-1]
	if last.Source != "/capsa-pod/c1/mounts/2" || last.Type != "bind" || last.Destination != "/etc/hosts" {
		t.Errorf("the bind mount = %+v, want its guest source", last)
	}
	if _, err := containerOf(s, p, "c1", "/capsa-pod/c1/rootfs", nil); err == nil || !strings.Contains(err.Error(), "was not shared") {
		t.Errorf("containerOf without the bind's share = %v, want an error", err)
	}
	p.Rlimits = []specs.POSIXRlimit{{Type: "RLIMIT_BOGUS"}}
	if _, err := containerOf(s, p, "c1", "/capsa-pod/c1/rootfs", map[string]string{"/host/hosts": "/g"}); err == nil || !strings.Contains(err.Error(), "RLIMIT_BOGUS") {
		t.Errorf("containerOf with an unknown rlimit = %v, want it named", err)
	}
}

func TestPodSize(t *testing.T) {
	s := goodSpec()
	if c, m := podSize(s); c != defaultCPUs || m != defaultMemoryMiB {
		t.Errorf("podSize(no resources) = %d, %d; want the defaults", c, m)
	}
	quota, period, limit := int64(250000), uint64(100000), int64(1<<30)
	s.Linux.Resources = &specs.LinuxResources{CPU: &specs.LinuxCPU{Quota: &quota, Period: &period}, Memory: &specs.LinuxMemory{Limit: &limit}}
	if c, m := podSize(s); c != 3 || m != 1024 {
		t.Errorf("podSize(2.5 CPUs, 1 GiB) = %d, %d; want 3, 1024", c, m)
	}
	s.Annotations = map[string]string{annotationCPUQuota: "100000", annotationCPUPeriod: "100000", annotationMemory: "268435456"}
	if c, m := podSize(s); c != 1 || m != 256 {
		t.Errorf("podSize(annotations: 1 CPU, 256 MiB) = %d, %d; want the annotations over the resources", c, m)
	}
	s.Annotations = map[string]string{annotationMemory: "1000"}
	s.Linux.Resources = nil
	if _, m := podSize(s); m != minMemoryMiB {
		t.Errorf("podSize(1000 bytes) memory = %d, want the least, %d", m, minMemoryMiB)
	}
}

func TestPodName(t *testing.T) {
	for _, c := range []struct{ ns, group string }{
		{"default", "c1"},
		{"k8s.io", strings.Repeat("ab12", 16)},
		{"../weird ns", "id/with/slashes"},
		{"-", "-"},
	} {
		n := podName(c.ns, c.group)
		if err := supervisor.CheckName(n); err != nil {
			t.Errorf("podName(%q, %q) = %q: %v", c.ns, c.group, n, err)
		}
	}
	if podName("k8s.io", strings.Repeat("a", 64)) == podName("k8s.io", strings.Repeat("a", 63)+"b") {
		t.Error("podName gives two long ids the same name")
	}
	if got := podName("default", "c1"); got != "default-c1" {
		t.Errorf("podName(default, c1) = %q, want default-c1", got)
	}
	s := goodSpec()
	if g := groupID(s, "c1"); g != "c1" || !isSandbox(s) {
		t.Errorf("a container alone: group %q, sandbox %v; want its own id, and a sandbox", g, isSandbox(s))
	}
	s.Annotations = map[string]string{annotationSandboxID: "pod1", annotationContainerType: "container"}
	if g := groupID(s, "c1"); g != "pod1" || isSandbox(s) {
		t.Errorf("a pod's app container: group %q, sandbox %v; want pod1, not a sandbox", g, isSandbox(s))
	}
}

func TestMetricsOf(t *testing.T) {
	m := metricsOf(&sandbox.Stats{CPUTime: 2 * time.Second, VMMCPUTime: 500 * time.Millisecond,
		MemoryResident: 100 << 20, MemoryBytes: 512 << 20, DiskReadBytes: 7, DiskWrites: 3})
	if m.CPU.UsageUsec != 2500000 || m.CPU.UserUsec != 2000000 || m.CPU.SystemUsec != 500000 {
		t.Errorf("cpu = %+v, want the vCPUs' time as user, the VMM's as system", m.CPU)
	}
	if m.Memory.Usage != 100<<20 || m.Memory.UsageLimit != 512<<20 {
		t.Errorf("memory = %+v, want the resident RAM against the guest's size", m.Memory)
	}
	if len(m.Io.Usage) != 1 || m.Io.Usage[0].Rbytes != 7 || m.Io.Usage[0].Wios != 3 {
		t.Errorf("io = %+v", m.Io.Usage)
	}
	if _, err := typeurl.MarshalAny(m); err != nil {
		t.Errorf("the metrics do not marshal as containerd reads them: %v", err)
	}
}

func TestStatValue(t *testing.T) {
	events := []byte("low 0\nhigh 0\nmax 12\noom 2\noom_kill 3\noom_group_kill 0\n")
	if n := statValue(events, "oom_kill"); n != 3 {
		t.Errorf("statValue(oom_kill) = %d, want 3 (not oom's 2 or oom_group_kill's 0)", n)
	}
	if n := statValue(events, "oom"); n != 2 {
		t.Errorf("statValue(oom) = %d, want 2", n)
	}
	if n := statValue([]byte("low 1\n"), "oom_kill"); n != -1 {
		t.Errorf("statValue without the key = %d, want -1", n)
	}
}

// TestContainerMetrics: a container's cgroup files as CRI reads them; a
// memory limit of max is the VM's size, one above it the VM's too.
func TestContainerMetrics(t *testing.T) {
	files := map[string][]byte{
		"memory.current": []byte("52428800\n"), "memory.max": []byte("104857600\n"),
		"memory.stat":   []byte("anon 40000000\nfile 12000000\ninactive_file 8000000\nactive_file 4000000\n"),
		"memory.events": []byte("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n"),
		"cpu.stat":      []byte("usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 10\nnr_throttled 2\nthrottled_usec 300\n"),
		"pids.current":  []byte("3\n"), "pids.max": []byte("max\n"),
	}
	m := containerMetrics(files, 512<<20)
	if m.Memory.Usage != 52428800 || m.Memory.UsageLimit != 104857600 || m.Memory.InactiveFile != 8000000 || m.Memory.Anon != 40000000 {
		t.Errorf("memory = %+v", m.Memory)
	}
	if m.CPU.UsageUsec != 1500 || m.CPU.UserUsec != 1000 || m.CPU.NrThrottled != 2 || m.CPU.ThrottledUsec != 300 {
		t.Errorf("cpu = %+v", m.CPU)
	}
	if m.Pids.Current != 3 || m.Pids.Limit != 0 || m.MemoryEvents.OomKill != 1 || m.MemoryEvents.Max != 5 {
		t.Errorf("pids = %+v, events = %+v", m.Pids, m.MemoryEvents)
	}
	for _, max := range []string{"max\n", "1099511627776\n"} {
		files["memory.max"] = []byte(max)
		if m := containerMetrics(files, 512<<20); m.Memory.UsageLimit != 512<<20 {
			t.Errorf("memory.max %q: limit %d, want the VM's 512 MiB", max, m.Memory.UsageLimit)
		}
	}
	if _, err := typeurl.MarshalAny(m); err != nil {
		t.Errorf("the metrics do not marshal as containerd reads them: %v", err)
	}
}

// TestLimitsOf: a spec's resources as the container's cgroup limits.
func TestLimitsOf(t *testing.T) {
	mem, pids, quota, period, shares := int64(64<<20), int64(100), int64(50000), uint64(100000), uint64(1024)
	l := limitsOf(&specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &mem}, Pids: &specs.LinuxPids{Limit: pids},
		CPU: &specs.LinuxCPU{Quota: &quota, Period: &period, Shares: &shares}})
	if l.MemoryMax != 64<<20 || l.PidsMax != 100 || l.CPUQuota != 50000 || l.CPUPeriod != 100000 || l.CPUWeight != 39 {
		t.Errorf("limitsOf = %+v, want 64 MiB, 100 pids, 50000/100000 µs, weight 39 (runc's for 1024 shares)", l)
	}
	if l := limitsOf(nil); l != (agent.CgroupLimits{}) {
		t.Errorf("limitsOf(nil) = %+v, want none", l)
	}
	c, err := containerOf(goodSpec(), goodSpec().Process, "c1", "/capsa-pod/c1/rootfs", nil)
	if err != nil || c.Cgroup == nil || c.Cgroup.Name != "c1" {
		t.Errorf("containerOf's cgroup = %+v, %v; want the container's, named by its id", c.Cgroup, err)
	}
}

// TestContainerOfTakesContainerdsDefaultProfile: the profile containerd
// gives RuntimeDefault and `ctr run --seccomp` reaches the guest whole,
// and one the guest cannot apply is refused before anything starts.
func TestContainerOfTakesContainerdsDefaultProfile(t *testing.T) {
	s := goodSpec()
	s.Linux.Seccomp = seccompprofile.DefaultProfile(s)
	c, err := containerOf(s, s.Process, "c1", "/capsa-pod/c1/rootfs", nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Seccomp == nil || c.Seccomp.DefaultAction != "SCMP_ACT_ERRNO" || len(c.Seccomp.Rules) != len(s.Linux.Seccomp.Syscalls) {
		t.Fatalf("seccomp = %+v, want containerd's default profile's %d rules", c.Seccomp, len(s.Linux.Seccomp.Syscalls))
	}
	var masked bool
	for _, r := range c.Seccomp.Rules {
		for _, a := range r.Args {
			masked = masked || a.Op == "SCMP_CMP_MASKED_EQ"
		}
	}
	if !masked {
		t.Error("no SCMP_CMP_MASKED_EQ comparison came through (containerd's profile has clone's)")
	}
	s.Linux.Seccomp.Syscalls = append(s.Linux.Seccomp.Syscalls, specs.LinuxSyscall{Names: []string{"ioctl"}, Action: specs.ActNotify})
	if _, err := containerOf(s, s.Process, "c1", "/capsa-pod/c1/rootfs", nil); err == nil || !strings.Contains(err.Error(), "SCMP_ACT_NOTIFY") {
		t.Errorf("containerOf with a notify rule = %v, want SCMP_ACT_NOTIFY refused", err)
	}
}
