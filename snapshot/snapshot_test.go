package snapshot

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/vmm"
)

const memBytes = 16 << 20

func testState() *vmm.State {
	return &vmm.State{Version: vmm.StateVersion, CPUs: 1, MemoryBytes: memBytes,
		IRQChips: []kvm.IRQChip{{ChipID: 0}, {ChipID: 1}, {ChipID: 2}},
		VCPUs:    []vmm.VCPUState{{CPUID: []kvm.CPUIDEntry{{Function: 0x8000_0002, EAX: 0x74736554}}}}}
}

// writeTest writes a snapshot of 16 MiB with a few pages in use.
func writeTest(t *testing.T) string {
	t.Helper()
	mem, err := guestmem.New(memBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	for _, gpa := range []uint64{0x1000, 0x200000, memBytes - 4096} {
		mem.WriteAt([]byte("in use"), gpa)
	}
	dir := filepath.Join(t.TempDir(), "snap")
	m := Manifest{Spec: json.RawMessage(`{"cpus":1}`), CPUs: 1, MemoryBytes: memBytes, MainProcess: 1}
	if err := Write(dir, m, testState(), mem, nil); err != nil {
		t.Fatalf("Write() = %v", err)
	}
	return dir
}

func TestWriteOpenVerify(t *testing.T) {
	dir := writeTest(t)
	s, err := Open(dir)
	if err != nil {
		t.Fatalf("Open() = %v", err)
	}
	if s.Manifest.Format != Format || s.Manifest.MainProcess != 1 || s.State.CPUs != 1 || len(s.State.IRQChips) != 3 {
		t.Errorf("Open() = %+v, state %+v", s.Manifest, s.State)
	}
	if err := Verify(dir); err != nil {
		t.Errorf("Verify() = %v", err)
	}
	mem, err := s.MapMemory()
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	if b, _ := mem.Slice(0x200000, 6); string(b) != "in use" {
		t.Errorf("mapped memory at 0x200000 = %q", b)
	}
	if err := Write(dir, s.Manifest, s.State, mem, nil); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Errorf("Write() over a snapshot = %v, want an error that it exists", err)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), ".snap.tmp-*")); len(left) != 0 {
		t.Errorf("temporary directories left: %v", left)
	}
}

