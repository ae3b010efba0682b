// Package image pulls OCI and Docker images and turns each into a
// read-only root filesystem for sandboxes. Its starting point is
// Store.Pull (and Store.Import for a `docker save` tarball or an OCI image
// layout); Store.Get finds what was pulled.
//
// The cache under the store's directory is content-addressed:
//
//	blobs/sha256/<hex>      layer, config and manifest blobs, as pulled
//	rootfs/sha256/<hex>.erofs  an image's flattened root, keyed by its manifest digest
//	index.db                which reference names which manifest (bbolt)
//	tmp/                    work in progress
//
// Every file is written under tmp/, checked (a blob against its digest),
// synced and renamed into place, and only then recorded in the index: a
// crash or a full disk mid-pull leaves nothing that a later run uses. A
// root filesystem is shared read-only by every sandbox of its image.
//
// Registry access is go-containerregistry's: linux/amd64 is chosen from
// multi-platform indexes, credentials come from the user's Docker config
// (the default keychain), and plain HTTP is used only for loopback
// registries (the library's rule) and those named in Options.Insecure.
package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	bolt "go.etcd.io/bbolt"
)

// Platform is the only platform capsa runs.
var Platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// DefaultLimits bound a conversion: 16 GiB of files, a million entries,
// 256 MiB of names and attributes held until its end.
var DefaultLimits = ConvertLimits{MaxBytes: 16 << 30, MaxEntries: 1 << 20, MaxMetaBytes: 256 << 20}

// Image is a pulled image as the store records it.
type Image struct {
	// Refs are the references that name this image, e.g.
	// "index.docker.io/library/python:3.12".
	Refs []string `json:"refs"`
	// Digest is the manifest's digest: the image's identity.
	Digest string `json:"digest"`
	// Config is the image's configuration (entrypoint, env, user...).
	Config v1.ConfigFile `json:"config"`
	// ConfigDigest is the config blob's digest.
	ConfigDigest string `json:"config_digest"`
	// Layers are the compressed layer digests, bottom first.
	Layers []string `json:"layers"`
	// Size is the compressed size of the layers.
	Size int64 `json:"size"`
	// RootfsSize is the size of the converted root filesystem file.
	RootfsSize int64     `json:"rootfs_size"`
	Pulled     time.Time `json:"pulled"`
}

// Store is an image cache in one directory. Its methods may be called
// from several goroutines, and several processes may share the directory:
// the index is a bbolt file opened per operation.
type Store struct {
	dir string
	log *slog.Logger
}

// Options configure registry access.
type Options struct {
	// Insecure names registries (host[:port]) reached over plain HTTP;
	// loopback registries always are.
	Insecure []string
	// Keychain gives registry credentials; nil means the user's Docker
	// config (authn.DefaultKeychain).
	Keychain authn.Keychain
	// Progress, when set, receives pull progress.
	Progress func(Progress)
	// Limits bound the root filesystem; zero means DefaultLimits.
	Limits ConvertLimits
}

// Progress reports one step of a pull.
type Progress struct {
	Layer    int    // index of the layer, bottom first; -1 for conversion
	Layers   int    // number of layers
	Digest   string // the layer's digest
	Done     int64  // bytes so far
	Total    int64  // bytes in all
	Cached   bool   // the layer was already in the cache
	Complete bool   // this step finished
}

var bucketRefs = []byte("refs")     // ref -> manifest digest
var bucketImages = []byte("images") // manifest digest -> Image (JSON)

// Open returns the store in dir, making it if needed.
func Open(dir string, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	for _, d := range []string{"blobs/sha256", "rootfs/sha256", "tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, fmt.Errorf("image: open store: %w", err)
		}
	}
	s := &Store{dir: dir, log: log}
	s.cleanTmp()
	return s, nil
}

// DefaultDir is where the CLI keeps images: $CAPSA_CACHE, else the user's
// cache directory.
func DefaultDir() (string, error) {
	if d := os.Getenv("CAPSA_CACHE"); d != "" {
		return filepath.Join(d, "images"), nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("image: no cache directory: %w", err)
	}
	return filepath.Join(d, "capsa", "images"), nil
}

