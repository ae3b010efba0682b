package sandbox

import (
	"path/filepath"

	"github.com/capsa-sandbox/capsa/volume"
)

// HostPaths are the host files and directories the running sandbox's VMM
// still opens: its shares and disks (read-only when the guest may only
// read them), its volumes' directories, an image's writable layer, the
// hub's files when it was granted any, and what its copy patches read
// (Builder.CopyIn), which are copied once the guest runs. A process that
// confines itself (package confine) in Workload.BeforeRun, or after
// Start, gives these to Landlock; the VMM's other descriptors are open
// already.
func (s *Sandbox) HostPaths() (read, write []string) {
	add := func(p string, mode ShareMode) {
		if mode == ReadOnly {
			read = append(read, p)
		} else {
			write = append(write, p)
		}
	}
	for _, sh := range s.c.Shares {
		add(sh.Host, sh.Mode)
	}
	for _, d := range s.c.Disks {
		add(d.Path, d.Mode)
	}
	for _, v := range s.c.Volumes {
		// A read-only mount still records what it holds, in the
		// volume's directory.
		if r, err := volume.Open(v.Dir); err == nil {
			write = append(write, filepath.Join(r.Dir(), v.Name))
		}
	}
	if s.rootfs != nil {
		write = append(write, s.rootfs.upperDir)
		read = append(read, s.rootfs.erofs)
	}
	for _, p := range s.c.Patches {
		if p.Op == PatchCopy {
			read = append(read, p.Source) // absolute (Builder.Patch)
		}
	}
	if s.hub != nil && s.hub.h != nil {
		write = append(write, s.hub.h.Files()...)
	}
	return read, write
}

// ServesHostFiles reports whether the running sandbox's VMM serves host
// files it did not make, which may be other users': shares, disks,
// volumes, or files its copy patches read. A VMM run by root keeps the
// file server's capabilities only then (confine.Config.HostFiles); an
// image's writable layer and the hub's files are its own.
func (s *Sandbox) ServesHostFiles() bool {
	if len(s.c.Shares) > 0 || len(s.c.Disks) > 0 || len(s.c.Volumes) > 0 {
		return true
	}
	for _, p := range s.c.Patches {
		if p.Op == PatchCopy {
			return true
		}
	}
	return false
}
