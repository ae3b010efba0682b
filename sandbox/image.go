package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/capsa-sandbox/capsa/image"
	"github.com/capsa-sandbox/capsa/ratelimit"
	"github.com/capsa-sandbox/capsa/snapshot"
	virtioblk "github.com/capsa-sandbox/capsa/virtio/blk"
)

// PullPolicy says when OCI pulls an image.
type PullPolicy string

const (
	PullMissing PullPolicy = "missing" // pull only when not in the store (the default)
	PullAlways  PullPolicy = "always"  // pull every time (layers already cached are not fetched)
	PullNever   PullPolicy = "never"   // use the store only
)

// DefaultRootfsSize bounds an image sandbox's root filesystem when
// RootfsSize is not set.
const DefaultRootfsSize = 4 << 30

func (b *Builder) imageCfg() *ImageSpec {
	if b.c.Image == nil {
		b.c.Image = &ImageSpec{Pull: PullMissing, RootfsSize: DefaultRootfsSize}
	}
	return b.c.Image
}

// ImageStore sets the image cache directory (default image.DefaultDir).
func (b *Builder) ImageStore(dir string) *Builder { b.imageCfg().Store = dir; return b }

// Pull sets when OCI pulls the image.
func (b *Builder) Pull(p PullPolicy) *Builder {
	switch p {
	case PullMissing, PullAlways, PullNever:
		b.imageCfg().Pull = p
	default:
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: pull policy %q: want always, missing or never", p))
	}
	return b
}

// InsecureRegistry lets OCI reach the registry host[:port] over plain
// HTTP (loopback registries always may).
func (b *Builder) InsecureRegistry(hosts ...string) *Builder {
	b.imageCfg().Insecure = append(b.imageCfg().Insecure, hosts...)
	return b
}

// RootfsSize bounds an image sandbox's root filesystem: the writable layer
// over the image holds at most this many bytes (default 4 GiB), and an
// image larger than it is refused.
func (b *Builder) RootfsSize(bytes int64) *Builder {
	if bytes < image.MinUpperSize {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: root filesystem size %d: at least %d MiB", bytes, image.MinUpperSize>>20))
	}
	b.imageCfg().RootfsSize = bytes
	return b
}

// Entrypoint replaces the image's ENTRYPOINT (and drops its CMD, as
// Docker's --entrypoint does); with no arguments it clears it.
func (b *Builder) Entrypoint(argv ...string) *Builder {
	b.imageCfg().Entrypoint = append([]string{}, argv...)
	return b
}

// PullProgress receives progress while OCI pulls and converts an image.
func (b *Builder) PullProgress(fn func(image.Progress)) *Builder {
	b.imageCfg()
	b.c.progress = fn
	return b
}

// OCI chooses an OCI image as the sandbox's root filesystem and its main
// process: the image's ENTRYPOINT and CMD, with args replacing CMD. The
// image is the guest's / (read-only, under a writable layer of its own);
// the agent stays capsa's, so exec and file calls work in any image, with
// paths meaning the image's.
func (b *Builder) OCI(ref string, args ...string) *Workload {
	ic := b.imageCfg()
	ic.Ref, ic.Args = ref, args
	w := &Workload{c: b.c}
	if ref == "" {
		w.c.errs = append(w.c.errs, errors.New("sandbox: OCI needs an image reference"))
	}
	return w
}

// rootfs is an image sandbox's root: the image's EROFS and the writable
// layer.
type rootfs struct {
	img       *image.Image
	proc      image.Process
	erofs     string
	upperDir  string // holds the writable layer; removed at Close
	upperPath string
}

// prepareImage finds or pulls the image, resolves the main process and
// makes the writable layer.
func prepareImage(ctx context.Context, c config) (*rootfs, error) {
	ic := c.Image
	store, err := openImageStore(c)
	if err != nil {
		return nil, err
	}
	var img *image.Image
	if ic.Pull != PullAlways {
		img, err = store.Get(ic.Ref)
		if err != nil && (!errors.Is(err, image.ErrNotFound) || ic.Pull == PullNever) {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
	}
	if img == nil {
		if img, err = store.Pull(ctx, ic.Ref, image.Options{Insecure: ic.Insecure, Progress: c.progress}); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
	}
	if img.RootfsSize > ic.RootfsSize {
		return nil, fmt.Errorf("sandbox: image %s is %d MiB, more than the root filesystem size of %d MiB", ic.Ref, img.RootfsSize>>20, ic.RootfsSize>>20)
	}
	return newRootfs(c, store, img, func(path string) error { return newUpper(store, ic.RootfsSize, path) })
}

// newUpper makes path an empty writable layer of size bytes: a copy of
// the store's template.
func newUpper(store *image.Store, size int64, path string) error {
	f, err := store.OpenUpperTemplate(size)
	if err != nil {
		return err
	}
	defer f.Close()
	return snapshot.CloneFrom(f, path)
}

// openImageStore opens the image store c's image comes from.
func openImageStore(c config) (*image.Store, error) {
	dir := c.Image.Store
	if dir == "" {
		var err error
		if dir, err = image.DefaultDir(); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
	}
	store, err := image.Open(dir, c.logger())
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return store, nil
}

// newRootfs resolves the main process of img and makes the writable layer
// with makeUpper (a new file system, or a snapshot's copied).
func newRootfs(c config, store *image.Store, img *image.Image, makeUpper func(path string) error) (*rootfs, error) {
	ic := c.Image
	proc, err := img.Resolve(image.Overrides{Entrypoint: ic.Entrypoint, Args: ic.Args, Env: c.Env, Dir: c.Main.Dir, User: c.Main.User})
	if err != nil {
		return nil, fmt.Errorf("sandbox: image %s: %w", ic.Ref, err)
	}
	p, err := store.RootfsPath(img)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	r := &rootfs{img: img, proc: proc, erofs: p}
	if r.upperDir, err = os.MkdirTemp("", "capsa-rootfs-"); err != nil {
		return nil, fmt.Errorf("sandbox: writable layer: %w", err)
	}
	r.upperPath = filepath.Join(r.upperDir, "upper.ext4")
	if err := makeUpper(r.upperPath); err != nil {
		os.RemoveAll(r.upperDir)
		return nil, fmt.Errorf("sandbox: writable layer: %w", err)
	}
	return r, nil
}

// devices opens the image (read-only, shared) and the writable layer as
// the first two disks, vda and vdb, with the serials the guest's init
// looks for. Both wait on lim: the image's root is one disk to its
// limits.
func (r *rootfs) devices(c config, lim *ratelimit.Limiter) ([]*virtioblk.Device, error) {
	return openDisks([]diskSpec{
		{r.erofs, virtioblk.Options{ReadOnly: true, ID: rootSerials[0], Limit: lim}},
		{r.upperPath, virtioblk.Options{ID: rootSerials[1], Limit: lim}},
	}, c)
}

// rootSerials are the serials of the image's disk and its writable layer.
var rootSerials = [2]string{"capsa-image", "capsa-upper"}

func (r *rootfs) remove() error {
	if r == nil || r.upperDir == "" {
		return nil
	}
	return os.RemoveAll(r.upperDir)
}