// cleanTmp removes work files older than a day: those of a crashed pull.
// Younger ones may belong to a pull running in another process.
func (s *Store) cleanTmp() {
	ents, err := os.ReadDir(filepath.Join(s.dir, "tmp"))
	if err != nil {
		return
	}
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > 24*time.Hour {
			os.RemoveAll(filepath.Join(s.dir, "tmp", e.Name()))
		}
	}
}

func (s *Store) db(write bool, fn func(tx *bolt.Tx) error) error {
	db, err := bolt.Open(filepath.Join(s.dir, "index.db"), 0o644, &bolt.Options{Timeout: 30 * time.Second, ReadOnly: false})
	if err != nil {
		return fmt.Errorf("image: open index: %w", err)
	}
	defer db.Close()
	if write {
		return db.Update(func(tx *bolt.Tx) error {
			for _, b := range [][]byte{bucketRefs, bucketImages} {
				if _, err := tx.CreateBucketIfNotExists(b); err != nil {
					return err
				}
			}
			return fn(tx)
		})
	}
	return db.View(fn)
}

// BlobPath is where a blob with the given digest lives.
func (s *Store) blobPath(digest string) (string, error) {
	hexd, ok := strings.CutPrefix(digest, "sha256:")
	if !ok || len(hexd) != 64 || strings.Trim(hexd, "0123456789abcdef") != "" {
		return "", fmt.Errorf("image: digest %q is not sha256:<64 hex digits>", digest)
	}
	return filepath.Join(s.dir, "blobs", "sha256", hexd), nil
}

// RootfsPath is the image's root filesystem (EROFS), shared read-only by
// its sandboxes.
func (s *Store) RootfsPath(img *Image) (string, error) {
	hexd, ok := strings.CutPrefix(img.Digest, "sha256:")
	if !ok || len(hexd) != 64 || strings.Trim(hexd, "0123456789abcdef") != "" {
		return "", fmt.Errorf("image: digest %q is not sha256:<64 hex digits>", img.Digest)
	}
	return filepath.Join(s.dir, "rootfs", "sha256", hexd+".erofs"), nil
}