// TestBadSnapshots: every kind of damage is refused with an error that
// names it, by Open or, for the memory's contents, by Verify.
func TestBadSnapshots(t *testing.T) {
	editJSON := func(name string, fn func(map[string]any)) func(dir string) {
		return func(dir string) {
			p := filepath.Join(dir, name)
			b, _ := os.ReadFile(p)
			var v map[string]any
			json.Unmarshal(b, &v)
			fn(v)
			b, _ = json.Marshal(v)
			os.WriteFile(p, b, 0o600)
			if name == ManifestFile { // its checksum follows: the parser is what is tested
				sum := sha256.Sum256(b)
				os.WriteFile(filepath.Join(dir, ManifestSumFile), []byte(hex.EncodeToString(sum[:])), 0o600)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		damage func(dir string)
		want   string
		verify bool // found by Verify, not Open
	}{
		{"truncated memory", func(d string) { os.Truncate(filepath.Join(d, MemoryFile), memBytes/2) }, "truncated", false},
		{"missing memory", func(d string) { os.Remove(filepath.Join(d, MemoryFile)) }, "no such file", false},
		{"missing manifest", func(d string) { os.Remove(filepath.Join(d, ManifestFile)) }, "no such file", false},
		{"missing manifest checksum", func(d string) { os.Remove(filepath.Join(d, ManifestSumFile)) }, "no such file", false},
		{"edited manifest", func(d string) {
			p := filepath.Join(d, ManifestFile)
			b, _ := os.ReadFile(p)
			os.WriteFile(p, bytes.Replace(b, []byte(`"cpus": 1`), []byte(`"cpus": 2`), 1), 0o600)
		}, "does not match manifest.sha256", false},
		{"symlinked memory", func(d string) {
			p := filepath.Join(d, MemoryFile)
			os.Rename(p, p+"-real")
			os.Symlink(p+"-real", p)
		}, "memory is a symbolic link", false},
		{"FIFO for memory", func(d string) {
			p := filepath.Join(d, MemoryFile)
			os.Remove(p)
			syscall.Mkfifo(p, 0o600)
		}, "memory is not a regular file", false},
		{"memory writable by others", func(d string) { os.Chmod(filepath.Join(d, MemoryFile), 0o666) }, "memory is writable by others", false},
		{"directory writable by others", func(d string) { os.Chmod(d, 0o777) }, "writable by others", false},
		{"symlinked directory", func(d string) {
			os.Rename(d, d+"-real")
			os.Symlink(d+"-real", d)
		}, "is a symbolic link, or not a directory", false},
		{"corrupted state", func(d string) {
			p := filepath.Join(d, StateFile)
			b, _ := os.ReadFile(p)
			b[len(b)/2] ^= 1
			os.WriteFile(p, b, 0o600)
		}, "checksum", false},
		{"other version", editJSON(ManifestFile, func(m map[string]any) { m["version"] = 99 }), "snapshot version 99", false},
		{"not a snapshot", editJSON(ManifestFile, func(m map[string]any) { m["format"] = "tar" }), "not a capsa snapshot", false},
		{"unknown field", editJSON(ManifestFile, func(m map[string]any) { m["surprise"] = 1 }), "unknown field", false},
		{"escaping file name", editJSON(ManifestFile, func(m map[string]any) {
			m["files"].(map[string]any)["../x"] = map[string]any{"size": 1, "sha256": ""}
		}), `file "../x"`, false},
		{"memory size", editJSON(ManifestFile, func(m map[string]any) { m["memory_bytes"] = 2 * memBytes }), "memory file of", false},
		{"corrupted memory", func(d string) {
			f, _ := os.OpenFile(filepath.Join(d, MemoryFile), os.O_WRONLY, 0)
			f.WriteAt([]byte("X"), 0x200001)
			f.Close()
		}, "memory does not match its checksum", true},
	} {
		dir := writeTest(t)
		tc.damage(dir)
		s, err := Open(dir)
		if err == nil {
			s.Close()
		}
		if tc.verify {
			if err != nil {
				t.Errorf("%s: Open() = %v, want it to pass (only Verify reads the memory)", tc.name, err)
			}
			err = Verify(dir)
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
	}
}

// TestOpenReadsWhatItChecked: a file replaced after Open is not what a
// restore reads: it goes on with the file Open checked.
func TestOpenReadsWhatItChecked(t *testing.T) {
	dir := writeTest(t)
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p := filepath.Join(dir, MemoryFile)
	os.Rename(p, p+"-old")
	if err := os.WriteFile(p, bytes.Repeat([]byte("X"), memBytes), 0o600); err != nil {
		t.Fatal(err)
	}
	mem, err := s.MapMemory()
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	if b, _ := mem.Slice(0x200000, 6); string(b) != "in use" {
		t.Errorf("the memory mapped after its file was replaced: %q, want the snapshot's", b)
	}
}

// FuzzParse feeds arbitrary manifests and states to the decoders and the
// restore's checks: errors, never a panic.
func FuzzParse(f *testing.F) {
	dir := writeTestF(f)
	for _, name := range []string{ManifestFile, StateFile} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte(`{"format":"capsa-snapshot","version":3,"cpus":1,"memory_bytes":16777216,"spec":{},"files":{"state.json":{"size":1},"memory":{"size":16777216}},` +
		`"parent":{"name":"base","manifest_sha256":"` + strings.Repeat("ab", 32) + `"},"memory_runs":[{"off":4096,"len":4096},{"off":3489660928,"len":4096}]}`))
	f.Add([]byte(`{"version":1,"cpus":1,"memory_bytes":4096,"irqchips":[{}],"vcpus":[{"cpuid":[{}],"xcrs":{"NrXCRs":99}}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Manifest
		ParseManifest(b, &m)
		st, err := ParseState(b)
		if err != nil {
			return
		}
		cfg := vmm.Config{CPUs: st.CPUs, MemoryBytes: st.MemoryBytes}
		st.Check(cfg)
		st.CPUModel()
	})
}

func writeTestF(f *testing.F) string {
	mem, err := guestmem.New(memBytes)
	if err != nil {
		f.Fatal(err)
	}
	defer mem.Close()
	dir := filepath.Join(f.TempDir(), "snap")
	if err := Write(dir, Manifest{Spec: json.RawMessage(`{}`), CPUs: 1, MemoryBytes: memBytes}, testState(), mem, nil); err != nil {
		f.Fatal(err)
	}
	return dir
}

// TestCloneFile: a clone has the source's bytes, and where the host cannot
// reflink, its holes stay holes.
func TestCloneFile(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	f.Truncate(size)
	f.WriteAt([]byte("head"), 0)
	f.WriteAt([]byte("middle"), 32<<20)
	f.WriteAt([]byte("tail"), size-4)
	f.Close()
	dst := filepath.Join(dir, "dst")
	if err := CloneFile(src, dst); err != nil {
		t.Fatalf("CloneFile() = %v", err)
	}
	a, _ := os.ReadFile(src)
	b, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(a, b) {
		t.Fatalf("the clone differs from its source (%v)", err)
	}
	var st syscall.Stat_t
	syscall.Stat(dst, &st)
	if used := st.Blocks * 512; used > 4<<20 {
		t.Errorf("the clone of a 64 MiB file with 3 written pages takes %d bytes on disk, want it sparse", used)
	}
	if err := CloneFile(src, dst); err == nil {
		t.Error("CloneFile() over an existing file = nil error")
	}

	// Zeros written out (as a new file system's inode tables are)
	// become holes, where the host cannot reflink; the bytes stay.
	zsrc := filepath.Join(dir, "zeros")
	z := make([]byte, 8<<20)
	z[3<<20] = 1
	if err := os.WriteFile(zsrc, z, 0o600); err != nil {
		t.Fatal(err)
	}
	zdst := filepath.Join(dir, "zeros-clone")
	if err := CloneFile(zsrc, zdst); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(zdst); err != nil || !bytes.Equal(got, z) {
		t.Fatalf("the clone of a file of zeros differs (%v)", err)
	}
	var zst syscall.Stat_t
	syscall.Stat(zdst, &zst)
	if used := zst.Blocks * 512; used > 2<<20 && !reflinked(t, zsrc, zdst) {
		t.Errorf("the clone of 8 MiB of zeros with one byte set takes %d bytes on disk; want one chunk", used)
	}
}

// reflinked reports whether the host's file system shares a and b's
// blocks (a reflink: then b is as sparse as a, no more).
func reflinked(t *testing.T, a, _ string) bool {
	t.Helper()
	fa, err := os.Open(a)
	if err != nil {
		return false
	}
	defer fa.Close()
	probe := filepath.Join(t.TempDir(), "probe")
	fp, err := os.Create(probe)
	if err != nil {
		return false
	}
	defer fp.Close()
	return unix.IoctlFileClone(int(fp.Fd()), int(fa.Fd())) == nil
}

// TestDiskOnly: a snapshot of the disk alone holds its manifest and files
// but no state or memory; it opens and verifies, refuses to be mapped,
// squashed or layered over, and a manifest that says disk-only beside a
// memory, or with no root disk, is refused.
func TestDiskOnly(t *testing.T) {
	base := t.TempDir()
	disk := filepath.Join(base, "upper")
	if err := os.WriteFile(disk, []byte("the guest's writes"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "disk")
	m := Manifest{Spec: json.RawMessage(`{"cpus":1}`), CPUs: 1, MemoryBytes: memBytes, ImageDigest: "sha256:abc"}
	clone := map[string]Extra{RootDiskFile: func(p string) (string, error) { return "", CloneFile(disk, p) }}
	if err := WriteDisk(dir, Manifest{Spec: m.Spec, CPUs: 1, MemoryBytes: memBytes}, clone); err == nil {
		t.Error("WriteDisk without an image digest was taken")
	}
	if err := WriteDisk(dir, m, clone); err != nil {
		t.Fatalf("WriteDisk() = %v", err)
	}
	for _, name := range []string{StateFile, MemoryFile} {
		if _, err := os.Stat(filepath.Join(dir, name)); !os.IsNotExist(err) {
			t.Errorf("%s written: %v", name, err)
		}
	}
	s, err := Open(dir)
	if err != nil {
		t.Fatalf("Open() = %v", err)
	}
	defer s.Close()
	if !s.Manifest.DiskOnly || s.State != nil {
		t.Errorf("Open() = %+v with state %v; want disk-only, no state", s.Manifest, s.State)
	}
	if b, err := s.ReadFile(RootDiskFile, 1<<20); err != nil || string(b) != "the guest's writes" {
		t.Errorf("its root disk: %q, %v", b, err)
	}
	if err := Verify(dir); err != nil {
		t.Errorf("Verify() = %v", err)
	}
	if _, err := s.MapMemory(); !errors.Is(err, ErrDiskOnly) {
		t.Errorf("MapMemory() = %v; want ErrDiskOnly", err)
	}
	if err := Squash(s, filepath.Join(base, "squashed")); !errors.Is(err, ErrDiskOnly) {
		t.Errorf("Squash() = %v; want ErrDiskOnly", err)
	}
	mem, _ := guestmem.New(memBytes)
	defer mem.Close()
	if err := WriteWith(filepath.Join(base, "layer"), Manifest{Spec: m.Spec, CPUs: 1, MemoryBytes: memBytes}, testState(), mem, nil, WriteOptions{Parent: s}); !errors.Is(err, ErrDiskOnly) {
		t.Errorf("a layer over it = %v; want ErrDiskOnly", err)
	}
	// A manifest edited to say disk-only beside a memory, or without
	// its root disk, is refused.
	full := writeTest(t)
	for name, edit := range map[string]func(*Manifest){
		"a memory":  func(m *Manifest) { m.DiskOnly = true },
		"no disk":   func(m *Manifest) { m.ImageDigest = ""; delete(m.Files, RootDiskFile) },
		"a process": func(m *Manifest) { m.MainProcess = 3 },
	} {
		src := dir
		if name == "a memory" {
			src = full
		}
		b, err := os.ReadFile(filepath.Join(src, ManifestFile))
		if err != nil {
			t.Fatal(err)
		}
		var mm Manifest
		if err := json.Unmarshal(b, &mm); err != nil {
			t.Fatal(err)
		}
		edit(&mm)
		b, _ = json.Marshal(mm)
		if err := ParseManifest(b, &mm); err == nil {
			t.Errorf("a disk-only manifest with %s was taken", name)
		}
	}
}
