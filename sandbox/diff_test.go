package sandbox

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/internal/strictjson"
	"github.com/capsa-sandbox/capsa/kvm"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/vmm"
)

func file(path string, size, mtime int64) agent.TreeEntry {
	return agent.TreeEntry{Path: path, Mode: 0o644, Size: size, MtimeNs: mtime, CtimeNs: mtime, Ino: uint64(len(path))}
}

// TestDiffInventories: files added, removed and changed (content, a
// link's target, permissions), a directory whose entries changed not
// listed itself; processes started, ended, and gone from the table.
func TestDiffInventories(t *testing.T) {
	dir := agent.TreeEntry{Path: "w", Mode: uint32(fs.ModeDir | 0o755), MtimeNs: 1}
	link := agent.TreeEntry{Path: "w/l", Mode: uint32(fs.ModeSymlink | 0o777), Target: "a"}
	a := &Inventory{Taken: time.Unix(1, 0),
		Files:     []agent.TreeEntry{dir, file("w/a", 5, 1), file("w/b", 3, 1), file("w/c", 1, 1), link, file("w/same", 1, 1)},
		Processes: []agent.ProcessInfo{{ID: 1, PID: 10, Argv: []string{"main"}}, {ID: 2, PID: 20, Argv: []string{"job"}}, {ID: 3, PID: 30, Argv: []string{"gone"}}}}
	dir2, link2, c2 := dir, link, file("w/c", 1, 1)
	dir2.MtimeNs, link2.Target, c2.Mode = 2, "b", 0o600
	code := 0
	b := &Inventory{Taken: time.Unix(2, 0),
		Files:     []agent.TreeEntry{dir2, file("w/a", 12, 2), c2, link2, file("w/new", 7, 2), file("w/same", 1, 1)},
		Processes: []agent.ProcessInfo{{ID: 1, PID: 10, Argv: []string{"main"}}, {ID: 2, PID: 20, Argv: []string{"job"}, Exit: &agent.ExitStatus{Code: code}}, {ID: 4, PID: 40, Argv: []string{"new"}}}}
	d := DiffInventories(a, b)
	var got []string
	for _, f := range d.Files {
		got = append(got, f.Change+" "+f.Type+" "+f.Path)
	}
	want := "changed file /w/a,removed file /w/b,changed file /w/c,changed symlink /w/l,added file /w/new"
	if strings.Join(got, ",") != want {
		t.Errorf("files = %v; want %s", got, want)
	}
	if d.Files[0].Size != 12 || d.Files[0].OldSize != 5 || d.Files[1].Size != 3 {
		t.Errorf("sizes = %+v; want 5 -> 12 and the removed file's 3", d.Files)
	}
	got = nil
	for _, p := range d.Processes {
		got = append(got, p.Change+" "+strings.Join(p.Argv, " "))
	}
	if want := "ended job,ended gone,started new"; strings.Join(got, ",") != want {
		t.Errorf("processes = %v; want %s", got, want)
	}
	if d := DiffInventories(a, a); len(d.Files) != 0 || len(d.Processes) != 0 {
		t.Errorf("an inventory against itself: %+v; want no change", d)
	}
}

