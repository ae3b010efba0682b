package image

import (
	"fmt"
	"os"

	"github.com/diskfs/go-diskfs/backend/file"
	"github.com/diskfs/go-diskfs/filesystem/ext4"
)

// MinUpperSize is the smallest writable layer CreateUpper makes.
const MinUpperSize = 64 << 20

// CreateUpper makes path a sparse file of size bytes holding an empty ext4
// filesystem: a sandbox's writable layer, which the guest puts over the
// image with overlayfs. The file never grows past size, so the guest gets
// ENOSPC there. It is written in Go (go-diskfs), with no host tool and
// no root; without a journal, since the layer lives as long as its
// sandbox.
func CreateUpper(path string, size int64) (err error) {
	if size < MinUpperSize {
		return fmt.Errorf("image: writable layer of %d bytes: at least %d", size, MinUpperSize)
	}
	size &^= 4095
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("image: writable layer: %w", err)
	}
	defer func() {
		f.Close()
		if err != nil {
			os.Remove(path)
		}
	}()
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("image: writable layer: %w", err)
	}
	fsys, err := ext4.Create(file.New(f, false), size, 0, 512, &ext4.Params{
		VolumeName: "capsa-upper",
		Features:   []ext4.FeatureOpt{ext4.WithFeatureHasJournal(false)},
	})
	if err != nil {
		return fmt.Errorf("image: make the writable layer's ext4: %w", err)
	}
	if err := fsys.Close(); err != nil {
		return fmt.Errorf("image: make the writable layer's ext4: %w", err)
	}
	return f.Sync()
}
