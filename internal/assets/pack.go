package assets

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/capsa-sandbox/capsa/agent"
)

// Compressor writes the zstd compression of the file src, whose content's
// SHA-256 is sum (hex), to the file dst.
type Compressor func(src, dst, sum string) error

// Pack writes a set to dir (created if needed) from an uncompressed kernel
// and initramfs built by capsa version: vmlinux.zst, initramfs.cpio.zst
// and, last, manifest.json, each by rename so a reader never sees a file
// half written. The agent protocol range written is this package's, so the
// initramfs must hold the agent built from the same source.
func Pack(dir, version, kernel, initramfs string, compress Compressor) (*Manifest, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("assets: pack: %w", err)
	}
	m := Manifest{
		Format:        ManifestFormat,
		CapsaVersion:  version,
		AgentProtocol: [2]int{agent.MinProtocolVersion, agent.ProtocolVersion},
	}
	var err error
	if m.Kernel, err = packFile(dir, kernel, "vmlinux.zst", compress); err != nil {
		return nil, err
	}
	if m.Initramfs, err = packFile(dir, initramfs, "initramfs.cpio.zst", compress); err != nil {
		return nil, err
	}
	if err := m.check(); err != nil {
		return nil, fmt.Errorf("assets: pack: %w", err)
	}
	data, err := json.MarshalIndent(&m, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(dir, ManifestName), append(data, '\n')); err != nil {
		return nil, fmt.Errorf("assets: pack: %w", err)
	}
	return &m, nil
}

func packFile(dir, src, name string, compress Compressor) (File, error) {
	fail := func(err error) (File, error) { return File{}, fmt.Errorf("assets: pack %s: %w", src, err) }
	size, content, err := hashFile(src)
	if err != nil {
		return fail(err)
	}
	dst := filepath.Join(dir, name)
	tmp := dst + ".tmp"
	defer os.Remove(tmp)
	if err := compress(src, tmp, content); err != nil {
		return fail(err)
	}
	_, sum, err := hashFile(tmp)
	if err != nil {
		return fail(err)
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		return fail(err)
	}
	return File{Name: name, SHA256: sum, Size: size, ContentSHA256: content}, nil
}

func hashFile(path string) (int64, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, "", err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return 0, "", err
	}
	return n, hex.EncodeToString(h.Sum(nil)), nil
}

func writeFile(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}