// writeSnapshotWith writes a small snapshot whose inventory file holds b
// (its checksum in the manifest unless badSum).
func writeSnapshotWith(t *testing.T, b []byte, badSum bool) string {
	t.Helper()
	const mem = 16 << 20
	m, err := guestmem.New(mem)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	st := &vmm.State{Version: vmm.StateVersion, CPUs: 1, MemoryBytes: mem,
		IRQChips: []kvm.IRQChip{{ChipID: 0}, {ChipID: 1}, {ChipID: 2}}, VCPUs: []vmm.VCPUState{{}}}
	dir := filepath.Join(t.TempDir(), "snap")
	extra := map[string]snapshot.Extra{}
	if b != nil {
		extra[InventoryFile] = func(path string) (string, error) {
			sum := sha256.Sum256(b)
			if badSum {
				sum[0]++
			}
			return hex.EncodeToString(sum[:]), os.WriteFile(path, b, 0o600)
		}
	}
	if err := snapshot.Write(dir, snapshot.Manifest{Spec: json.RawMessage(`{}`), CPUs: 1, MemoryBytes: mem}, st, m, extra); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestReadInventory: an inventory comes back as written, and one a
// hostile snapshot holds is refused, naming why.
func TestReadInventory(t *testing.T) {
	inv := &Inventory{Taken: time.Unix(5, 0).UTC(), Files: []agent.TreeEntry{file("a", 1, 1), file("b", 2, 2)},
		Processes: []agent.ProcessInfo{{ID: 1, PID: 2, Argv: []string{"x"}}}}
	b, _ := json.Marshal(inv)
	got, err := ReadInventory(writeSnapshotWith(t, b, false))
	if err != nil || len(got.Files) != 2 || got.Files[1].Size != 2 || len(got.Processes) != 1 || !got.Taken.Equal(inv.Taken) {
		t.Fatalf("ReadInventory = %+v, %v; want what was written", got, err)
	}
	if _, err := ReadInventory(writeSnapshotWith(t, nil, false)); !errors.Is(err, ErrNoInventory) {
		t.Errorf("a snapshot without one: %v; want ErrNoInventory", err)
	}
	none, _ := json.Marshal(&Inventory{Files: []agent.TreeEntry{}, Processes: []agent.ProcessInfo{}, Unavailable: "the sandbox was paused"})
	if _, err := ReadInventory(writeSnapshotWith(t, none, false)); !errors.Is(err, ErrNoInventory) || !strings.Contains(err.Error(), "paused") {
		t.Errorf("a snapshot whose guest gave none: %v; want ErrNoInventory saying why", err)
	}
	for _, tc := range []struct{ name, body, want string }{
		{"escaping path", `{"taken":"2020-01-01T00:00:00Z","files":[{"p":"../etc/passwd","m":0,"s":0,"t":0,"c":0,"i":0,"u":0,"g":0}],"processes":[]}`, "bad entry"},
		{"absolute path", `{"taken":"2020-01-01T00:00:00Z","files":[{"p":"/etc","m":0,"s":0,"t":0,"c":0,"i":0,"u":0,"g":0}],"processes":[]}`, "bad entry"},
		{"repeated", `{"taken":"2020-01-01T00:00:00Z","files":[{"p":"a","m":0,"s":0,"t":0,"c":0,"i":0,"u":0,"g":0},{"p":"a","m":0,"s":0,"t":0,"c":0,"i":0,"u":0,"g":0}],"processes":[]}`, "out of order or repeated"},
		{"unknown field", `{"taken":"2020-01-01T00:00:00Z","files":[],"processes":[],"spec":{}}`, "unknown field"},
		{"two values", `{"files":[]} {}`, "after"},
		{"too many processes", `{"files":[],"processes":[` + strings.Repeat(`{"id":1,"pid":1,"argv":[],"started_ns":0},`, maxInventoryProcesses) + `{"id":1,"pid":1,"argv":[],"started_ns":0}]}`, "at most"},
	} {
		if _, err := ReadInventory(writeSnapshotWith(t, []byte(tc.body), false)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want an error naming %q", tc.name, err, tc.want)
		}
	}
	if _, err := ReadInventory(writeSnapshotWith(t, b, true)); err == nil || !strings.Contains(err.Error(), "checksum") {
		t.Errorf("a changed inventory: %v; want its checksum refused", err)
	}
}

// FuzzInventory: whatever a snapshot holds as its inventory, checking it
// never panics, and one it takes diffs against itself to nothing.
func FuzzInventory(f *testing.F) {
	b, _ := json.Marshal(&Inventory{Files: []agent.TreeEntry{file("a", 1, 1), file("a/b", 2, 2)},
		Processes: []agent.ProcessInfo{{ID: 1, PID: 2, Argv: []string{"x"}}}})
	f.Add(b)
	f.Add([]byte(`{"files":[{"p":"../x","m":0,"s":0,"t":0,"c":0,"i":0,"u":0,"g":0}],"processes":[]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var inv Inventory
		if strictjson.Decode(b, &inv) != nil || inv.check() != nil {
			return
		}
		if d := DiffInventories(&inv, &inv); len(d.Files) != 0 || len(d.Processes) != 0 {
			t.Fatalf("an inventory against itself: %+v", d)
		}
	})
}