// writeAtomic writes what fill produces to path through a temporary file:
// synced, checked by check (if set) and renamed into place.
func (s *Store) writeAtomic(path string, fill func(f *os.File) error, check func() error) (err error) {
	f, err := os.CreateTemp(filepath.Join(s.dir, "tmp"), filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := fill(f); err != nil {
		return err
	}
	if check != nil {
		if err := check(); err != nil {
			return err
		}
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	return nil
}

// putBlob stores r under digest, refusing content that does not match it.
func (s *Store) putBlob(digest string, r io.Reader, progress func(int64)) error {
	p, err := s.blobPath(digest)
	if err != nil {
		return err
	}
	if _, err := os.Stat(p); err == nil {
		return nil
	}
	var h hash.Hash
	return s.writeAtomic(p, func(f *os.File) error {
		h = sha256.New()
		var w io.Writer = io.MultiWriter(f, h)
		if progress != nil {
			w = &countWriter{w: w, fn: progress}
		}
		if _, err := io.Copy(w, r); err != nil {
			return fmt.Errorf("image: fetch blob %s: %w", digest, err)
		}
		return nil
	}, func() error {
		if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != digest {
			return fmt.Errorf("image: blob %s: content has digest %s; refused", digest, got)
		}
		return nil
	})
}

type countWriter struct {
	w  io.Writer
	n  int64
	fn func(int64)
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	c.fn(c.n)
	return n, err
}

// ParseRef parses an image reference the way the store names images
// (python:3.12 is index.docker.io/library/python:3.12).
func ParseRef(ref string, insecure []string) (name.Reference, error) {
	var opts []name.Option
	r, err := name.ParseReference(ref)
	if err != nil {
		return nil, fmt.Errorf("image: reference %q: %w", ref, err)
	}
	for _, reg := range insecure {
		if r.Context().RegistryStr() == reg {
			opts = append(opts, name.Insecure)
		}
	}
	if len(opts) > 0 {
		if r, err = name.ParseReference(ref, opts...); err != nil {
			return nil, fmt.Errorf("image: reference %q: %w", ref, err)
		}
	}
	return r, nil
}

// Pull fetches ref's linux/amd64 image into the store and converts it.
// Layers already in the cache are not fetched again.
func (s *Store) Pull(ctx context.Context, ref string, o Options) (*Image, error) {
	r, err := ParseRef(ref, o.Insecure)
	if err != nil {
		return nil, err
	}
	kc := o.Keychain
	if kc == nil {
		kc = authn.DefaultKeychain
	}
	img, err := remote.Image(r, remote.WithContext(ctx), remote.WithAuthFromKeychain(kc), remote.WithPlatform(Platform))
	if err != nil {
		return nil, fmt.Errorf("image: pull %s: %w", ref, err)
	}
	return s.add(ctx, []string{r.Name()}, img, o)
}

// add stores img's blobs, converts its root and records it under refs.
func (s *Store) add(ctx context.Context, refs []string, img v1.Image, o Options) (*Image, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image: read config: %w", err)
	}
	if cf.OS != "" && (cf.OS != Platform.OS || cf.Architecture != Platform.Architecture) {
		return nil, fmt.Errorf("image: the image is for %s/%s; capsa runs %s/%s", cf.OS, cf.Architecture, Platform.OS, Platform.Architecture)
	}
	digest, err := img.Digest()
	if err != nil {
		return nil, fmt.Errorf("image: manifest digest: %w", err)
	}
	rawManifest, err := img.RawManifest()
	if err != nil {
		return nil, fmt.Errorf("image: read manifest: %w", err)
	}
	rawConfig, err := img.RawConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image: read config: %w", err)
	}
	cfgDigest, err := img.ConfigName()
	if err != nil {
		return nil, fmt.Errorf("image: config digest: %w", err)
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, fmt.Errorf("image: layers: %w", err)
	}
	rec := &Image{Refs: refs, Digest: digest.String(), ConfigDigest: cfgDigest.String(), Config: *cf, Pulled: time.Now().UTC()}
	for i, l := range layers {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		d, err := l.Digest()
		if err != nil {
			return nil, fmt.Errorf("image: layer %d digest: %w", i, err)
		}
		size, err := l.Size()
		if err != nil {
			return nil, fmt.Errorf("image: layer %s size: %w", d, err)
		}
		rec.Layers = append(rec.Layers, d.String())
		rec.Size += size
		p, err := s.blobPath(d.String())
		if err != nil {
			return nil, err
		}
		report := func(done int64, cached, complete bool) {
			if o.Progress != nil {
				o.Progress(Progress{Layer: i, Layers: len(layers), Digest: d.String(), Done: done, Total: size, Cached: cached, Complete: complete})
			}
		}
		if _, err := os.Stat(p); err == nil {
			report(size, true, true)
			continue
		}
		rc, err := l.Compressed()
		if err != nil {
			return nil, fmt.Errorf("image: fetch layer %s: %w", d, err)
		}
		err = s.putBlob(d.String(), rc, func(n int64) { report(n, false, false) })
		rc.Close()
		if err != nil {
			return nil, err
		}
		report(size, false, true)
	}
	if err := s.putBlob(cfgDigest.String(), strings.NewReader(string(rawConfig)), nil); err != nil {
		return nil, err
	}
	if err := s.putBlob(digest.String(), strings.NewReader(string(rawManifest)), nil); err != nil {
		return nil, err
	}
	cached, err := s.cachedImage(digest.String())
	if err != nil {
		return nil, err
	}
	if err := s.convert(ctx, rec, cached, o); err != nil {
		return nil, err
	}
	if err := s.record(rec); err != nil {
		return nil, err
	}
	return s.Get(refs[0])
}

