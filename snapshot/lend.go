package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Lending a layer's parent. A layer is written by the process that runs
// the sandbox (a detached sandbox's supervisor), which reads its parent's
// memory to find the pages that differ. Confined, that process may be
// unable to open the parent's files: a snapshot another user's jailed
// supervisor wrote is that user's, mode 0600, and a supervisor run by
// root holds no capability to read past that. The process asking for the
// layer, which can, opens the parent (Open, with every check) and lends
// it: the chain's manifests, as the exact bytes it checked, and its memory
// files, as descriptors (passed over a Unix socket). OpenLent, in the
// other process, checks them again as Open would and makes a Snapshot of
// the chain's memory, which is all a layer's writer reads of a parent.

// Lend returns, for OpenLent in another process, s's chain as pairs of
// files, the snapshot's first and then each parent's: its manifest, in a
// sealed memory file holding the bytes Open read and checked, and its
// memory file. The manifests' files are the caller's to close; the memory
// files stay s's. A snapshot of the disk alone has no memory to lend.
func (s *Snapshot) Lend() ([]*os.File, error) {
	var files []*os.File
	fail := func(err error) ([]*os.File, error) {
		CloseLent(files)
		return nil, fmt.Errorf("snapshot %s: lend: %w", s.Dir, err)
	}
	for p := s; p != nil; p = p.Parent {
		if p.Manifest.DiskOnly {
			return fail(ErrDiskOnly)
		}
		mem := p.files[MemoryFile]
		if mem == nil || p.manifest == nil {
			return fail(errors.New("closed"))
		}
		mf, err := sealedFile(ManifestFile, p.manifest)
		if err != nil {
			return fail(err)
		}
		files = append(files, mf, mem)
	}
	return files, nil
}

// CloseLent closes the manifests' files of what Lend returned, the
// caller's; the memory files stay the snapshot's.
func CloseLent(files []*os.File) {
	for i := 0; i < len(files); i += 2 {
		files[i].Close()
	}
}

// sealedFile is a memory file holding b, sealed against any change, and
// not executable where the kernel knows the flag (Linux 6.3: where
// vm.memfd_noexec is 2, a memory file without it is refused).
func sealedFile(name string, b []byte) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_NOEXEC_SEAL)
	if errors.Is(err, unix.EINVAL) {
		fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	}
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if _, err := f.Write(b); err != nil {
		f.Close()
		return nil, err
	}
	seals := unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, seals); err != nil {
		f.Close()
		return nil, fmt.Errorf("seal %s: %w", name, err)
	}
	return f, nil
}

// OpenLent is Open, of the chain whose snapshot lies in dir, from the
// files Lend lent (received from another process): each manifest is read
// from its file (bounded), hashed, decoded and checked, the chain's links
// (each parent by name beside its layer, with the checksum the layer
// recorded, of the same vCPUs and memory) checked as Open checks them, and
// each memory file must be a regular file, writable by no other user, of
// the size its manifest says. The snapshot holds its chain's memory alone,
// as Open's parents do: it is a layer's parent (WriteOptions.Parent), not
// something to restore. OpenLent takes the files: it closes the manifests'
// at once, and the memory files on an error or with the snapshot's Close.
func OpenLent(dir string, files []*os.File) (_ *Snapshot, err error) {
	var levels []*Snapshot
	defer func() {
		for i, f := range files {
			if i%2 == 0 || err != nil {
				f.Close()
			}
		}
		if err != nil {
			err = fmt.Errorf("snapshot %s, lent: %w", dir, err)
		}
	}()
	switch n := len(files); {
	case n == 0 || n%2 != 0:
		return nil, fmt.Errorf("%d files: want a manifest and a memory file for each snapshot of the chain", n)
	case n/2 > MaxChain:
		return nil, fmt.Errorf("a chain of %d snapshots: at most %d", n/2, MaxChain)
	}
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("%s: not an absolute directory", dir)
	}
	for i := 0; i < len(files); i += 2 {
		s := &Snapshot{Dir: filepath.Clean(dir), files: map[string]*os.File{}}
		if i > 0 {
			above := levels[len(levels)-1]
			s.Dir = filepath.Join(filepath.Dir(above.Dir), above.Manifest.Parent.Name)
		}
		if s.manifest, err = readBounded(files[i], maxManifest); err != nil {
			return nil, fmt.Errorf("%s's %s: %w", s.Dir, ManifestFile, err)
		}
		sum := sha256.Sum256(s.manifest)
		s.ManifestSHA256 = hex.EncodeToString(sum[:])
		if err := ParseManifest(s.manifest, &s.Manifest); err != nil {
			return nil, fmt.Errorf("%s: %w", s.Dir, err)
		}
		m := s.Manifest
		last := i+2 == len(files)
		switch {
		case m.DiskOnly:
			return nil, fmt.Errorf("%s: %w", s.Dir, ErrDiskOnly)
		case m.Parent == nil && !last:
			return nil, fmt.Errorf("%s has no parent, and %d more snapshots were lent", s.Dir, (len(files)-i)/2-1)
		case m.Parent != nil && last:
			return nil, fmt.Errorf("%s lies over %s, which was not lent", s.Dir, m.Parent.Name)
		}
		if i > 0 {
			above := levels[len(levels)-1]
			if err := checkLink(above, s); err != nil {
				return nil, fmt.Errorf("%s: %w", above.Dir, err)
			}
		}
		want, ok := m.Files[MemoryFile]
		if !ok {
			return nil, fmt.Errorf("%s: its manifest names no %s", s.Dir, MemoryFile)
		}
		mem := files[i+1]
		var st unix.Stat_t
		if err := unix.Fstat(int(mem.Fd()), &st); err != nil {
			return nil, fmt.Errorf("%s's %s: %w", s.Dir, MemoryFile, err)
		}
		switch {
		case st.Mode&unix.S_IFMT != unix.S_IFREG:
			return nil, fmt.Errorf("%s's %s is not a regular file: refused", s.Dir, MemoryFile)
		case st.Mode&0o022 != 0:
			return nil, fmt.Errorf("%s's %s is writable by others (mode %04o): refused", s.Dir, MemoryFile, st.Mode&0o7777)
		case st.Size != want.Size:
			return nil, fmt.Errorf("%s's %s is %d bytes, the manifest says %d: truncated or replaced", s.Dir, MemoryFile, st.Size, want.Size)
		}
		s.files[MemoryFile] = mem
		levels = append(levels, s)
	}
	for i := len(levels) - 1; i > 0; i-- {
		levels[i-1].Parent = levels[i]
	}
	return levels[0], nil
}
