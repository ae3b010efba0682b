package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/store"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// runVerbs runs the verb args[0] of a command with sub-commands (capsa
// image, capsa snapshot), or says which there are.
func runVerbs(ctx context.Context, cmd string, verbs map[string]func(context.Context, []string, io.Writer, io.Writer) int, args []string, stdout, stderr io.Writer) int {
	names := make([]string, 0, len(verbs))
	for v := range verbs {
		names = append(names, v)
	}
	sort.Strings(names)
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		w := stdout
		if len(args) == 0 {
			w = stderr
		}
		fmt.Fprintf(w, "usage: capsa %s %s ... (each has --help)\n", cmd, strings.Join(names, "|"))
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	fn, ok := verbs[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "capsa %s: unknown command %q (%s)\n", cmd, args[0], strings.Join(names, ", "))
		return 2
	}
	return fn(ctx, args[1:], stdout, stderr)
}

func runSnapshot(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runVerbs(ctx, "snapshot", map[string]func(context.Context, []string, io.Writer, io.Writer) int{
		"create": snapshotCreate, "restore": snapshotRestore, "ls": snapshotList, "rm": snapshotRemove, "inspect": snapshotInspect,
	}, args, stdout, stderr)
}

// snapshotCreate: capsa snapshot create NAME [SNAP].
func snapshotCreate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot create", "NAME [SNAP]  (SNAP: NAME-YYYYMMDD-HHMMSS)", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() < 1 || fs.NArg() > 2 {
		fmt.Fprintln(stderr, "capsa snapshot create: want NAME [SNAP]")
		return 2
	}
	name := fs.Arg(0)
	snap := supervisor.DefaultSnapshotName(name, time.Now())
	if fs.NArg() == 2 {
		snap = fs.Arg(1)
	}
	if err := store.CheckSnapshotName(snap); err != nil {
		fmt.Fprintf(stderr, "capsa snapshot create: %v\n", err)
		return 2
	}
	st, err := openStateStore()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot create: %v\n", err)
		return 1
	}
	if err := supervisor.SaveSnapshot(ctx, st, name, snap); errors.Is(err, supervisor.ErrSnapshotExists) {
		fmt.Fprintf(stderr, "capsa snapshot create: a snapshot called %s exists (capsa snapshot rm %s first)\n", snap, snap)
		return 1
	} else if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot create: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, snap)
	return 0
}

// restoreDetached records a detached sandbox that starts from the
// snapshot in dir and starts its supervisor; it prints the name.
func restoreDetached(ctx context.Context, cmdName string, st *store.Store, dir, name, hostname string, rm bool, secrets map[string]string, stdout, stderr io.Writer) int {
	rec, err := supervisor.RestoreRecord(dir, name, hostname, rm)
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
		return 1
	}
	name, err = supervisor.LaunchSecrets(ctx, st, rec, secrets)
	return launched(cmdName, name, err, stdout, stderr)
}

// snapshotRestore: capsa snapshot restore SNAP [--name NEW].
func snapshotRestore(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot restore", "[flags] SNAP", stdout)
	name := fs.String("name", "", "the restored sandbox's name (default: a new one)")
	rm := fs.Bool("rm", false, "remove the sandbox's record when it ends")
	secretFlags := addRestoreSecretFlags(fs)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa snapshot restore: want SNAP")
		return 2
	}
	secrets, err := secretFlags.values()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
		return 2
	}
	if *name != "" {
		if err := store.CheckName(*name); err != nil {
			fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
			return 2
		}
	}
	st, err := openStateStore()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
		return 1
	}
	dir, err := snapshotPath(st, fs.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
		return 2
	}
	return restoreDetached(ctx, "snapshot restore", st, dir, *name, "", *rm, secrets, stdout, stderr)
}

// snapshotPath finds a snapshot: a name in the state directory, or a
// path to a snapshot directory (anything with a slash).
func snapshotPath(st *store.Store, snap string) (string, error) {
	if strings.Contains(snap, "/") {
		return filepath.Abs(snap)
	}
	if err := store.CheckSnapshotName(snap); err != nil {
		return "", err
	}
	return st.SnapshotDir(snap), nil
}

// snapshotRow is a line of capsa snapshot ls.
type snapshotRow struct {
	Name        string    `json:"name"`
	Created     time.Time `json:"created"`
	CPUs        int       `json:"cpus"`
	MemoryBytes uint64    `json:"memory_bytes"`
	DiskBytes   int64     `json:"disk_bytes"` // what its files take on disk
	Command     string    `json:"command"`
	Err         string    `json:"error,omitempty"`
}

