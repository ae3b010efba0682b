package image

import (
	"context"
	"fmt"
	"io"
	"os"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Import adds the image in file, a `docker save` tarball or an OCI image
// layout directory, and names it ref (for a tarball with a tag in it and
// no ref, that tag).
func (s *Store) Import(ctx context.Context, file, ref string, o Options) (*Image, error) {
	fi, err := os.Stat(file)
	if err != nil {
		return nil, fmt.Errorf("image: import: %w", err)
	}
	var img v1.Image
	if fi.IsDir() {
		if img, err = fromLayout(file); err != nil {
			return nil, err
		}
	} else {
		if ref == "" {
			m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(file) })
			if err != nil {
				return nil, fmt.Errorf("image: import %s: not a docker save tarball: %w", file, err)
			}
			if len(m) != 1 || len(m[0].RepoTags) == 0 {
				return nil, fmt.Errorf("image: import %s: the tarball holds %d images; name one with a reference", file, len(m))
			}
			ref = m[0].RepoTags[0]
		}
		if img, err = tarball.ImageFromPath(file, nil); err != nil {
			return nil, fmt.Errorf("image: import %s: not a docker save tarball: %w", file, err)
		}
	}
	if ref == "" {
		return nil, fmt.Errorf("image: import %s: name the image with a reference", file)
	}
	r, err := ParseRef(ref, nil)
	if err != nil {
		return nil, err
	}
	return s.add(ctx, []string{r.Name()}, img, o)
}

// fromLayout picks the linux/amd64 image of an OCI image layout.
func fromLayout(dir string) (v1.Image, error) {
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("image: import %s: not an OCI image layout: %w", dir, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("image: import %s: %w", dir, err)
	}
	for _, d := range m.Manifests {
		if d.Platform != nil && (d.Platform.OS != Platform.OS || d.Platform.Architecture != Platform.Architecture) {
			continue
		}
		if d.MediaType.IsIndex() {
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, fmt.Errorf("image: import %s: %w", dir, err)
			}
			cm, err := child.IndexManifest()
			if err != nil {
				return nil, fmt.Errorf("image: import %s: %w", dir, err)
			}
			for _, cd := range cm.Manifests {
				if cd.Platform == nil || (cd.Platform.OS == Platform.OS && cd.Platform.Architecture == Platform.Architecture) {
					return child.Image(cd.Digest)
				}
			}
			continue
		}
		if d.MediaType.IsImage() {
			return idx.Image(d.Digest)
		}
	}
	return nil, fmt.Errorf("image: import %s: no %s/%s image in the layout", dir, Platform.OS, Platform.Architecture)
}
