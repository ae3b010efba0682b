package nested

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// fakeNested stands in for capsa-nested in TestRunE2ERules: it "runs" the
// tests the -test.run pattern names, each as $MODE says.
const fakeNested = `#!/bin/bash
re=$(echo "$@" | sed 's/.*-test.run \([^ ]*\).*/\1/')
state=$STATE${E2E_LANE:-} # sessions are counted in each lane
session=$(($(cat "$state" 2>/dev/null || echo 0) + 1))
echo $session >"$state"
crash() { echo "capsa-nested: nested: the nested L1 host kernel crashed (L1 console: BUG: x)" >&2; exit 125; }
st=0
for t in TestA TestB TestC TestD; do
	[[ $t =~ $re ]] || continue
	case "$MODE:$session:$t" in
	fail-then-crash:1:TestB) echo "--- FAIL: TestB (1s)"; crash ;;
	crash-once:1:TestB) crash ;;
	two-crashes:1:TestC | two-crashes:2:TestC) crash ;;
	crash-each-lane:1:*) crash ;;
	skip:*:TestC) echo "--- SKIP: TestC (0s)" ;;
	no-result:*:TestD) echo "panic: boom"; st=2 ;;
	*) echo "--- PASS: $t (1s)" ;;
	esac
done
exit $st
`

// TestRunE2ERules: the end-to-end tier's runner passes only when every
// test passed, and fails on each of the rules that keep a failure from
// hiding: a FAIL before an L1 re-run, a skip no list expects, a test with
// no result, and a second L1 crash.
func TestRunE2ERules(t *testing.T) {
	if _, err := exec.LookPath("bash"); err != nil {
		t.Fatal("bash is needed to run tests/run-e2e.sh")
	}
	dir := t.TempDir()
	e2e := filepath.Join(dir, "e2e")
	os.Mkdir(e2e, 0o755)
	if err := os.WriteFile(filepath.Join(e2e, "e2e.test"), []byte("#!/bin/sh\nprintf 'TestA\\nTestB\\nTestC\\nTestD\\n'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	nested := filepath.Join(dir, "nested")
	if err := os.WriteFile(nested, []byte(fakeNested), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		mode, want string
		ok         bool
		lanes      int
	}{
		{"pass", "4 passed, 0 failed, 0 skipped; L1 crashed 0 time(s)", true, 1},
		// The crash cut TestC and TestD short: they alone run again,
		// and pass; TestB's failure before the crash stays.
		{"fail-then-crash", "3 passed, 1 failed, 0 skipped; L1 crashed 1 time(s)", false, 1},
		{"crash-once", "4 passed, 0 failed, 0 skipped; L1 crashed 1 time(s)", true, 1},
		{"skip", "FAILED: TestC(skipped,not-expected)", false, 1},
		{"no-result", "FAILED: TestD(no-result)", false, 1},
		{"two-crashes", "TestC(no-result,L1-crashed)", false, 1},
		// Two lanes (TestA and TestC in lane 0, TestB and TestD in
		// lane 1): their counts add up, a failure in either fails the
		// tier, and one L1 crash is allowed in all lanes together.
		{"pass", "4 listed in 2 lanes: 4 passed, 0 failed, 0 skipped; L1 crashed 0 time(s)", true, 2},
		{"no-result", "FAILED: TestD(no-result)", false, 2},
		{"fail-then-crash", "4 listed in 2 lanes: 3 passed, 1 failed, 0 skipped; L1 crashed 1 time(s)", false, 2},
		{"crash-once", "4 listed in 2 lanes: 4 passed, 0 failed, 0 skipped; L1 crashed 1 time(s)", true, 2},
		{"crash-each-lane", "L1 crashed 2 times in all lanes", false, 2},
	} {
		cmd := exec.Command("bash", "../run-e2e.sh", nested, e2e)
		cmd.Env = append(os.Environ(), "MODE="+tc.mode, "E2E_BATCH=4", fmt.Sprintf("E2E_LANES=%d", tc.lanes), "STATE="+filepath.Join(t.TempDir(), "sessions"))
		out, err := cmd.CombinedOutput()
		if (err == nil) != tc.ok || !strings.Contains(string(out), tc.want) {
			t.Errorf("%s, %d lanes: run-e2e.sh = %v; want ok=%v and %q in:\n%s", tc.mode, tc.lanes, err, tc.ok, tc.want, out)
		}
		if tc.mode == "crash-once" && tc.lanes == 1 && !strings.Contains(string(out), "=== run-e2e: TestB TestC TestD\n") {
			t.Errorf("crash-once: want only the unfinished TestB, TestC and TestD run again:\n%s", out)
		}
	}
}

// TestRunTestBinariesRules: the KVM tier's runner counts subtests, allows
// a skip its list names, and fails on one it does not and on a failure.
func TestRunTestBinariesRules(t *testing.T) {
	for _, tc := range []struct {
		name, out string
		code      int
		want      string
		ok        bool
	}{
		{"pass", "--- PASS: TestX (0s)\n    --- SKIP: TestY/listed (0s)\n", 0, "tests: 1 passed, 0 failed, 1 skipped", true},
		{"skip", "--- SKIP: TestZ (0s)\n", 0, "FAILED: TestZ(skipped,not-expected)", false},
		{"fail", "--- FAIL: TestW (0s)\n", 1, "FAILED: w.test", false},
	} {
		dir := t.TempDir()
		bin := filepath.Join(dir, "w.test")
		script := "#!/bin/sh\ncat <<'EOF'\n" + tc.out + "EOF\nexit " + string(rune('0'+tc.code)) + "\n"
		if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dir, "expected-skips.txt"), []byte("TestY/listed: a reason\n"), 0o644)
		cmd := exec.Command("sh", filepath.Join(mustAbs(t, ".."), "run-test-binaries.sh"), filepath.Base(dir))
		cmd.Dir = filepath.Dir(dir)
		out, err := cmd.CombinedOutput()
		if (err == nil) != tc.ok || !strings.Contains(string(out), tc.want) {
			t.Errorf("%s: run-test-binaries.sh = %v; want ok=%v and %q in:\n%s", tc.name, err, tc.ok, tc.want, out)
		}
	}
}

func mustAbs(t *testing.T, p string) string {
	t.Helper()
	a, err := filepath.Abs(p)
	if err != nil {
		t.Fatal(err)
	}
	return a
}
