package sandbox

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"

	"github.com/capsa-sandbox/capsa/p9fs"
	"github.com/capsa-sandbox/capsa/virtio"
	"github.com/capsa-sandbox/capsa/virtio/ninep"
	"github.com/capsa-sandbox/capsa/volume"
	"github.com/hugelgupf/p9/p9"
)

// VolumeSpec is a named volume mounted in the guest (Builder.Volume).
type VolumeSpec struct {
	Name  string    `json:"name"`
	Guest string    `json:"guest"`
	Mode  ShareMode `json:"mode"`
	// Dir is the volumes directory (volume.Open's); empty:
	// volume.DefaultDir, where the CLI keeps them.
	Dir string `json:"dir,omitempty"`
	// UID and GID are whom the guest sees owning the files the VMM's
	// user owns on the host (every file the guest or the VMM made): 0,
	// root, unless VolumeOwned says otherwise (p9fs.Options.UID).
	UID uint32 `json:"uid,omitempty"`
	GID uint32 `json:"gid,omitempty"`
}

// Volume mounts the named volume (package volume; `capsa volume create`
// makes one) at guestPath, like a shared directory: over virtio-9p,
// confined to the volume, read-only on the host side with ReadOnly. Any
// number of sandboxes, in this process or others, may mount one volume at
// once and see each other's writes; a volume with a quota refuses writes
// past it with ENOSPC, for all of them together. A volume that does not
// exist is an error here: volumes are made on purpose, never on the fly.
// Shares and volumes together are at most MaxShares.
func (b *Builder) Volume(name, guestPath string, mode ShareMode) *Builder {
	return b.VolumeIn("", name, guestPath, mode)
}

// VolumeIn is Volume for a volume of the volumes directory dir (empty:
// volume.DefaultDir).
func (b *Builder) VolumeIn(dir, name, guestPath string, mode ShareMode) *Builder {
	return b.VolumeOwned(dir, name, guestPath, mode, 0, 0)
}

// VolumeOwned is VolumeIn with the files the VMM's user owns on the host
// (what the guest and the VMM make there) shown to the guest as owned by
// uid and gid, so that a guest user other than root can write what it
// made: the host's file server makes every file as the VMM's user.
func (b *Builder) VolumeOwned(dir, name, guestPath string, mode ShareMode, uid, gid uint32) *Builder {
	v, err := b.checkVolume(VolumeSpec{Name: name, Guest: guestPath, Mode: mode, Dir: dir, UID: uid, GID: gid})
	if err != nil {
		b.c.errs = append(b.c.errs, err)
		return b
	}
	b.c.Volumes = append(b.c.Volumes, v)
	return b
}

// checkVolume checks a volume to mount and returns it with its guest path
// cleaned and its directory absolute.
func (b *Builder) checkVolume(v VolumeSpec) (VolumeSpec, error) {
	what := "volume " + v.Name
	if err := checkMode(what, v.Mode); err != nil {
		return v, err
	}
	if err := volume.CheckName(v.Name); err != nil {
		return v, fmt.Errorf("sandbox: %w (a host directory to share needs a slash: ./%s)", err, v.Name)
	}
	g, err := checkGuestPath(what, v.Guest)
	if err != nil {
		return v, err
	}
	if err := b.checkMountPoint(what, g); err != nil {
		return v, err
	}
	v.Guest = g
	if v.Dir != "" {
		if v.Dir, err = filepath.Abs(v.Dir); err != nil {
			return v, fmt.Errorf("sandbox: %s: %w", what, err)
		}
	}
	r, err := volume.Open(v.Dir)
	if err == nil {
		err = r.Check(v.Name)
	}
	if errors.Is(err, volume.ErrNotFound) {
		return v, fmt.Errorf("sandbox: %s: no such volume (make it with: capsa volume create %s)", what, v.Name)
	}
	if err != nil {
		return v, fmt.Errorf("sandbox: %w", err)
	}
	return v, nil
}

// mountedVolume is a volume's file server: closing it (the device does)
// releases the volume too.
type mountedVolume struct {
	p9.Attacher
	m *volume.Mount
}

func (v mountedVolume) Close() error {
	return errors.Join(v.Attacher.(io.Closer).Close(), v.m.Close())
}

// volumeDevices mounts each volume and makes its file server and device,
// tagged after the shares (first is the number of shares). On error it
// returns the devices made so far, for the caller to close.
func volumeDevices(vols []VolumeSpec, first int, lim *limiters, log *slog.Logger) ([]*ninep.Device, error) {
	var devs []*ninep.Device
	for i, v := range vols {
		d, err := volumeDevice(v, shareTag(first+i), lim.share(), log)
		if err != nil {
			return devs, fmt.Errorf("sandbox: volume %s: %w", v.Name, err)
		}
		devs = append(devs, d)
	}
	return devs, nil
}

func volumeDevice(v VolumeSpec, tag string, lim virtio.Limiter, log *slog.Logger) (*ninep.Device, error) {
	r, err := volume.Open(v.Dir)
	if err != nil {
		return nil, err
	}
	m, err := r.Mount(v.Name, log)
	if err != nil {
		return nil, err
	}
	ro := v.Mode == ReadOnly
	// A read-only mount is charged nothing but still tells the budget
	// what it holds: a file it holds stays on disk after another
	// sandbox removes it.
	a, err := p9fs.New(m.DataDir(), p9fs.Options{ReadOnly: ro, Quota: m, UID: v.UID, GID: v.GID, Logger: log})
	if err != nil {
		m.Close()
		return nil, err
	}
	mv := mountedVolume{Attacher: a, m: m}
	d, err := ninep.New(tag, mv, ninep.Options{ReadOnly: ro, Limit: lim}, log)
	if err != nil {
		mv.Close()
		return nil, err
	}
	return d, nil
}

// volumeArg is the kernel command-line word that mounts volume v as
// device i: the same as a share's.
func volumeArg(i int, v VolumeSpec) string {
	return shareArg(i, ShareSpec{Guest: v.Guest, Mode: v.Mode}, ShareFS9P)
}
