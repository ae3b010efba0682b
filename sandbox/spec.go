package sandbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/capsa-sandbox/capsa/image"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/ratelimit"
)

// Spec is a sandbox's description as data: what the builder fills, what
// the CLI, a detached sandbox's supervisor and its state record share, and
// what snapshots embed. It is plain JSON. What only exists while a sandbox
// runs (the logger, the console writer, the main process's stdin and
// output, a pull progress callback) is given at start, not stored here.
//
// A Spec is checked when it becomes a Workload (FromSpec), by the same
// builder methods, so a bad one gets the same errors before anything boots.
type Spec struct {
	CPUs      int `json:"cpus"`
	MemoryMiB int `json:"memory_mib"`
	// CPUQuota is the most host CPUs the sandbox's VMM process may use,
	// its vCPUs and its own threads together (Builder.CPUQuota); 0: as
	// many as it has vCPUs.
	CPUQuota float64 `json:"cpu_quota,omitempty"`
	// Balloon gives the host back the memory the guest frees
	// (Builder.Balloon).
	Balloon bool `json:"balloon,omitempty"`
	// Limits are the sandbox's I/O limits (Builder.Limits); zero: none.
	Limits ratelimit.Limits `json:"limits,omitzero"`
	Env    []string         `json:"env,omitempty"`    // KEY=VALUE for every process
	Kernel string           `json:"kernel,omitempty"` // empty: the built-in kernel
	Initrd string           `json:"initrd,omitempty"` // empty: the built-in initramfs

	ReadyTimeout time.Duration `json:"ready_timeout_ns,omitempty"`
	Watchdog     time.Duration `json:"watchdog_ns,omitempty"`
	OutputLimit  int64         `json:"output_limit,omitempty"`
	VsockSocket  string        `json:"vsock_socket,omitempty"`

	Shares []ShareSpec `json:"shares,omitempty"`
	// ShareFS is the transport of Shares (Builder.ShareFS): "" or "9p",
	// or "virtiofs".
	ShareFS string       `json:"share_fs,omitempty"`
	Volumes []VolumeSpec `json:"volumes,omitempty"` // mounted after the shares
	Disks   []DiskSpec   `json:"disks,omitempty"`
	Network *NetworkSpec `json:"network,omitempty"` // nil: no NIC
	Patches []Patch      `json:"patches,omitempty"`
	Image   *ImageSpec   `json:"image,omitempty"` // nil: the initramfs is the root
	Hub     *HubSpec     `json:"hub,omitempty"`   // nil: no mailbox or key-value access

	Main ProcessSpec `json:"main"`
}

// ShareSpec is a shared host directory (Builder.Share).
type ShareSpec struct {
	Host  string    `json:"host"`
	Guest string    `json:"guest"`
	Mode  ShareMode `json:"mode"`
}

// DiskSpec is a host file attached as a block device (Builder.Disk).
type DiskSpec struct {
	Path string    `json:"path"`
	Mode ShareMode `json:"mode"`
}

// NetworkSpec is the sandbox's NIC and NAT (Builder.Network, Publish,
// DNSServer, TLSIntercept, Secret, UpstreamCA).
type NetworkSpec struct {
	Policy    *netstack.Policy `json:"policy"`            // nil: netstack.PublicOnly()
	Publish   []string         `json:"publish,omitempty"` // as Publish takes them
	DNSServer string           `json:"dns_server,omitempty"`
	// Intercept and Secrets' hosts are the hosts whose HTTPS the NAT
	// intercepts; Secrets never hold values. UpstreamCAs are PEM files on
	// the host it trusts beside the host's store.
	Intercept   []string     `json:"tls_intercept,omitempty"`
	Secrets     []SecretSpec `json:"secrets,omitempty"`
	Headers     []HeaderSpec `json:"header_rules,omitempty"` // Builder.Header
	UpstreamCAs []string     `json:"upstream_cas,omitempty"`
	// EgressProxy tunnels the guest's outbound TCP through a SOCKS5
	// proxy (Builder.EgressProxy); never its password.
	EgressProxy *EgressProxySpec `json:"egress_proxy,omitempty"`
	// Tap, instead of the NAT, plugs the NIC into a tap device of the
	// VMM process's network namespace (Builder.Tap); Policy is then nil.
	Tap *TapSpec `json:"tap,omitempty"`
}

