package agent

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestReadFiles: several files in one request, each its contents or its
// own error (a missing file's unwraps to ENOENT; a directory, a file past
// MaxReadFileSize), in the order asked; an empty file is empty.
func TestReadFiles(t *testing.T) {
	cl := serve(t)
	ctx := context.Background()
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "a"), []byte("alpha\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "empty"), nil, 0o644)
	os.WriteFile(filepath.Join(dir, "big"), make([]byte, MaxReadFileSize+1), 0o644)
	os.WriteFile(filepath.Join(dir, "limit"), make([]byte, MaxReadFileSize), 0o644)
	paths := []string{filepath.Join(dir, "a"), filepath.Join(dir, "missing"), dir, filepath.Join(dir, "big"),
		filepath.Join(dir, "empty"), filepath.Join(dir, "limit"), "/proc/self/status"}
	got, err := cl.ReadFiles(ctx, paths)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(paths) {
		t.Fatalf("ReadFiles answered %d files for %d paths", len(got), len(paths))
	}
	if string(got[0].Data) != "alpha\n" || got[0].Err != nil {
		t.Errorf("a = %q, %v", got[0].Data, got[0].Err)
	}
	if !errors.Is(got[1].Err, fs.ErrNotExist) || got[1].Data != nil {
		t.Errorf("missing = %q, %v; want ENOENT", got[1].Data, got[1].Err)
	}
	if got[2].Err == nil || !strings.Contains(got[2].Err.Error(), "is a directory") {
		t.Errorf("a directory = %q, %v", got[2].Data, got[2].Err)
	}
	if !errors.Is(got[3].Err, syscall.EFBIG) {
		t.Errorf("a file of %d bytes = %d bytes, %v; want refused", MaxReadFileSize+1, len(got[3].Data), got[3].Err)
	}
	if len(got[4].Data) != 0 || got[4].Err != nil {
		t.Errorf("empty = %q, %v", got[4].Data, got[4].Err)
	}
	if len(got[5].Data) != MaxReadFileSize || got[5].Err != nil {
		t.Errorf("a file of %d bytes = %d bytes, %v", MaxReadFileSize, len(got[5].Data), got[5].Err)
	}
	if !strings.Contains(string(got[6].Data), "Pid:") {
		t.Errorf("/proc/self/status (no size) = %q, %v", got[6].Data, got[6].Err)
	}

	// What no request may ask, refused by the client and by the agent.
	many := make([]string, MaxReadFiles+1)
	for i := range many {
		many[i] = paths[0]
	}
	for name, p := range map[string][]string{"none": nil, "too many": many, "relative": {"etc/passwd"}, "NUL": {"/etc\x00"}} {
		if _, err := cl.ReadFiles(ctx, p); err == nil {
			t.Errorf("ReadFiles(%s) succeeded", name)
		}
		if _, err := readFiles(p); err == nil {
			t.Errorf("the agent's readFiles(%s) succeeded", name)
		}
	}
}
