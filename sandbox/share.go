package sandbox

import (
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/capsa-sandbox/capsa/p9fs"
	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/ninep"
	"github.com/capsa-sandbox/capsa/virtio/virtiofs"
)

// ShareMode says whether the guest may change a shared directory.
type ShareMode int

const (
	// ReadWrite lets the guest create, change and remove files.
	ReadWrite ShareMode = iota
	// ReadOnly refuses every change with EROFS, on the host side.
	ReadOnly
)

func (m ShareMode) String() string {
	if m == ReadOnly {
		return "ro"
	}
	return "rw"
}

// Share transports (Builder.ShareFS).
const (
	ShareFS9P       = "9p"
	ShareFSVirtioFS = "virtiofs"
)

// ShareFS chooses how shared host directories reach the guest: "9p" (the
// default: virtio-9p, which snapshots and forks keep) or "virtiofs" (FUSE
// over virtio: fewer round trips per system call, renameat2's flags,
// names and attributes cached for a second; a sandbox with one cannot be
// snapshotted or forked yet). Volumes are always 9P. See
// docs/workspace.md.
func (b *Builder) ShareFS(kind string) *Builder {
	switch kind {
	case "", ShareFS9P:
		b.c.ShareFS = ""
	case ShareFSVirtioFS:
		b.c.ShareFS = kind
	default:
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: share transport %q: want %s or %s", kind, ShareFS9P, ShareFSVirtioFS))
	}
	return b
}

// MaxShares is the most directories one sandbox can share (each is a
// virtio device with its own interrupt line).
const MaxShares = 16

// Share makes the host directory hostPath appear in the guest at guestPath
// (an absolute path, created if missing), over virtio-9p. The guest cannot
// reach anything outside hostPath through it: not by symlinks, "..",
// renames or hard links. Several directories may be shared.
func (b *Builder) Share(hostPath, guestPath string, mode ShareMode) *Builder {
	sh, err := checkShare(hostPath, guestPath, mode)
	if err == nil {
		err = b.checkMountPoint("share "+hostPath, sh.Guest)
	}
	if err != nil {
		b.c.errs = append(b.c.errs, err)
		return b
	}
	b.c.Shares = append(b.c.Shares, sh)
	return b
}

// checkMountPoint refuses the guest path g for a new share or volume
// (what, in errors) when a share or a volume is mounted there already, or
// when there are MaxShares of them.
func (b *Builder) checkMountPoint(what, g string) error {
	for _, o := range b.c.Shares {
		if o.Guest == g {
			return fmt.Errorf("sandbox: %s: guest path %s is already shared from %s", what, g, o.Host)
		}
	}
	for _, v := range b.c.Volumes {
		if v.Guest == g {
			return fmt.Errorf("sandbox: %s: guest path %s is already volume %s's", what, g, v.Name)
		}
	}
	if len(b.c.Shares)+len(b.c.Volumes) >= MaxShares {
		return fmt.Errorf("sandbox: %s: at most %d shares and volumes", what, MaxShares)
	}
	return nil
}

// reservedGuestPaths are mounted by the guest's init; a share there would
// hide them.
var reservedGuestPaths = []string{"/proc", "/sys", "/dev", "/run", "/bin", "/bbin", "/init"}

func checkShare(hostPath, guestPath string, mode ShareMode) (ShareSpec, error) {
	what := "share " + hostPath
	if err := checkMode(what, mode); err != nil {
		return ShareSpec{}, err
	}
	if hostPath == "" {
		return ShareSpec{}, fmt.Errorf("sandbox: share: empty host path")
	}
	abs, err := filepath.Abs(hostPath)
	if err != nil {
		return ShareSpec{}, fmt.Errorf("sandbox: share %s: %w", hostPath, err)
	}
	fi, err := os.Stat(abs)
	switch {
	case err != nil:
		return ShareSpec{}, fmt.Errorf("sandbox: share %s: %w", hostPath, err)
	case !fi.IsDir():
		return ShareSpec{}, fmt.Errorf("sandbox: share %s: not a directory", hostPath)
	}
	g, err := checkGuestPath(what, guestPath)
	if err != nil {
		return ShareSpec{}, err
	}
	return ShareSpec{Host: abs, Guest: g, Mode: mode}, nil
}

// checkMode refuses a mode that is neither ReadOnly nor ReadWrite.
func checkMode(what string, mode ShareMode) error {
	if mode != ReadOnly && mode != ReadWrite {
		return fmt.Errorf("sandbox: %s: unknown mode %d", what, mode)
	}
	return nil
}