// TapSpec is a NIC on a host tap device (Builder.Tap): the guest takes
// Address (IPv4, with its prefix) on its eth0, with MAC, routes through
// Gateway, and sends and receives frames of at most MTU.
type TapSpec struct {
	Name    string `json:"name"`
	MAC     string `json:"mac"`
	Address string `json:"address"`
	Gateway string `json:"gateway,omitempty"`
	MTU     int    `json:"mtu,omitempty"` // 0: 1500
}

// ImageSpec is an OCI image as the root filesystem (Builder.OCI and the
// image options).
type ImageSpec struct {
	Ref  string   `json:"ref"`
	Args []string `json:"args,omitempty"` // replace the image's CMD
	// Entrypoint replaces the image's ENTRYPOINT when not nil (and drops
	// its CMD); an empty, non-nil one clears it.
	Entrypoint []string   `json:"entrypoint"`
	Pull       PullPolicy `json:"pull,omitempty"`
	Store      string     `json:"store,omitempty"` // empty: image.DefaultDir
	Insecure   []string   `json:"insecure,omitempty"`
	RootfsSize int64      `json:"rootfs_size,omitempty"`
}

// ProcessSpec is the sandbox's main process. With an image, Argv is empty
// and the image says what runs (ImageSpec.Args, Entrypoint).
type ProcessSpec struct {
	Argv    []string      `json:"argv,omitempty"`
	Dir     string        `json:"dir,omitempty"`
	User    string        `json:"user,omitempty"`
	Timeout time.Duration `json:"timeout_ns,omitempty"`
}

// MarshalText writes "rw" or "ro".
func (m ShareMode) MarshalText() ([]byte, error) {
	if m != ReadOnly && m != ReadWrite {
		return nil, fmt.Errorf("sandbox: share mode %d", int(m))
	}
	return []byte(m.String()), nil
}

// UnmarshalText reads "rw" or "ro".
func (m *ShareMode) UnmarshalText(b []byte) error {
	switch string(b) {
	case "rw":
		*m = ReadWrite
	case "ro":
		*m = ReadOnly
	default:
		return fmt.Errorf("sandbox: share mode %q: want rw or ro", b)
	}
	return nil
}

// MarshalText writes the operation's name.
func (o PatchOp) MarshalText() ([]byte, error) {
	if o < PatchWrite || o > PatchCopy {
		return nil, fmt.Errorf("sandbox: %v", o)
	}
	return []byte(o.String()), nil
}

// UnmarshalText reads an operation's name.
func (o *PatchOp) UnmarshalText(b []byte) error {
	for op := PatchWrite; op <= PatchCopy; op++ {
		if op.String() == string(b) {
			*o = op
			return nil
		}
	}
	return fmt.Errorf("sandbox: patch operation %q: want write, mkdir, symlink, remove or copy", b)
}

// Spec returns the workload's description, or the error Start would
// return for it.
func (w *Workload) Spec() (Spec, error) {
	if err := w.c.err(); err != nil {
		return Spec{}, err
	}
	// A deep copy through JSON: the caller may change it freely.
	b, err := json.Marshal(w.c.Spec)
	if err != nil {
		return Spec{}, fmt.Errorf("sandbox: spec: %w", err)
	}
	var s Spec
	if err := json.Unmarshal(b, &s); err != nil {
		return Spec{}, fmt.Errorf("sandbox: spec: %w", err)
	}
	return s, nil
}