// convert makes the image's root filesystem unless it is there.
func (s *Store) convert(ctx context.Context, rec *Image, img v1.Image, o Options) error {
	out, err := s.RootfsPath(rec)
	if err != nil {
		return err
	}
	if fi, err := os.Stat(out); err == nil {
		rec.RootfsSize = fi.Size()
		return nil
	}
	lim := o.Limits
	if lim == (ConvertLimits{}) {
		lim = DefaultLimits
	}
	work, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "convert.*")
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	defer os.RemoveAll(work)
	start := time.Now()
	var st convertStats
	err = s.writeAtomic(out, func(f *os.File) error {
		ls, err := img.Layers()
		if err != nil {
			return fmt.Errorf("image: layers: %w", err)
		}
		opens := make([]Layer, len(ls))
		for i, l := range ls {
			opens[i] = func() (io.ReadCloser, error) {
				rc, err := l.Uncompressed()
				if err != nil {
					return nil, err
				}
				return struct {
					io.Reader
					io.Closer
				}{&ctxReader{ctx: ctx, r: rc}, rc}, nil
			}
		}
		st, err = toEROFS(opens, f, work, lim)
		return err
	}, nil)
	if err != nil {
		return err
	}
	if fi, err := os.Stat(out); err == nil {
		rec.RootfsSize = fi.Size()
	}
	s.log.Info("image: converted", "digest", rec.Digest, "entries", st.Entries, "bytes", st.Bytes, "took", time.Since(start))
	if o.Progress != nil {
		o.Progress(Progress{Layer: -1, Layers: len(rec.Layers), Digest: rec.Digest, Done: st.Bytes, Total: st.Bytes, Complete: true})
	}
	return nil
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// record adds rec to the index under each of its refs; a ref that named
// another image now names this one.
func (s *Store) record(rec *Image) error {
	return s.db(true, func(tx *bolt.Tx) error {
		images, refs := tx.Bucket(bucketImages), tx.Bucket(bucketRefs)
		if old := images.Get([]byte(rec.Digest)); old != nil {
			var prev Image
			if json.Unmarshal(old, &prev) == nil {
				rec.Refs = mergeRefs(prev.Refs, rec.Refs)
			}
		}
		for _, r := range rec.Refs {
			if old := refs.Get([]byte(r)); old != nil && string(old) != rec.Digest {
				if err := dropRef(tx, string(old), r); err != nil {
					return err
				}
			}
			if err := refs.Put([]byte(r), []byte(rec.Digest)); err != nil {
				return err
			}
		}
		b, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		return images.Put([]byte(rec.Digest), b)
	})
}

func mergeRefs(a, b []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, r := range append(append([]string(nil), a...), b...) {
		if !seen[r] {
			seen[r] = true
			out = append(out, r)
		}
	}
	sort.Strings(out)
	return out
}

// dropRef removes ref from the image digest's record.
func dropRef(tx *bolt.Tx, digest, ref string) error {
	images := tx.Bucket(bucketImages)
	raw := images.Get([]byte(digest))
	if raw == nil {
		return nil
	}
	var img Image
	if err := json.Unmarshal(raw, &img); err != nil {
		return fmt.Errorf("image: index entry %s: %w", digest, err)
	}
	var keep []string
	for _, r := range img.Refs {
		if r != ref {
			keep = append(keep, r)
		}
	}
	img.Refs = keep
	b, err := json.Marshal(&img)
	if err != nil {
		return err
	}
	return images.Put([]byte(digest), b)
}

// ErrNotFound is returned for an image that is not in the store.
var ErrNotFound = errors.New("image not found")

