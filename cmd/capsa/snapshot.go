package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
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
		"diff": snapshotDiff, "squash": snapshotSquash,
	}, args, stdout, stderr)
}

// snapshotCreate: capsa snapshot create NAME [SNAP].
func snapshotCreate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot create", "[flags] NAME [SNAP]  (SNAP: NAME-YYYYMMDD-HHMMSS)", stdout)
	parent := fs.String("parent", "", "write SNAP as a layer over this earlier snapshot: only the memory that differs from it is written, and it must be kept while SNAP is")
	progressMode := progressFlag(fs)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	prog, err := newProgress(*progressMode, stderr, "snapshot create")
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot create: %v\n", err)
		return 2
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
	if err := supervisor.CheckSnapshotName(snap); err != nil {
		fmt.Fprintf(stderr, "capsa snapshot create: %v\n", err)
		return 2
	}
	if *parent != "" {
		if err := supervisor.CheckSnapshotName(*parent); err != nil {
			fmt.Fprintf(stderr, "capsa snapshot create: --parent: %v\n", err)
			return 2
		}
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot create: %v\n", err)
		return 1
	}
	_, err = m.SaveSnapshot(ctx, name, snap, *parent, prog.report())
	prog.done()
	if errors.Is(err, supervisor.ErrSnapshotExists) {
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
// snapshot in dir and starts its supervisor; it prints the name. A
// snapshot that cannot be read is exit 1, a failed start 125.
func restoreDetached(ctx context.Context, cmdName string, m *supervisor.Manager, dir, name, hostname string, rm bool, settings *sandbox.Spec, secrets map[string]string, stdout, stderr io.Writer) int {
	name, err := m.RestoreDir(ctx, dir, name, hostname, rm, settings, secrets)
	if errors.Is(err, supervisor.ErrBadSnapshot) {
		fmt.Fprintf(stderr, "capsa %s: %v\n", cmdName, err)
		return 1
	}
	return launched(cmdName, name, err, stdout, stderr)
}

// snapshotRestore: capsa snapshot restore SNAP [--name NEW].
func snapshotRestore(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot restore", "[flags] SNAP", stdout)
	name := fs.String("name", "", "the restored sandbox's name (default: a new one)")
	rm := fs.Bool("rm", false, "remove the sandbox's record when it ends")
	// What the sandbox may reach: from these flags, never from the
	// snapshot (sandbox.RestoredSpec).
	host := addHostFlags(fs)
	fs.MarkHidden("net-log")
	fs.MarkHidden("share-fs")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "capsa snapshot restore: want SNAP")
		return 2
	}
	if fs.Changed("share-fs") {
		// A snapshot holds 9P shares (one with virtio-fs shares is
		// refused), whose devices the restore gives back as they were.
		fmt.Fprintln(stderr, "capsa snapshot restore: --share-fs: a restored sandbox's shares are 9P, as its snapshot's devices")
		return 2
	}
	b := sandbox.New()
	if err := host.apply(fs, b, true); err != nil {
		fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
		return 2
	}
	settings, secrets, err := b.Settings()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
		return 2
	}
	if *name != "" {
		if err := supervisor.CheckName(*name); err != nil {
			fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
			return 2
		}
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
		return 1
	}
	// A name in the state directory, or a path to a snapshot directory
	// (anything with a slash).
	dir, err := m.SnapshotDir(fs.Arg(0), true)
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot restore: %v\n", err)
		return 2
	}
	return restoreDetached(ctx, "snapshot restore", m, dir, *name, "", *rm, settings, secrets, stdout, stderr)
}

func snapshotList(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot ls", "[flags]", stdout)
	format := fs.String("format", "table", "table or json")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot ls: %v\n", err)
		return 1
	}
	rows, err := m.Snapshots()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot ls: %v\n", err)
		return 1
	}
	if *format == "json" {
		writeJSON(stdout, rows)
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCREATED\tCPUS\tMEMORY\tON DISK\tPARENT\tCOMMAND")
	for _, r := range rows {
		if r.Err != "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t%s\t-\t(unreadable: %s)\n", r.Name, humanBytes(uint64(r.DiskBytes)), r.Err)
			continue
		}
		parent := "-"
		if r.Parent != "" {
			parent = r.Parent
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\n", r.Name, r.Created.Local().Format(time.DateTime), r.CPUs,
			humanBytes(r.MemoryBytes), humanBytes(uint64(r.DiskBytes)), parent, r.Command)
	}
	tw.Flush()
	return 0
}

