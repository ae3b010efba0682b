package e2e

import (
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/posixtest"
)

// posixDirEnv, set in a guest, makes TestPosixSuite run go-fuse's POSIX
// file system suite (posixtest.All, third-party: written for FUSE file
// systems, it checks what Linux's local ones do) in fresh directories
// under it, instead of starting sandboxes.
const posixDirEnv = "CAPSA_E2E_POSIX_DIR"

// posixShareDifferences are the suite's cases whose result on a share
// differs from the guest's tmpfs, each with the share's result and why.
// The test holds the share to exactly this, as TestWorkspaceFidelity does.
var posixShareDifferences = map[string]struct{ got, why string }{}

// TestPosixSuite runs go-fuse's posixtest suite in a sandbox, through the
// CLI (so the VMM is confined as users run it), on a read-write share and
// on the guest's tmpfs, and compares: every case must pass on tmpfs, and
// give the same on the share unless posixShareDifferences says otherwise.
func TestPosixSuite(t *testing.T) {
	if dir := os.Getenv(posixDirEnv); dir != "" {
		runPosixSuite(t, dir)
		return
	}
	share := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	suite := func(dir string) string {
		return fmt.Sprintf("mkdir -p %[1]s && %[2]s=%[1]s /tmp/e2e.test -test.run '^TestPosixSuite$' -test.v -test.timeout 10m", dir, posixDirEnv)
	}
	r := capsa(t, 15*time.Minute, "run", "--memory", "1G", "-v", share+":/mnt/share", "--copy", self+":/tmp/e2e.test", "--",
		"sh", "-c", suite("/mnt/share/posix")+" > /tmp/share.out 2>&1; "+suite("/tmp/posix")+" > /tmp/tmpfs.out 2>&1; "+
			"echo '=== share'; cat /tmp/share.out; echo '=== tmpfs'; cat /tmp/tmpfs.out")
	shareOut, tmpfsOut, ok := strings.Cut(strings.TrimPrefix(r.stdout, "=== share\n"), "=== tmpfs\n")
	if r.code != 0 || !ok {
		t.Fatalf("the suite: exit %d; want 0 and both runs' output", r.code)
	}
	onShare, onTmpfs := posixResults(shareOut), posixResults(tmpfsOut)
	if len(onTmpfs) < len(posixtest.All) || len(onShare) != len(onTmpfs) {
		t.Fatalf("the suite ran %d cases on tmpfs and %d on the share; want %d each", len(onTmpfs), len(onShare), len(posixtest.All))
	}
	names := make([]string, 0, len(onTmpfs))
	for name := range onTmpfs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if onTmpfs[name] != "PASS" {
			t.Errorf("%s on the guest's tmpfs: %s, want PASS", name, onTmpfs[name])
		}
		want, why := onTmpfs[name], "as tmpfs"
		if d, ok := posixShareDifferences[name]; ok {
			want, why = d.got, d.why
		}
		if onShare[name] != want {
			t.Errorf("%s on the share: %s, want %s (%s)", name, onShare[name], want, why)
		}
	}
}

// posixCase is a subtest's verdict line in go test -v output.
var posixCase = regexp.MustCompile(`(?m)^\s+--- (PASS|FAIL|SKIP): TestPosixSuite/(\S+)`)

// posixResults reads each case's verdict from the suite's -v output.
func posixResults(out string) map[string]string {
	got := map[string]string{}
	for _, m := range posixCase.FindAllStringSubmatch(out, -1) {
		got[m[2]] = m[1]
	}
	return got
}

// runPosixSuite is TestPosixSuite inside the guest: every case of the
// suite, each in a fresh directory under dir.
func runPosixSuite(t *testing.T, dir string) {
	names := make([]string, 0, len(posixtest.All))
	for name := range posixtest.All {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			d, err := os.MkdirTemp(dir, name+"-")
			if err != nil {
				t.Fatal(err)
			}
			posixtest.All[name](t, d)
		})
	}
}
