package e2e

import (
	_ "embed"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// programsScript runs git, pip, npm, tar and cp -a, and SQLite in a
// directory, one result line per program.
//
//go:embed testdata/programs.sh
var programsScript []byte

// programSteps are the lines programs.sh prints, in order.
var programSteps = []string{"git", "pip", "npm", "tar-cp", "sqlite"}

// programsAll runs every step: `make test-programs`. make test runs the
// quicker ones; pip and npm take minutes in the nested host (npm's Node.js
// is read from a share, which is read again at every start).
var programsAll = flag.Bool("programs.all", false, "TestWorkspacePrograms runs pip and npm too")

// toolsImage starts the registry, pushes an image of Debian's tools root
// (scripts/test-images.sh: git, python3 with venv and a local wheelhouse,
// sqlite3) to it as tools:TAG, gives the test a cache of its own, and
// returns the image's reference.
func toolsImage(tb testing.TB, tag string) string {
	tb.Helper()
	startRegistry(tb)
	root, err := tarball.LayerFromFile(artifact(tb, "tools.tar.gz"))
	if err != nil {
		tb.Fatalf("the tools root layer: %v", err)
	}
	ref := registryAddr + "/capsa-test/tools:" + tag
	pushImage(tb, ref, v1.Config{Cmd: []string{"sh"}, Env: []string{"PATH=" + imagePath}, WorkingDir: "/"}, root)
	tb.Setenv("CAPSA_CACHE", tb.TempDir())
	return ref
}

// TestWorkspacePrograms: real programs do their everyday work in a share
// as they do on the image's own disk: a git clone, commit, branch, rebase,
// push and gc; pip installing a local package into a venv (built from a
// local wheelhouse in an isolated environment); npm installing local
// tarballs with a dependency tree, one package nested, then npm ci; tar
// and cp -a round trips of a tree with links, a FIFO, a sparse file and
// nanosecond times; SQLite in WAL mode with a reader beside the writer.
// Each program's result (fixed names and dates make it a digest of what
// the program made) must be "ok" and the same in both places. make test
// runs git, tar and cp, and SQLite; -programs.all (make test-programs)
// adds pip and npm.
func TestWorkspacePrograms(t *testing.T) {
	workspacePrograms(t, "9p")
}

// TestWorkspaceProgramsVirtioFS is TestWorkspacePrograms with the
// workspace share over virtio-fs (--share-fs virtiofs).
func TestWorkspaceProgramsVirtioFS(t *testing.T) {
	workspacePrograms(t, "virtiofs")
}

// workspacePrograms runs the programs with shares over transport shareFS.
func workspacePrograms(t *testing.T, shareFS string) {
	// The bound catches a hang: about 2 minutes usually, 6.3 on the
	// slowest host seen.
	steps, timeout := []string{"git", "tar-cp", "sqlite"}, 20*time.Minute
	if *programsAll {
		steps, timeout = programSteps, 40*time.Minute
	}
	ref := toolsImage(t, "programs")
	scripts, share := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(scripts, "programs.sh"), programsScript, 0o644); err != nil {
		t.Fatal(err)
	}
	node := artifact(t, "mcp-client")
	r := capsa(t, timeout, "run", "--image", ref, "-u", "0", "--cpus", "2", "--memory", "1G", "--share-fs", shareFS,
		"-v", share+":/w", "-v", scripts+":/t:ro", "-v", node+":/opt/node:ro", "-e", "NODE_DIR=/opt/node", "-e", "STEPS="+strings.Join(steps, " "), "-w", "/w", "--",
		"sh", "-c", "sh /t/programs.sh /w/p && sh /t/programs.sh /root/p")
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if r.code != 0 || len(lines) != 2*len(steps) {
		t.Fatalf("programs.sh on the share and on the disk: exit %d, %d lines; want 0 and %d\nstdout:\n%s\nstderr:\n%s",
			r.code, len(lines), 2*len(steps), r.stdout, r.stderr)
	}
	for i, step := range steps {
		onShare, onDisk := lines[i], lines[len(steps)+i]
		if !strings.HasPrefix(onDisk, step+": ok ") {
			t.Errorf("%s on the image's disk: %q, want %q", step, onDisk, step+": ok ...")
		}
		if onShare != onDisk {
			t.Errorf("%s on the share: %q\nwant what it gave on the image's disk: %q", step, onShare, onDisk)
		}
	}
	t.Logf("the programs' results, the same on the share and the disk:\n%s", strings.Join(lines[:len(steps)], "\n"))
}
