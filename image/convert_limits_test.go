package image

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// rawLayer is a Layer of the tar stream entries make (each header as
// given, PAX format), for the conversion's own tests.
func rawLayer(t *testing.T, headers ...*tar.Header) Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range headers {
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	return func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
}

func convert(t *testing.T, lim ConvertLimits, layers ...Layer) (convertStats, error) {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "out.erofs"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return toEROFS(layers, f, t.TempDir(), lim)
}

// TestConvertHoldsNoUnusedPAX: the conversion holds each directory's,
// file's and hard link's header until its end; it holds them without the
// PAX records it does not use (only extended attributes are), so 200
// entries carrying 512 KiB records each (100 MiB) leave it holding their
// names only. Before, a 549 KiB gzipped layer of such entries held 504 MiB.
func TestConvertHoldsNoUnusedPAX(t *testing.T) {
	big := strings.Repeat("x", 512<<10)
	var hs []*tar.Header
	for i := range 200 {
		typ := byte(tar.TypeDir)
		if i%2 == 1 {
			typ = tar.TypeReg
		}
		hs = append(hs, &tar.Header{Name: fmt.Sprintf("d%d/e%d", i%26, i), Typeflag: typ, Mode: 0o755,
			PAXRecords: map[string]string{"comment": big, "SCHILY.xattr.user.k": "v"}})
	}
	st, err := convert(t, DefaultLimits, rawLayer(t, hs...))
	if err != nil {
		t.Fatal(err)
	}
	if st.MetaBytes > 64<<10 {
		t.Errorf("the conversion held %d bytes of metadata; want the names and the one attribute", st.MetaBytes)
	}
	// The root's entry ("./", in every layer, and as often as a layer
	// likes) is held the same way.
	c := &converter{}
	for range 3 {
		if err := c.add(&tar.Header{Name: "./", Typeflag: tar.TypeDir, PAXRecords: map[string]string{"comment": big}}, nil); err != nil {
			t.Fatal(err)
		}
	}
	if len(c.dirs) != 3 || c.dirs[0].PAXRecords != nil {
		t.Errorf("the root's headers held: %d, the first with %d PAX records; want 3, without them", len(c.dirs), len(c.dirs[0].PAXRecords))
	}
	k, err := c.keep(&tar.Header{Name: "a", PAXRecords: map[string]string{"comment": big, "SCHILY.xattr.user.k": "v"}})
	if err != nil || len(k.PAXRecords) != 1 || k.PAXRecords["SCHILY.xattr.user.k"] != "v" {
		t.Errorf("keep = %v, %v; want only the attribute's record", k.PAXRecords, err)
	}
}

// TestConvertBoundsMetadata: extended attributes held to the end count
// against MaxMetaBytes, refused past it as ErrTooLarge.
func TestConvertBoundsMetadata(t *testing.T) {
	var hs []*tar.Header
	for _, name := range []string{"a", "b", "c"} {
		hs = append(hs, &tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: 0o755,
			PAXRecords: map[string]string{"SCHILY.xattr.user.big": strings.Repeat("v", 40<<10)}})
	}
	if _, err := convert(t, ConvertLimits{MaxMetaBytes: 100 << 10}, rawLayer(t, hs...)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("120 KiB of attributes under a 100 KiB bound = %v; want ErrTooLarge", err)
	}
	if st, err := convert(t, ConvertLimits{MaxMetaBytes: 200 << 10}, rawLayer(t, hs...)); err != nil || st.MetaBytes < 120<<10 {
		t.Errorf("under a 200 KiB bound = %+v, %v; want it converted, the attributes counted", st, err)
	}
}

// TestConvertBoundsNames: a path deeper than maxPathDepth or longer than
// maxPathLen, and a link target longer than maxPathLen, are refused with
// an error saying so, at once (the work per entry grows with depth).
func TestConvertBoundsNames(t *testing.T) {
	deep := strings.Repeat("d/", 32<<10) + "f"
	for _, tc := range []struct {
		h    *tar.Header
		want string
	}{
		{&tar.Header{Name: deep, Typeflag: tar.TypeReg, Mode: 0o644}, "longer than 4096"},
		{&tar.Header{Name: strings.Repeat("d/", maxPathDepth+1) + "f", Typeflag: tar.TypeReg, Mode: 0o644}, "deeper than 256"},
		{&tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: strings.Repeat("t", maxPathLen+1)}, "symlink target of 4097 bytes"},
		{&tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: strings.Repeat("t", maxPathLen+1)}, "link target of 4097 bytes"},
	} {
		if _, err := convert(t, DefaultLimits, rawLayer(t, tc.h)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%.40q: %v; want an error saying %q", tc.h.Name, err, tc.want)
		}
	}
	ok := strings.Repeat("d/", maxPathDepth-1) + "f"
	if _, err := convert(t, DefaultLimits, rawLayer(t, &tar.Header{Name: ok, Typeflag: tar.TypeReg, Mode: 0o644})); err != nil {
		t.Errorf("a path %d deep: %v", maxPathDepth, err)
	}
}
