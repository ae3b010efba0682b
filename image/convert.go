package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"sort"
	"strings"

	"github.com/erofs/go-erofs"
)

// Unix file type bits for Mknod (go-erofs takes them raw).
const (
	sIFIFO = 0o010000
	sIFCHR = 0o020000
	sIFBLK = 0o060000
)

// maxSymlinkDepth bounds how many symlinks resolving one hard link's
// target may follow: a loop is an error, never a hang.
const maxSymlinkDepth = 40

// ConvertLimits bound what a conversion may produce: a hostile image
// must not fill the host's disk or memory.
type ConvertLimits struct {
	// MaxBytes bounds the file data written (0: no bound).
	MaxBytes int64
	// MaxEntries bounds the files, directories and links (0: no bound).
	MaxEntries int
	// MaxMetaBytes bounds the entries' metadata the conversion holds in
	// memory until its end (names, link targets, extended attributes of
	// directories, files and hard links; 0: no bound). What it holds
	// besides is a constant per entry, which MaxEntries bounds.
	MaxMetaBytes int64
}

// Bounds of one entry's names, whatever the limits: Linux's PATH_MAX for
// a path or a link's target, and a depth that no real tree reaches. The
// conversion's work per entry grows with both (each parent is looked up).
const (
	maxPathLen   = 4096
	maxPathDepth = 256
)

// ErrTooLarge is wrapped by a conversion that went past its limits.
var ErrTooLarge = errors.New("image is larger than allowed")

// convertStats describes a finished conversion.
type convertStats struct {
	Entries   int
	Bytes     int64
	MetaBytes int64 // metadata held until the end (ConvertLimits.MaxMetaBytes)
}

// Layer opens one layer's uncompressed tar stream.
type Layer func() (io.ReadCloser, error)

// toEROFS writes the root filesystem the layers make (the first layer at
// the bottom, as in a manifest) as an EROFS image to out.
//
// Nothing is unpacked on the host: entries go from the tar streams into
// the EROFS writer, which spools file data in tmpDir. A path with "..", an
// absolute path or a path through a symlink therefore cannot touch a host
// file; such entries are refused or resolved inside the image.
//
// What the EROFS image keeps exactly: the tree, file data, modes including
// setuid, setgid and sticky bits, owners, modification times, device
// nodes, FIFOs and xattrs (file capabilities among them). Hard links become
// copies of their target with the same data and metadata: go-erofs has no
// call that makes two names share an inode.
func toEROFS(layers []Layer, out io.WriteSeeker, tmpDir string, lim ConvertLimits) (convertStats, error) {
	w := erofs.Create(out, erofs.WithTempDir(tmpDir))
	c := &converter{w: w, lim: lim, kinds: map[string]kind{"/": kindDir}, layerOf: map[string]int{}}
	if err := c.flatten(layers); err != nil {
		return c.stats, err
	}
	if err := c.finish(layers); err != nil {
		return c.stats, err
	}
	if err := w.Close(); err != nil {
		return c.stats, fmt.Errorf("image: write EROFS: %w", err)
	}
	return c.stats, nil
}

// eachEntry calls fn for every entry of layer i, in order.
func eachEntry(layers []Layer, i int, fn func(h *tar.Header, data io.Reader) error) error {
	rc, err := layers[i]()
	if err != nil {
		return fmt.Errorf("image: open layer %d: %w", i, err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("image: read layer %d: %w", i, err)
		}
		if err := fn(h, tr); err != nil {
			return err
		}
	}
}