// FromSpec returns the workload s describes, checked by the builder's own
// methods (Start and Spec return what is wrong). Give it what only exists
// at run time (Logger, Console, Stdin, Stdout, Stderr, PullProgress)
// before Start. CPUs and MemoryMiB of 0 are New's defaults.
func FromSpec(s Spec) *Workload {
	b := New()
	if s.CPUs != 0 {
		b.CPUs(s.CPUs)
	}
	if s.MemoryMiB != 0 {
		b.Memory(s.MemoryMiB)
	}
	if s.CPUQuota != 0 {
		b.CPUQuota(s.CPUQuota)
	}
	b.Balloon(s.Balloon)
	if s.Limits != (ratelimit.Limits{}) {
		b.Limits(s.Limits)
	}
	b.Env(s.Env...).Kernel(s.Kernel).Initrd(s.Initrd)
	if s.ReadyTimeout != 0 {
		b.ReadyTimeout(s.ReadyTimeout)
	}
	b.Watchdog(s.Watchdog).OutputLimit(s.OutputLimit).VsockSocket(s.VsockSocket)
	for _, sh := range s.Shares {
		b.Share(sh.Host, sh.Guest, sh.Mode)
	}
	b.ShareFS(s.ShareFS)
	for _, v := range s.Volumes {
		b.VolumeOwned(v.Dir, v.Name, v.Guest, v.Mode, v.UID, v.GID)
	}
	for _, d := range s.Disks {
		b.Disk(d.Path, d.Mode)
	}
	if n := s.Network; n != nil && n.Tap != nil {
		b.Tap(*n.Tap)
		if n.Policy != nil || len(n.Publish)+len(n.UpstreamCAs) > 0 || n.intercepts() || n.DNSServer != "" || n.EgressProxy != nil {
			b.c.errs = append(b.c.errs, errors.New("sandbox: a tap network has no NAT: no policy, published ports, DNS server, egress proxy, secrets or TLS interception"))
		}
	} else if n != nil {
		b.Network(n.Policy)
		for _, p := range n.Publish {
			b.Publish(p)
		}
		if n.DNSServer != "" {
			b.DNSServer(n.DNSServer)
		}
		if p := n.EgressProxy; p != nil {
			b.egressProxy(*p)
		}
		// The environment has the placeholders and the CA's variables.
		for _, sp := range n.Secrets {
			b.addSecret(sp)
		}
		for _, h := range n.Headers {
			for _, name := range h.Names {
				b.addHeader(h.Host, name)
			}
		}
		b.TLSIntercept(n.Intercept...).UpstreamCA(n.UpstreamCAs...)
	}
	b.Patch(s.Patches...)
	if h := s.Hub; h != nil {
		b.Mailbox(h.Topics...).KV(h.Prefixes...)
		if h.Dir != "" {
			b.HubDir(h.Dir)
		}
		if h.Identity != "" {
			b.Identity(h.Identity)
		}
	}
	var w *Workload
	if im := s.Image; im != nil {
		if im.Pull != "" {
			b.Pull(im.Pull)
		}
		if im.Store != "" {
			b.ImageStore(im.Store)
		}
		b.InsecureRegistry(im.Insecure...)
		if im.RootfsSize != 0 {
			b.RootfsSize(im.RootfsSize)
		}
		if im.Entrypoint != nil {
			b.Entrypoint(im.Entrypoint...)
		}
		w = b.OCI(im.Ref, im.Args...)
		if len(s.Main.Argv) > 0 {
			w.c.errs = append(w.c.errs, fmt.Errorf("sandbox: spec: an image sandbox's main process comes from the image (image args), not main.argv"))
		}
	} else {
		if len(s.Main.Argv) == 0 {
			w = b.Run("")
		} else {
			w = b.Run(s.Main.Argv[0], s.Main.Argv[1:]...)
		}
	}
	return w.Dir(s.Main.Dir).User(s.Main.User).Timeout(s.Main.Timeout)
}

// Logger receives the VMM's log (Builder.Logger).
func (w *Workload) Logger(l *slog.Logger) *Workload { w.c.log = l; return w }

// Console receives the guest's serial console (Builder.Console).
func (w *Workload) Console(c io.Writer) *Workload { w.c.console = c; return w }

// PullProgress receives progress while an image is pulled
// (Builder.PullProgress); without an image it does nothing.
func (w *Workload) PullProgress(fn func(image.Progress)) *Workload { w.c.progress = fn; return w }
