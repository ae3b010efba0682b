package image

import (
	"bytes"
	"fmt"
	"io"
	"os"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// cachedImage is an image read back from the store's blobs, through
// go-containerregistry's partial package: the manifest and config from
// their blobs, each layer from its compressed blob (already checked
// against its digest when it was stored).
func (s *Store) cachedImage(digest string) (v1.Image, error) {
	p, err := s.blobPath(digest)
	if err != nil {
		return nil, err
	}
	raw, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("image: manifest %s: %w", digest, err)
	}
	m, err := v1.ParseManifest(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("image: manifest %s: %w", digest, err)
	}
	return partial.CompressedToImage(&cachedCore{s: s, raw: raw, m: m})
}

type cachedCore struct {
	s   *Store
	raw []byte
	m   *v1.Manifest
}

func (c *cachedCore) RawManifest() ([]byte, error) { return c.raw, nil }

func (c *cachedCore) MediaType() (types.MediaType, error) {
	if c.m.MediaType != "" {
		return c.m.MediaType, nil
	}
	return types.OCIManifestSchema1, nil
}

func (c *cachedCore) RawConfigFile() ([]byte, error) {
	p, err := c.s.blobPath(c.m.Config.Digest.String())
	if err != nil {
		return nil, err
	}
	return os.ReadFile(p)
}

func (c *cachedCore) LayerByDigest(h v1.Hash) (partial.CompressedLayer, error) {
	for _, l := range c.m.Layers {
		if l.Digest == h {
			return &cachedLayer{s: c.s, desc: l}, nil
		}
	}
	return nil, fmt.Errorf("image: layer %s is not in the manifest", h)
}

type cachedLayer struct {
	s    *Store
	desc v1.Descriptor
}

func (l *cachedLayer) Digest() (v1.Hash, error)            { return l.desc.Digest, nil }
func (l *cachedLayer) Size() (int64, error)                { return l.desc.Size, nil }
func (l *cachedLayer) MediaType() (types.MediaType, error) { return l.desc.MediaType, nil }

func (l *cachedLayer) Compressed() (io.ReadCloser, error) {
	p, err := l.s.blobPath(l.desc.Digest.String())
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("image: layer %s: %w", l.desc.Digest, err)
	}
	return f, nil
}