// flatten adds every entry that the layers above do not hide, the top
// layer first, so the first entry of a path is the one that counts. It
// applies the OCI image spec's whiteouts: ".wh.NAME" deletes NAME of the
// layers below, ".wh..wh..opq" hides everything the layers below have in
// its directory.
//
// This is go-containerregistry's mutate.Extract done here, because a hard
// link must be made from its own layer: a layer's hard link and its target
// are one inode, so when an upper layer deletes or replaces the target's
// name, the link keeps the old data (as overlayfs shows it). Extract's
// single stream neither says which layer an entry came from nor keeps a
// deleted target.
func (c *converter) flatten(layers []Layer) error {
	gone := map[string]bool{}   // deleted by a whiteout of a layer above
	opaque := map[string]bool{} // directories made opaque by a layer above
	for i := len(layers) - 1; i >= 0; i-- {
		c.layer = i
		whiteouts, opaques := map[string]bool{}, map[string]bool{}
		err := eachEntry(layers, i, func(h *tar.Header, data io.Reader) error {
			p, err := cleanName(h.Name)
			if err != nil {
				return err
			}
			dir, base := path.Split(p)
			dir = path.Clean(dir)
			if base == ".wh..wh..opq" {
				opaques[dir] = true
				return nil
			}
			if name, ok := strings.CutPrefix(base, ".wh."); ok {
				whiteouts[path.Join(dir, name)] = true
				return nil
			}
			if c.hidden(p, gone, opaque) {
				return nil
			}
			return c.add(h, data)
		})
		if err != nil {
			return err
		}
		for p := range whiteouts {
			gone[p] = true
		}
		for p := range opaques {
			opaque[p] = true
		}
	}
	return nil
}

// hidden reports whether a layer above hides path p of the current layer:
// p or a parent deleted, a parent made opaque, or a parent that is not a
// directory there.
func (c *converter) hidden(p string, gone, opaque map[string]bool) bool {
	if gone[p] {
		return true
	}
	for d := path.Dir(p); d != "/"; d = path.Dir(d) {
		if gone[d] || opaque[d] {
			return true
		}
		if l, ok := c.layerOf[d]; ok && l > c.layer {
			if k := c.kinds[d]; k != kindDir && k != kindImplicit {
				return true
			}
		}
	}
	return opaque["/"] && p != "/"
}

type kind int

const (
	kindImplicit kind = iota + 1 // a parent made before its own entry came
	kindDir
	kindFile
	kindSymlink
	kindOther
)

type converter struct {
	w     *erofs.Writer
	lim   ConvertLimits
	stats convertStats
	// kinds records each path added, to tell implicit parents from real
	// entries and to resolve hard links.
	kinds   map[string]kind
	layerOf map[string]int    // the layer each entry came from
	layer   int               // the layer being added
	links   map[string]string // symlink targets
	dirs    []*tar.Header     // directory metadata, applied at the end
	hard    []*tar.Header     // hard links, made at the end
	headers map[string]*tar.Header
}

// cleanName turns a tar entry name into an absolute path inside the image,
// refusing names that leave it.
func cleanName(name string) (string, error) {
	if len(name) > maxPathLen {
		return "", fmt.Errorf("image: layer entry %.64q...: a name of %d bytes, longer than %d", name, len(name), maxPathLen)
	}
	if n := strings.Count(name, "/"); n > maxPathDepth {
		return "", fmt.Errorf("image: layer entry %.64q...: %d directories deep, deeper than %d", name, n, maxPathDepth)
	}
	if strings.HasPrefix(name, "/") {
		return "", fmt.Errorf("image: layer entry %q: absolute path", name)
	}
	for _, part := range strings.Split(name, "/") {
		if part == ".." {
			return "", fmt.Errorf("image: layer entry %q: path leaves the image", name)
		}
	}
	return path.Clean("/" + name), nil
}

func (c *converter) count(n int64) error {
	c.stats.Entries++
	c.stats.Bytes += n
	if c.lim.MaxEntries > 0 && c.stats.Entries > c.lim.MaxEntries {
		return fmt.Errorf("%w: more than %d entries", ErrTooLarge, c.lim.MaxEntries)
	}
	if c.lim.MaxBytes > 0 && c.stats.Bytes > c.lim.MaxBytes {
		return fmt.Errorf("%w: more than %d bytes of files", ErrTooLarge, c.lim.MaxBytes)
	}
	return nil
}