// Get finds an image by reference or by digest (a unique prefix of its
// hex digits is enough).
func (s *Store) Get(ref string) (*Image, error) {
	var img *Image
	err := s.db(false, func(tx *bolt.Tx) error {
		images, refs := tx.Bucket(bucketImages), tx.Bucket(bucketRefs)
		if images == nil {
			return nil
		}
		key := ""
		if r, err := ParseRef(ref, nil); err == nil {
			if d := refs.Get([]byte(r.Name())); d != nil {
				key = string(d)
			}
		}
		if key == "" {
			want := strings.TrimPrefix(ref, "sha256:")
			if len(want) >= 6 && strings.Trim(want, "0123456789abcdef") == "" {
				n := 0
				images.ForEach(func(k, _ []byte) error {
					if strings.HasPrefix(strings.TrimPrefix(string(k), "sha256:"), want) {
						key = string(k)
						n++
					}
					return nil
				})
				if n > 1 {
					return fmt.Errorf("image: %q names %d images", ref, n)
				}
			}
		}
		if key == "" {
			return nil
		}
		raw := images.Get([]byte(key))
		if raw == nil {
			return nil
		}
		img = new(Image)
		return json.Unmarshal(raw, img)
	})
	if err != nil {
		return nil, err
	}
	if img == nil {
		return nil, fmt.Errorf("image: %s: %w", ref, ErrNotFound)
	}
	return img, nil
}

// List returns every image in the store, newest first.
func (s *Store) List() ([]*Image, error) {
	var out []*Image
	err := s.db(false, func(tx *bolt.Tx) error {
		images := tx.Bucket(bucketImages)
		if images == nil {
			return nil
		}
		return images.ForEach(func(_, v []byte) error {
			img := new(Image)
			if err := json.Unmarshal(v, img); err != nil {
				return err
			}
			out = append(out, img)
			return nil
		})
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Pulled.After(out[j].Pulled) })
	return out, err
}

// Remove untags ref; an image left with no reference (or removed by
// digest) is deleted with its root filesystem. Blobs are left for Prune.
func (s *Store) Remove(ref string) error {
	img, err := s.Get(ref)
	if err != nil {
		return err
	}
	r, perr := ParseRef(ref, nil)
	byRef := perr == nil && contains(img.Refs, r.Name())
	deleteImage := !byRef || len(img.Refs) == 1
	err = s.db(true, func(tx *bolt.Tx) error {
		if byRef {
			if err := tx.Bucket(bucketRefs).Delete([]byte(r.Name())); err != nil {
				return err
			}
			if err := dropRef(tx, img.Digest, r.Name()); err != nil {
				return err
			}
		}
		if deleteImage {
			for _, ref := range img.Refs {
				if err := tx.Bucket(bucketRefs).Delete([]byte(ref)); err != nil {
					return err
				}
			}
			return tx.Bucket(bucketImages).Delete([]byte(img.Digest))
		}
		return nil
	})
	if err != nil {
		return err
	}
	if deleteImage {
		p, _ := s.RootfsPath(img)
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("image: remove %s: %w", ref, err)
		}
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Prune deletes blobs and root filesystems no recorded image uses, and
// returns the bytes freed.
func (s *Store) Prune() (int64, error) {
	imgs, err := s.List()
	if err != nil {
		return 0, err
	}
	keep := map[string]bool{}
	for _, img := range imgs {
		p, _ := s.RootfsPath(img)
		keep[p] = true
		for _, l := range img.Layers {
			if p, err := s.blobPath(l); err == nil {
				keep[p] = true
			}
		}
		// The manifest and config stay with the image.
		for _, d := range []string{img.Digest, img.ConfigDigest} {
			if p, err := s.blobPath(d); err == nil {
				keep[p] = true
			}
		}
	}
	var freed int64
	for _, dir := range []string{"blobs/sha256", "rootfs/sha256"} {
		ents, err := os.ReadDir(filepath.Join(s.dir, dir))
		if err != nil {
			return freed, fmt.Errorf("image: prune: %w", err)
		}
		for _, e := range ents {
			p := filepath.Join(s.dir, dir, e.Name())
			if keep[p] {
				continue
			}
			fi, err := e.Info()
			if err != nil {
				continue
			}
			if err := os.Remove(p); err == nil {
				freed += fi.Size()
			}
		}
	}
	return freed, nil
}