func snapshotList(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot ls", "[flags]", stdout)
	format := fs.String("format", "table", "table or json")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	st, err := openStateStore()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot ls: %v\n", err)
		return 1
	}
	entries, err := os.ReadDir(st.SnapshotsDir())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		fmt.Fprintf(stderr, "capsa snapshot ls: %v\n", err)
		return 1
	}
	rows := []snapshotRow{}
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		dir := st.SnapshotDir(e.Name())
		row := snapshotRow{Name: e.Name(), DiskBytes: diskUsage(dir)}
		if s, err := snapshot.Open(dir); err != nil {
			row.Err = err.Error()
		} else {
			m := s.Manifest
			row.Created, row.CPUs, row.MemoryBytes = m.Created, m.CPUs, m.MemoryBytes
			var spec sandbox.Spec
			if json.Unmarshal(m.Spec, &spec) == nil {
				row.Command = supervisor.CommandLine(spec)
			}
		}
		rows = append(rows, row)
	}
	if *format == "json" {
		writeJSON(stdout, rows)
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCREATED\tCPUS\tMEMORY\tON DISK\tCOMMAND")
	for _, r := range rows {
		if r.Err != "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t%s\t(unreadable: %s)\n", r.Name, humanBytes(uint64(r.DiskBytes)), r.Err)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", r.Name, r.Created.Local().Format(time.DateTime), r.CPUs,
			humanBytes(r.MemoryBytes), humanBytes(uint64(r.DiskBytes)), r.Command)
	}
	tw.Flush()
	return 0
}

// diskUsage is what the files in dir take on disk (a sparse memory file
// only its written pages).
func diskUsage(dir string) int64 {
	var n int64
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if fi, err := e.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
	}
	return n
}

func snapshotRemove(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot rm", "SNAP...", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	return eachName(ctx, "snapshot rm", fs.Args(), stderr, func(st *store.Store, name string) error {
		if err := store.CheckSnapshotName(name); err != nil {
			return err
		}
		dir := st.SnapshotDir(name)
		if _, err := os.Stat(filepath.Join(dir, snapshot.ManifestFile)); errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("no snapshot called %s", name)
		} else if err != nil {
			return err
		}
		// Running sandboxes restored from it keep its memory mapped:
		// removing the files does not disturb them.
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
		fmt.Fprintln(stdout, name)
		return nil
	})
}

func snapshotInspect(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot inspect", "[flags] SNAP...", stdout)
	verify := fs.Bool("verify", false, "also read every file and check its checksum (the memory's too)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(stderr, "capsa snapshot inspect: want SNAP...")
		return 2
	}
	st, err := openStateStore()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot inspect: %v\n", err)
		return 1
	}
	code := 0
	var out []snapshot.Manifest
	for _, name := range fs.Args() {
		dir, err := snapshotPath(st, name)
		var s *snapshot.Snapshot
		if err == nil {
			s, err = snapshot.Open(dir)
		}
		if err == nil && *verify {
			err = snapshot.Verify(dir)
		}
		if err != nil {
			fmt.Fprintf(stderr, "capsa snapshot inspect: %v\n", err)
			code = 1
			continue
		}
		out = append(out, s.Manifest)
	}
	if len(out) > 0 {
		writeJSON(stdout, out)
	}
	return code
}

// runFork: capsa fork NAME [--count N] makes N detached copies of a
// running detached sandbox, named NAME-1, NAME-2..., each its own
// hostname; it prints their names.
func runFork(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("fork", "[flags] NAME", stdout)
	count := fs.IntP("count", "n", 1, "how many copies")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 || *count < 1 || *count > supervisor.MaxFork {
		fmt.Fprintf(stderr, "capsa fork: want NAME and a --count from 1 to %d\n", supervisor.MaxFork)
		return 2
	}
	st, err := openStateStore()
	if err != nil {
		fmt.Fprintf(stderr, "capsa fork: %v\n", err)
		return 1
	}
	names, errs, err := supervisor.Fork(ctx, st, fs.Arg(0), *count)
	if err != nil {
		fmt.Fprintf(stderr, "capsa fork: %v\n", err)
		return 1
	}
	code := 0
	for i, n := range names {
		code = max(code, launched("fork", n, errs[i], stdout, stderr))
	}
	return code
}