// keep returns what the conversion holds of h until its end: h without
// the PAX records it does not use (only extended attributes are), its size
// counted against MaxMetaBytes.
func (c *converter) keep(h *tar.Header) (*tar.Header, error) {
	// Strings are copied: archive/tar cuts names and records out of the
	// whole PAX block, which a kept substring would keep alive.
	k := *h
	k.PAXRecords, k.Xattrs = nil, nil
	k.Name, k.Linkname, k.Uname, k.Gname = strings.Clone(h.Name), strings.Clone(h.Linkname), strings.Clone(h.Uname), strings.Clone(h.Gname)
	n := int64(len(k.Name) + len(k.Linkname) + len(k.Uname) + len(k.Gname))
	for key, v := range h.PAXRecords {
		if strings.HasPrefix(key, "SCHILY.xattr.") {
			if k.PAXRecords == nil {
				k.PAXRecords = map[string]string{}
			}
			k.PAXRecords[strings.Clone(key)] = strings.Clone(v)
			n += int64(len(key) + len(v))
		}
	}
	c.stats.MetaBytes += n
	if c.lim.MaxMetaBytes > 0 && c.stats.MetaBytes > c.lim.MaxMetaBytes {
		return nil, fmt.Errorf("%w: more than %d bytes of names and attributes", ErrTooLarge, c.lim.MaxMetaBytes)
	}
	return &k, nil
}

// parents checks that no parent of p is a symlink or a non-directory, and
// records the missing ones as implicit directories.
func (c *converter) parents(p string) error {
	var missing []string
	for d := path.Dir(p); d != "/"; d = path.Dir(d) {
		switch c.kinds[d] {
		case 0:
			missing = append(missing, d)
			continue
		case kindDir, kindImplicit:
		case kindSymlink:
			return fmt.Errorf("image: layer entry %s goes through the symlink %s; not supported", p, d)
		default:
			return fmt.Errorf("image: layer entry %s is under %s, which is not a directory", p, d)
		}
		break
	}
	for _, d := range missing {
		c.kinds[d] = kindImplicit
	}
	return nil
}

func (c *converter) add(h *tar.Header, data io.Reader) error {
	p, err := cleanName(h.Name)
	if err != nil {
		return err
	}
	// A link's target is bounded as a path is, whatever the entry.
	if len(h.Linkname) > maxPathLen {
		what := "link"
		if h.Typeflag == tar.TypeSymlink {
			what = "symlink"
		}
		return fmt.Errorf("image: layer entry %s: a %s target of %d bytes, longer than %d", p, what, len(h.Linkname), maxPathLen)
	}
	if p == "/" {
		if h.Typeflag == tar.TypeDir {
			// Held like any directory's header: every layer may have
			// its "./", and a layer many.
			kh, err := c.keep(h)
			if err != nil {
				return err
			}
			c.dirs = append(c.dirs, kh)
		}
		return nil
	}
	if k := c.kinds[p]; k != 0 {
		if k == kindImplicit && h.Typeflag == tar.TypeDir {
			c.kinds[p] = kindDir
			kh, err := c.keep(h)
			if err != nil {
				return err
			}
			c.dirs = append(c.dirs, kh)
			return c.count(0)
		}
		if k == kindImplicit {
			return fmt.Errorf("image: layer entry %s: a lower layer made it a %s where upper layers have a directory", p, typeName(h.Typeflag))
		}
		return nil // the flattened stream has each path once; keep the first
	}
	if err := c.parents(p); err != nil {
		return err
	}
	c.layerOf[p] = c.layer
	switch h.Typeflag {
	case tar.TypeDir:
		if err := c.w.Mkdir(p, 0o755); err != nil {
			return fmt.Errorf("image: %s: %w", p, err)
		}
		c.kinds[p] = kindDir
		kh, err := c.keep(h)
		if err != nil {
			return err
		}
		c.dirs = append(c.dirs, kh)
		return c.count(0)
	case tar.TypeReg, tar.TypeRegA:
		if err := c.writeFile(p, h, data); err != nil {
			return err
		}
	case tar.TypeSymlink:
		if err := c.w.Symlink(h.Linkname, p); err != nil {
			return fmt.Errorf("image: %s: %w", p, err)
		}
		c.kinds[p] = kindSymlink
		if c.links == nil {
			c.links = map[string]string{}
		}
		c.links[p] = strings.Clone(h.Linkname) // not the PAX block it was cut from
		c.stats.MetaBytes += int64(len(h.Linkname))
		if err := c.count(0); err != nil {
			return err
		}
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		mode := map[byte]uint16{tar.TypeChar: sIFCHR, tar.TypeBlock: sIFBLK, tar.TypeFifo: sIFIFO}[h.Typeflag]
		rdev := uint32(h.Devmajor&0xfff)<<8 | uint32(h.Devminor&0xff) | uint32(h.Devminor&^0xff)<<12
		if err := c.w.Mknod(p, mode|uint16(h.Mode&0o7777), rdev); err != nil {
			return fmt.Errorf("image: %s: %w", p, err)
		}
		c.kinds[p] = kindOther
		if err := c.count(0); err != nil {
			return err
		}
	case tar.TypeLink:
		// The target may come later: the stream has upper layers first.
		c.kinds[p] = kindOther
		kh, err := c.keep(h)
		if err != nil {
			return err
		}
		c.hard = append(c.hard, kh)
		return c.count(0)
	default:
		// Sockets and tar's own records (GNU long names, PAX headers
		// are consumed by archive/tar) have no place in a root.
		return nil
	}
	return c.meta(p, h)
}