// checkGuestPath checks where in the guest a share or a volume (what, in
// errors) is mounted and returns the path cleaned.
func checkGuestPath(what, guestPath string) (string, error) {
	if !path.IsAbs(guestPath) {
		return "", fmt.Errorf("sandbox: %s: guest path %q must be absolute", what, guestPath)
	}
	if strings.ContainsRune(guestPath, 0) {
		return "", fmt.Errorf("sandbox: %s: guest path %q holds a NUL byte", what, guestPath)
	}
	g := path.Clean(guestPath)
	if g == "/" {
		return "", fmt.Errorf("sandbox: %s: cannot mount over the guest's root", what)
	}
	for _, r := range reservedGuestPaths {
		if g == r || strings.HasPrefix(g, r+"/") {
			return "", fmt.Errorf("sandbox: %s: guest path %s is inside %s, which the guest's init owns", what, g, r)
		}
	}
	return g, nil
}

// ParseShare parses the CLI's volume syntax HOST:GUEST[:ro|:rw].
func ParseShare(spec string) (hostPath, guestPath string, mode ShareMode, err error) {
	s := spec
	mode = ReadWrite
	if rest, ok := strings.CutSuffix(s, ":ro"); ok {
		s, mode = rest, ReadOnly
	} else if rest, ok := strings.CutSuffix(s, ":rw"); ok {
		s = rest
	}
	// The guest path is absolute, so the split is at the last ":/".
	i := strings.LastIndex(s, ":/")
	if i <= 0 {
		return "", "", 0, fmt.Errorf("volume %q: want HOST:GUEST[:ro], GUEST an absolute path", spec)
	}
	return s[:i], s[i+1:], mode, nil
}

// shareTag names share i's virtio-9p device.
func shareTag(i int) string { return fmt.Sprintf("capsa%d", i) }

// shareArg is the kernel command-line word telling the guest's init to
// mount share i over transport fs (Spec.ShareFS; a volume's is 9P):
// capsa.share=TAG,MODE,PATH, or capsa.virtiofs=, with PATH escaped so
// that no space or quote reaches the command line.
func shareArg(i int, sh ShareSpec, fs string) string {
	key := "capsa.share"
	if fs == ShareFSVirtioFS {
		key = "capsa.virtiofs"
	}
	return fmt.Sprintf("%s=%s,%s,%s", key, shareTag(i), sh.Mode, url.PathEscape(sh.Guest))
}

// shareDevice is a share's virtio device: virtio-9p or virtio-fs.
type shareDevice interface {
	virtio.Device
	Close() error
}

// shareDevices makes each share's confined file server and device, over
// transport fs (Spec.ShareFS), and returns them with the servers, by the
// shares' order. On error it returns the devices made so far, for the
// caller to close.
func shareDevices(shares []ShareSpec, fs string, lim *limiters, log *slog.Logger) ([]shareDevice, []reopener, error) {
	var devs []shareDevice
	var servers []reopener
	for i, sh := range shares {
		a, err := p9fs.New(sh.Host, p9fs.Options{ReadOnly: sh.Mode == ReadOnly, Logger: log})
		if err != nil {
			return devs, nil, fmt.Errorf("sandbox: share %s: %w", sh.Host, err)
		}
		var d shareDevice
		if fs == ShareFSVirtioFS {
			d, err = virtiofs.New(shareTag(i), a, virtiofs.Options{Limit: lim.share()}, log)
		} else {
			d, err = ninep.New(shareTag(i), a, ninep.Options{ReadOnly: sh.Mode == ReadOnly, Limit: lim.share()}, log)
		}
		if err != nil {
			return devs, nil, fmt.Errorf("sandbox: share %s: %w", sh.Host, err)
		}
		devs = append(devs, d)
		r, ok := a.(reopener)
		if !ok {
			return devs, nil, fmt.Errorf("sandbox: share %s: its file server cannot pin its root again", sh.Host)
		}
		servers = append(servers, r)
	}
	return devs, servers, nil
}

// shareDeviceID is share sh's device id in the machine's state.
func shareDeviceID(sh ShareSpec, fs string) string {
	if fs == ShareFSVirtioFS {
		return "fs:" + sh.Guest
	}
	return "9p:" + sh.Guest
}

// reopener is a share's file server, which can pin its root again by its
// path (p9fs's).
type reopener interface{ Reopen(root string) error }

// ReopenShares has each share's file server pin its root again by its
// path, as this process now resolves it: after a jail that follows the
// host's mounts (confine.JailConfig.Follow, a containerd pod's), whose
// bind of a share takes the mounts the host makes beneath it later,
// where the roots pinned before the jail lie in the mount tree it left,
// which takes none. Before the guest runs: what it attached before keeps
// the old root.
func (s *Sandbox) ReopenShares() error {
	for i, fs := range s.shareFS {
		if err := fs.Reopen(s.c.Shares[i].Host); err != nil {
			return fmt.Errorf("sandbox: share %s: %w", s.c.Shares[i].Host, err)
		}
	}
	return nil
}
