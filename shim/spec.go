package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/capsa-sandbox/capsa/agent"
)

// The CRI annotations a pod's containers carry.
const (
	annotationSandboxID     = "io.kubernetes.cri.sandbox-id"
	annotationContainerType = "io.kubernetes.cri.container-type"
	annotationCPUQuota      = "io.kubernetes.cri.sandbox-cpu-quota"
	annotationCPUPeriod     = "io.kubernetes.cri.sandbox-cpu-period"
	annotationMemory        = "io.kubernetes.cri.sandbox-memory"
	containerTypeSandbox    = "sandbox"
)

// Pod VM sizes when neither annotations nor the spec's resources say.
const (
	defaultCPUs      = 1
	defaultMemoryMiB = 512
	minMemoryMiB     = 128
	maxMemoryMiB     = 64 << 10
	maxCPUs          = 64
)

// maxSpecBytes bounds a bundle's config.json.
const maxSpecBytes = 4 << 20

// readSpec reads and decodes the OCI spec of the bundle at dir.
func readSpec(dir string) (*specs.Spec, error) {
	f, err := os.Open(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("read the bundle's spec: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() > maxSpecBytes {
		return nil, fmt.Errorf("the bundle's config.json: %d bytes, more than %d", st.Size(), maxSpecBytes)
	}
	var s specs.Spec
	if err := json.NewDecoder(f).Decode(&s); err != nil {
		return nil, fmt.Errorf("the bundle's config.json: %w", err)
	}
	return &s, nil
}

// groupID is the pod a container belongs to: its CRI sandbox's id, or
// its own id (ctr run: a container alone in its VM).
func groupID(s *specs.Spec, id string) string {
	if g := s.Annotations[annotationSandboxID]; g != "" {
		return g
	}
	return id
}

// isSandbox reports whether the container is its pod's sandbox
// container (CRI's pause container, or a container alone).
func isSandbox(s *specs.Spec) bool {
	t, ok := s.Annotations[annotationContainerType]
	return !ok || t == containerTypeSandbox
}

// hostNamespaces are the namespaces a container must have of its own: one
// missing means the host's (hostNetwork, hostPID, hostIPC), which a VM
// cannot share.
var hostNamespaces = map[specs.LinuxNamespaceType]string{
	specs.NetworkNamespace: "hostNetwork",
	specs.PIDNamespace:     "hostPID",
	specs.IPCNamespace:     "hostIPC",
}

// checkSpec refuses a spec capsa cannot honour, naming the field.
func checkSpec(s *specs.Spec) error {
	if s.Process == nil {
		return errors.New("spec: process: missing (a task needs a process)")
	}
	if len(s.Process.Args) == 0 {
		return errors.New("spec: process.args: empty")
	}
	if s.Root == nil || s.Root.Path == "" {
		return errors.New("spec: root.path: missing")
	}
	if s.Hooks != nil && (len(s.Hooks.Prestart)+len(s.Hooks.CreateRuntime)+len(s.Hooks.CreateContainer)+len(s.Hooks.StartContainer)+len(s.Hooks.Poststart)+len(s.Hooks.Poststop) > 0) {
		return errors.New("spec: hooks: capsa runs no hooks (they would run on the host or in a guest that lacks their programs)")
	}
	if caps := s.Process.Capabilities; caps != nil && slices.Contains(caps.Bounding, "CAP_SYS_ADMIN") {
		return errors.New("spec: process.capabilities: CAP_SYS_ADMIN (a privileged container) is refused: a capsa pod's containers share one guest kernel")
	}
	if s.Linux == nil {
		return errors.New("spec: linux: missing")
	}
	if len(s.Linux.Devices) > 0 {
		return fmt.Errorf("spec: linux.devices: %s: host devices (and GPUs) cannot be passed into a capsa microVM", s.Linux.Devices[0].Path)
	}
	for typ, name := range hostNamespaces {
		if !slices.ContainsFunc(s.Linux.Namespaces, func(n specs.LinuxNamespace) bool { return n.Type == typ }) {
			return fmt.Errorf("spec: linux.namespaces: no %s namespace means the host's (%s), which a microVM cannot share", typ, name)
		}
	}
	if sc := s.Linux.Seccomp; sc != nil && sc.ListenerPath != "" {
		return errors.New("spec: linux.seccomp.listenerPath: capsa has no seccomp agent to hand notifications to")
	}
	if s.Process.User.UID > math.MaxInt32 || s.Process.User.GID > math.MaxInt32 {
		return fmt.Errorf("spec: process.user: %d:%d out of range", s.Process.User.UID, s.Process.User.GID)
	}
	for _, m := range s.Mounts {
		if !filepath.IsAbs(m.Destination) {
			return fmt.Errorf("spec: mounts: destination %q is not absolute", m.Destination)
		}
		if isBind(m) {
			if err := checkBindSource(m.Source); err != nil {
				return fmt.Errorf("spec: mounts: %s: %w", m.Destination, err)
			}
		}
	}
	return nil
}

// isBind reports whether m is a bind mount of a host path.
func isBind(m specs.Mount) bool {
	return m.Type == "bind" || slices.Contains(m.Options, "bind") || slices.Contains(m.Options, "rbind")
}

// isPodShm reports whether m is CRI's bind of the pod's shared /dev/shm.
func isPodShm(m specs.Mount) bool { return filepath.Clean(m.Destination) == "/dev/shm" && isBind(m) }

// checkBindSource refuses a bind mount's host path that would hand the
// guest a host kernel interface or a device.
func checkBindSource(src string) error {
	if !filepath.IsAbs(src) {
		return fmt.Errorf("source %q is not an absolute host path", src)
	}
	clean := filepath.Clean(src)
	for _, no := range []string{"/proc", "/sys", "/dev"} {
		if clean == no || strings.HasPrefix(clean, no+"/") {
			if clean == "/dev/shm" || strings.HasPrefix(clean, "/dev/shm/") {
				continue
			}
			return fmt.Errorf("source %s: the host's %s cannot be shared into a microVM", clean, no)
		}
	}
	st, err := os.Stat(clean)
	if err != nil {
		return fmt.Errorf("source: %w", err)
	}
	if !st.IsDir() && !st.Mode().IsRegular() {
		return fmt.Errorf("source %s: %s is neither a directory nor a regular file", clean, st.Mode().Type())
	}
	return nil
}

// podSize is the pod VM's vCPUs and memory: from CRI's sandbox
// annotations, else the sandbox container's resources, else defaults.
func podSize(s *specs.Spec) (cpus, memMiB int) {
	cpus, memMiB = defaultCPUs, defaultMemoryMiB
	quota, _ := strconv.ParseInt(s.Annotations[annotationCPUQuota], 10, 64)
	period, _ := strconv.ParseInt(s.Annotations[annotationCPUPeriod], 10, 64)
	mem, _ := strconv.ParseInt(s.Annotations[annotationMemory], 10, 64)
	if r := resources(s); r != nil {
		if r.CPU != nil && r.CPU.Quota != nil && r.CPU.Period != nil && quota == 0 {
			quota, period = *r.CPU.Quota, int64(*r.CPU.Period)
		}
		if r.Memory != nil && r.Memory.Limit != nil && mem == 0 {
			mem = *r.Memory.Limit
		}
	}
	if quota > 0 && period > 0 {
		cpus = int((quota + period - 1) / period)
	}
	if mem > 0 {
		memMiB = int(mem >> 20)
	}
	cpus = min(max(cpus, 1), maxCPUs)
	memMiB = min(max(memMiB, minMemoryMiB), maxMemoryMiB)
	return cpus, memMiB
}

func resources(s *specs.Spec) *specs.LinuxResources {
	if s.Linux == nil {
		return nil
	}
	return s.Linux.Resources
}

// containerOf maps a spec's process to the agent's container request:
// id is the container's, root its root in the guest, and binds maps each
// bind mount's host source to its guest path.
func containerOf(s *specs.Spec, p *specs.Process, id, root string, binds map[string]string) (*agent.Container, error) {
	c := &agent.Container{
		Cgroup: &agent.ContainerCgroup{Name: id, Limits: limitsOf(resources(s))},
		Root:   root, Readonly: s.Root.Readonly,
		UID: p.User.UID, GID: p.User.GID, Groups: p.User.AdditionalGids,
		NoNewPrivileges: p.NoNewPrivileges,
	}
	for _, r := range p.Rlimits {
		c.Rlimits = append(c.Rlimits, agent.Rlimit{Type: r.Type, Soft: r.Soft, Hard: r.Hard})
	}
	if s.Linux != nil {
		c.MaskedPaths, c.ReadonlyPaths = s.Linux.MaskedPaths, s.Linux.ReadonlyPaths
	}
	if s.Linux != nil && s.Linux.Seccomp != nil {
		c.Seccomp = seccompOf(s.Linux.Seccomp)
	}
	if caps := p.Capabilities; caps != nil {
		c.Capabilities = &agent.Capabilities{Bounding: caps.Bounding, Effective: caps.Effective,
			Permitted: caps.Permitted, Inheritable: caps.Inheritable, Ambient: caps.Ambient}
	}
	for _, m := range s.Mounts {
		cm := agent.ContainerMount{Destination: m.Destination, Type: m.Type, Source: m.Source, Options: m.Options}
		if isPodShm(m) {
			// The pod's containers share the guest's /dev/shm, guest
			// memory, not a host tmpfs over 9P.
			c.Mounts = append(c.Mounts, agent.ContainerMount{Destination: "/dev/shm", Type: "bind", Source: "/dev/shm", Options: []string{"rbind", "nosuid", "nodev"}})
			continue
		}
		if isBind(m) {
			g, ok := binds[m.Source]
			if !ok {
				return nil, fmt.Errorf("spec: mounts: %s: source %s was not shared", m.Destination, m.Source)
			}
			cm.Source, cm.Type = g, "bind"
		}
		c.Mounts = append(c.Mounts, cm)
	}
	if err := c.Check(); err != nil {
		return nil, fmt.Errorf("spec: %w", err)
	}
	return c, nil
}

// seccompOf is the spec's seccomp profile for the guest's helper, which
// compiles it for the guest's x86-64 ABI (its architectures list is
// not needed: other ABIs' calls fail there).
func seccompOf(sc *specs.LinuxSeccomp) *agent.Seccomp {
	out := &agent.Seccomp{DefaultAction: string(sc.DefaultAction), DefaultErrno: sc.DefaultErrnoRet}
	for _, f := range sc.Flags {
		out.Flags = append(out.Flags, string(f))
	}
	for _, r := range sc.Syscalls {
		rule := agent.SeccompRule{Names: r.Names, Action: string(r.Action), Errno: r.ErrnoRet}
		for _, a := range r.Args {
			rule.Args = append(rule.Args, agent.SeccompArg{Index: a.Index, Value: a.Value, ValueTwo: a.ValueTwo, Op: string(a.Op)})
		}
		out.Rules = append(out.Rules, rule)
	}
	return out
}

// limitsOf are a container's cgroup limits in the guest, from its spec's
// resources: memory, pids, CPU quota and shares (as a weight, by runc's
// conversion of cgroup v1 shares to v2 weights).
func limitsOf(r *specs.LinuxResources) agent.CgroupLimits {
	var l agent.CgroupLimits
	if r == nil {
		return l
	}
	if r.Memory != nil && r.Memory.Limit != nil && *r.Memory.Limit > 0 {
		l.MemoryMax = *r.Memory.Limit
	}
	if r.Pids != nil && r.Pids.Limit > 0 {
		l.PidsMax = r.Pids.Limit
	}
	if c := r.CPU; c != nil {
		if c.Quota != nil && *c.Quota > 0 {
			l.CPUQuota = *c.Quota
			if c.Period != nil {
				l.CPUPeriod = *c.Period
			}
		}
		if c.Shares != nil && *c.Shares >= 2 {
			l.CPUWeight = 1 + ((min(*c.Shares, 262144) - 2) * 9999 / 262142)
		}
	}
	return l
}
