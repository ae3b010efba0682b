package e2e

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestSnapshotDiff: two checkpoints of a detached sandbox, between them a
// package manager's kind of churn (a file created, one rewritten, one
// removed, one renamed into another directory, one removed from /tmp), a
// process that ends and one that starts; capsa snapshot diff lists
// exactly those, as JSON and as text, and the running sandbox against the
// later checkpoint lists only what happened since.
func TestSnapshotDiff(t *testing.T) {
	dir, cli := detachedState(t)
	if r := cli(3*time.Minute, "run", "-d", "--name", "d", "--", "sleep", "100000"); r.code != 0 {
		t.Fatalf("capsa run -d = exit %d, stderr %q", r.code, r.stderr)
	}
	ctx, h := openByName(t, dir, "d")
	sh := func(script string) {
		t.Helper()
		if r := cli(time.Minute, "exec", "d", "--", "sh", "-c", script); r.code != 0 {
			t.Fatalf("%s: exit %d, stderr %q", script, r.code, r.stderr)
		}
	}
	sh("mkdir -p /work/sub && echo keep > /work/keep && echo old > /work/mod && echo bye > /work/del && echo r > /work/sub/ren && echo t > /tmp/tfile")
	waiter, err := h.Stream(ctx, sandbox.ExecOptions{Shell: "while [ ! -e /work/stop ]; do sleep 0.1; done"})
	if err != nil {
		t.Fatal(err)
	}
	if r := cli(3*time.Minute, "snapshot", "create", "d", "a"); r.code != 0 {
		t.Fatalf("capsa snapshot create d a = exit %d, stderr %q", r.code, r.stderr)
	}

	sh("echo new > /work/new && echo newer-content > /work/mod && rm /work/del /tmp/tfile && mv /work/sub/ren /work/renamed && touch /work/stop")
	if _, err := h.WaitProcess(ctx, waiter.ID); err != nil {
		t.Fatal(err)
	}
	sleeper, err := h.Stream(ctx, sandbox.ExecOptions{Argv: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := cli(3*time.Minute, "snapshot", "create", "d", "b"); r.code != 0 {
		t.Fatalf("capsa snapshot create d b = exit %d, stderr %q", r.code, r.stderr)
	}

	r := cli(time.Minute, "snapshot", "diff", "a", "b", "--format", "json")
	var d sandbox.Diff
	if err := json.Unmarshal([]byte(r.stdout), &d); r.code != 0 || err != nil {
		t.Fatalf("capsa snapshot diff a b --format json = exit %d, %q (%v), stderr %q", r.code, r.stdout, err, r.stderr)
	}
	var files []string
	for _, f := range d.Files {
		files = append(files, fmt.Sprintf("%s %s %s %d", f.Change, f.Type, f.Path, f.Size))
	}
	want := []string{"removed file /tmp/tfile 2", "removed file /work/del 4", "changed file /work/mod 14", "added file /work/new 4",
		"added file /work/renamed 2", "added file /work/stop 0", "removed file /work/sub/ren 2"}
	if !slices.Equal(files, want) {
		t.Errorf("the files that changed from a to b:\n%s\nwant exactly\n%s", strings.Join(files, "\n"), strings.Join(want, "\n"))
	}
	var procs []string
	for _, p := range d.Processes {
		exit := "running"
		if p.Exit != nil {
			exit = fmt.Sprintf("exit %d", p.Exit.Code)
		}
		procs = append(procs, fmt.Sprintf("%s %d %s", p.Change, p.ID, exit))
	}
	// The churn's own shell started and ended between the two.
	want = []string{fmt.Sprintf("ended %d exit 0", waiter.ID), fmt.Sprintf("started %d exit 0", waiter.ID+1), fmt.Sprintf("started %d running", sleeper.ID)}
	if !slices.Equal(procs, want) {
		t.Errorf("the processes that changed from a to b: %v; want exactly %v", procs, want)
	}

	r = cli(time.Minute, "snapshot", "diff", "a", "b")
	if r.code != 0 || !strings.Contains(r.stdout, "/work/renamed") || !strings.Contains(r.stdout, "4B -> 14B") || !strings.Contains(r.stdout, "sleep 1000") {
		t.Errorf("capsa snapshot diff a b = exit %d, %q; want the changes as text", r.code, r.stdout)
	}
	t.Logf("capsa snapshot diff a b:\n%s", r.stdout)

	// The running sandbox since b: only what happened since.
	sh("echo live > /work/live")
	r = cli(time.Minute, "snapshot", "diff", "b", "--sandbox", "d", "--format", "json")
	d = sandbox.Diff{}
	if err := json.Unmarshal([]byte(r.stdout), &d); r.code != 0 || err != nil {
		t.Fatalf("capsa snapshot diff b --sandbox d = exit %d, %q (%v), stderr %q", r.code, r.stdout, err, r.stderr)
	}
	if len(d.Files) != 1 || d.Files[0].Path != "/work/live" || d.Files[0].Change != sandbox.Added || len(d.Processes) != 1 || d.Processes[0].Change != sandbox.Started {
		t.Errorf("the running sandbox since b: %+v; want /work/live added and its shell started", d)
	}

	// A paused sandbox's agent cannot answer: its snapshot is taken as
	// before, without an inventory, and a diff says why.
	if r := cli(time.Minute, "pause", "d"); r.code != 0 {
		t.Fatalf("capsa pause d = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "snapshot", "create", "d", "p"); r.code != 0 {
		t.Errorf("capsa snapshot create of a paused sandbox = exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "snapshot", "diff", "a", "p"); r.code != 1 || !strings.Contains(r.stderr, "no inventory") || !strings.Contains(r.stderr, "paused") {
		t.Errorf("capsa snapshot diff a p (p of a paused sandbox) = exit %d, stderr %q; want no inventory, because paused", r.code, r.stderr)
	}

	for _, bad := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"snapshot", "diff", "a"}, 2, "want FROM TO"},
		{[]string{"snapshot", "diff", "a", "nosuch"}, 1, "nosuch"},
		{[]string{"snapshot", "diff", "a", "b", "--format", "yaml"}, 2, "--format"},
	} {
		if r := cli(time.Minute, bad.args...); r.code != bad.code || !strings.Contains(r.stderr, bad.want) {
			t.Errorf("capsa %s = exit %d, stderr %q; want exit %d naming %q", strings.Join(bad.args, " "), r.code, r.stderr, bad.code, bad.want)
		}
	}
}