// snapshotDiff: capsa snapshot diff FROM TO, or FROM --sandbox NAME.
func snapshotDiff(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot diff", "[flags] FROM TO | FROM --sandbox NAME  (what changed from snapshot FROM)", stdout)
	live := fs.String("sandbox", "", "compare FROM with the running sandbox NAME now, not with a snapshot")
	format := fs.String("format", "text", "text or json")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	want := 2 // FROM TO
	if *live != "" {
		want = 1 // FROM, and the sandbox
	}
	if fs.NArg() != want || (*format != "text" && *format != "json") {
		fmt.Fprintln(stderr, "capsa snapshot diff: want FROM TO, or FROM --sandbox NAME; --format text or json")
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot diff: %v\n", err)
		return 1
	}
	var d *sandbox.Diff
	if *live != "" {
		d, err = m.DiffSince(ctx, fs.Arg(0), *live)
	} else {
		d, err = m.Diff(fs.Arg(0), fs.Arg(1))
	}
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot diff: %v\n", err)
		return 1
	}
	if *format == "json" {
		writeJSON(stdout, d)
		return 0
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	for _, f := range d.Files {
		size := humanBytes(uint64(f.Size))
		switch {
		case f.Type == "dir":
			size = ""
		case f.Change == sandbox.Changed && f.OldSize != f.Size:
			size = humanBytes(uint64(f.OldSize)) + " -> " + size
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.Change, f.Type, f.Path, size)
	}
	tw.Flush()
	// The processes in columns of their own: a command line is long.
	for _, p := range d.Processes {
		fmt.Fprintf(tw, "%s\tprocess %d\t%s\t%s\n", p.Change, p.ID, processState(p.Exit), strings.Join(p.Argv, " "))
	}
	tw.Flush()
	return 0
}

func snapshotRemove(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot rm", "SNAP...", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	return eachName(ctx, "snapshot rm", fs.Args(), stderr, func(m *supervisor.Manager, name string) error {
		if err := m.RemoveSnapshot(name); err != nil {
			return err
		}
		fmt.Fprintln(stdout, name)
		return nil
	})
}

// snapshotSquash: capsa snapshot squash SNAP [NEW].
func snapshotSquash(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("snapshot squash", "SNAP [NEW]  (a layer made whole: as NEW, or in SNAP's place)", stdout)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() < 1 || fs.NArg() > 2 {
		fmt.Fprintln(stderr, "capsa snapshot squash: want SNAP [NEW]")
		return 2
	}
	for _, n := range fs.Args() {
		if err := supervisor.CheckSnapshotName(n); err != nil {
			fmt.Fprintf(stderr, "capsa snapshot squash: %v\n", err)
			return 2
		}
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot squash: %v\n", err)
		return 1
	}
	out, err := m.SquashSnapshot(fs.Arg(0), fs.Arg(1))
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot squash: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, out)
	return 0
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
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa snapshot inspect: %v\n", err)
		return 1
	}
	code := 0
	var out []supervisor.SnapshotManifest
	for _, name := range fs.Args() {
		dir, err := m.SnapshotDir(name, true)
		var mf *supervisor.SnapshotManifest
		if err == nil {
			mf, err = m.InspectSnapshot(dir, *verify)
		}
		if err != nil {
			fmt.Fprintf(stderr, "capsa snapshot inspect: %v\n", err)
			code = 1
			continue
		}
		out = append(out, *mf)
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
	progressMode := progressFlag(fs)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 1 || *count < 1 || *count > supervisor.MaxFork {
		fmt.Fprintf(stderr, "capsa fork: want NAME and a --count from 1 to %d\n", supervisor.MaxFork)
		return 2
	}
	prog, err := newProgress(*progressMode, stderr, "fork")
	if err != nil {
		fmt.Fprintf(stderr, "capsa fork: %v\n", err)
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa fork: %v\n", err)
		return 1
	}
	names, errs, err := m.Fork(ctx, fs.Arg(0), *count, prog.report())
	prog.done()
	if err != nil {
		fmt.Fprintf(stderr, "capsa fork: %v\n", err)
		return 1
	}
	if st, err := m.Stats(ctx, fs.Arg(0)); err == nil && st.LastPause > 0 {
		fmt.Fprintf(stderr, "capsa fork: %s was paused for %v\n", fs.Arg(0), st.LastPause.Round(time.Microsecond))
	}
	code := 0
	for i, n := range names {
		code = max(code, launched("fork", n, errs[i], stdout, stderr))
	}
	return code
}