// meta applies an entry's owner, mode, time and xattrs.
func (c *converter) meta(p string, h *tar.Header) error {
	if err := c.w.Chown(p, h.Uid, h.Gid); err != nil {
		return fmt.Errorf("image: %s: %w", p, err)
	}
	if h.Typeflag != tar.TypeSymlink {
		if err := c.w.Chmod(p, tarMode(h.Mode)); err != nil {
			return fmt.Errorf("image: %s: %w", p, err)
		}
	}
	if err := c.w.Chtimes(p, h.ModTime, h.ModTime); err != nil {
		return fmt.Errorf("image: %s: %w", p, err)
	}
	keys := make([]string, 0, len(h.PAXRecords))
	for k := range h.PAXRecords {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			if err := c.w.Setxattr(p, name, h.PAXRecords[k]); err != nil {
				return fmt.Errorf("image: %s: xattr %s: %w", p, name, err)
			}
		}
	}
	return nil
}

// tarMode turns a tar header's mode into an fs.FileMode's permission and
// special bits.
func tarMode(m int64) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	if m&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if m&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if m&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

func typeName(t byte) string {
	switch t {
	case tar.TypeReg, tar.TypeRegA:
		return "file"
	case tar.TypeSymlink:
		return "symlink"
	case tar.TypeLink:
		return "hard link"
	default:
		return fmt.Sprintf("entry of type %q", t)
	}
}

// finish applies directory metadata (directories may have been made
// implicitly before their entry came) and makes the hard links.
func (c *converter) finish(layers []Layer) error {
	for _, h := range c.dirs {
		p, _ := cleanName(h.Name)
		if err := c.meta(p, h); err != nil {
			return err
		}
	}
	// A link whose target an upper layer deleted or replaced is made
	// again from the link's own layer.
	fromLayer := map[int][]*tar.Header{}
	for _, h := range c.hard {
		p, _ := cleanName(h.Name)
		target, err := c.resolve(h.Linkname)
		if err != nil || c.layerOf[target] > c.layerOf[p] {
			fromLayer[c.layerOf[p]] = append(fromLayer[c.layerOf[p]], h)
			continue
		}
		if err := c.copyFile(target, p); err != nil {
			return fmt.Errorf("image: hard link %s to %s: %w", p, target, err)
		}
	}
	for i, links := range fromLayer {
		if err := c.linksFromLayer(layers, i, links); err != nil {
			return err
		}
	}
	return nil
}

// linksFromLayer makes hard links of layer i whose target an upper layer
// deleted or replaced: the target's data and metadata are read again from
// layer i (where tar puts a link's target before the link).
func (c *converter) linksFromLayer(layers []Layer, i int, links []*tar.Header) error {
	byTarget := map[string][]string{} // target -> link paths
	for _, h := range links {
		p, _ := cleanName(h.Name)
		t, err := cleanName(h.Linkname)
		if err != nil {
			return fmt.Errorf("image: hard link %s: %w", p, err)
		}
		byTarget[t] = append(byTarget[t], p)
	}
	err := eachEntry(layers, i, func(h *tar.Header, data io.Reader) error {
		if h.Typeflag != tar.TypeReg && h.Typeflag != tar.TypeRegA {
			return nil
		}
		t, err := cleanName(h.Name)
		if err != nil {
			return err
		}
		ps := byTarget[t]
		if len(ps) == 0 {
			return nil
		}
		delete(byTarget, t)
		if err := c.writeFile(ps[0], h, data); err != nil {
			return err
		}
		if err := c.meta(ps[0], h); err != nil {
			return err
		}
		for _, p := range ps[1:] {
			if err := c.copyFile(ps[0], p); err != nil {
				return fmt.Errorf("image: hard link %s to %s: %w", p, t, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for t, ps := range byTarget {
		// Not a regular file of the link's own layer: report it as the
		// image sees it.
		if _, err := c.resolve(strings.TrimPrefix(t, "/")); err != nil {
			return fmt.Errorf("image: hard link %s: %w", ps[0], err)
		}
		return fmt.Errorf("image: hard link %s: target %s is not a regular file of the link's layer", ps[0], t)
	}
	return nil
}

// writeFile makes p a regular file holding h.Size bytes of data, counted
// against the limits, and records it (h gives its metadata to copies).
func (c *converter) writeFile(p string, h *tar.Header, data io.Reader) error {
	if err := c.count(h.Size); err != nil {
		return err
	}
	f, err := c.w.Create(p)
	if err != nil {
		return fmt.Errorf("image: %s: %w", p, err)
	}
	if _, err := io.Copy(f, io.LimitReader(data, h.Size)); err != nil {
		f.Close()
		return fmt.Errorf("image: %s: %w", p, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("image: %s: %w", p, err)
	}
	c.kinds[p] = kindFile
	if c.headers == nil {
		c.headers = map[string]*tar.Header{}
	}
	kh, err := c.keep(h)
	if err != nil {
		return err
	}
	c.headers[p] = kh
	return nil
}

// resolve finds a hard link's target: a regular file, reached through
// symlinks in its parents as the kernel would, without leaving the image.
func (c *converter) resolve(name string) (string, error) {
	p, err := cleanName(name)
	if err != nil {
		return "", err
	}
	for depth := 0; ; depth++ {
		if depth > maxSymlinkDepth {
			return "", fmt.Errorf("target %s: too many levels of symlinks", name)
		}
		switch c.kinds[p] {
		case kindFile:
			return p, nil
		case kindSymlink:
			t := c.links[p]
			if !strings.HasPrefix(t, "/") {
				t = path.Join(path.Dir(p), t)
			}
			p = path.Clean("/" + t) // ".." above the root stays at the root
			continue
		case 0:
			// A parent may be a symlink.
			if q, ok := c.throughSymlink(p); ok {
				p = q
				continue
			}
			return "", fmt.Errorf("target %s is not in the image", name)
		default:
			return "", fmt.Errorf("target %s is not a regular file", name)
		}
	}
}

// throughSymlink rewrites p when one of its parents is a symlink.
func (c *converter) throughSymlink(p string) (string, bool) {
	for d := path.Dir(p); d != "/"; d = path.Dir(d) {
		if c.kinds[d] == kindSymlink {
			t := c.links[d]
			if !strings.HasPrefix(t, "/") {
				t = path.Join(path.Dir(d), t)
			}
			rest := strings.TrimPrefix(p, d)
			return path.Clean("/" + t + rest), true
		}
	}
	return "", false
}

// copyFile makes dst a copy of the regular file src: its data, and the
// metadata of src's own entry.
func (c *converter) copyFile(src, dst string) error {
	h := c.headers[src]
	in, err := c.w.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := c.writeFile(dst, h, in); err != nil {
		return err
	}
	return c.meta(dst, h)
}
