package confine

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"kernel.org/pub/linux/libs/security/libcap/cap"
)

// capsChild drops the capabilities in a child of the test, as root, with
// threads running beside it, then reports each thread's sets (from
// /proc) and what a kept and a dropped capability still allow.
func capsChild() int {
	// Threads that exist before the drop must lose them too.
	var wg sync.WaitGroup
	hold := make(chan struct{})
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			<-hold
		}()
	}
	what, err := dropCapabilities(os.Getenv("CAPS_FILES") == "1")
	got := map[string]string{"drop": what}
	if err != nil {
		got["drop"] = "error: " + err.Error()
	}
	tasks, _ := os.ReadDir("/proc/self/task")
	got["threads"] = strconv.Itoa(len(tasks))
	sets := map[string]bool{}
	for _, task := range tasks {
		b, err := os.ReadFile(filepath.Join("/proc/self/task", task.Name(), "status"))
		if err != nil {
			continue
		}
		var line []string
		for _, l := range strings.Split(string(b), "\n") {
			for _, k := range []string{"CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"} {
				if strings.HasPrefix(l, k) {
					line = append(line, strings.Join(strings.Fields(l), " "))
				}
			}
		}
		sets[strings.Join(line, "; ")] = true
	}
	var all []string
	for s := range sets {
		all = append(all, s)
	}
	got["sets"] = strings.Join(all, " | ")
	try := recorder(got)
	_, err = os.ReadFile(os.Getenv("CAPS_OTHERS_FILE"))
	try("read another user's 0600 file", err)
	try("chown to another user", os.Chown(os.Getenv("CAPS_MINE"), 65534, 65534))
	close(hold)
	wg.Wait()
	json.NewEncoder(os.Stdout).Encode(got)
	return 0
}

// TestDropCapabilities: as root, a process serving host files keeps
// exactly KeptCapabilities in every thread, in its permitted, effective
// and bounding sets, with nothing inheritable or ambient: it still reads
// another user's private file, and can no longer give a file away. One
// serving none keeps none, in any set: another user's private file is
// refused to it too.
func TestDropCapabilities(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("dropping capabilities needs root's")
	}
	dir := t.TempDir()
	others := filepath.Join(dir, "others")
	mine := filepath.Join(dir, "mine")
	for _, f := range []string{others, mine} {
		if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chown(others, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		what  string
		files bool
	}{{"files", true}, {"nothing", false}} {
		t.Run(c.what, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), childEnv+"=caps", "CAPS_OTHERS_FILE="+others, "CAPS_MINE="+mine,
				fmt.Sprintf("CAPS_FILES=%d", map[bool]int{true: 1}[c.files]))
			got := childResult(t, cmd, "the child dropping its capabilities")
			t.Logf("child: %v", got)
			var mask uint64
			var names []string
			kept := []cap.Value(nil)
			wantDrop, wantRead := "none held", "permission denied"
			if c.files {
				kept = KeptCapabilities
			}
			for _, v := range kept {
				mask |= 1 << uint(v)
				names = append(names, v.String())
			}
			if len(kept) > 0 {
				wantDrop, wantRead = "kept "+strings.Join(names, ","), "ok"
			}
			if got["drop"] != wantDrop {
				t.Errorf("dropCapabilities(%v) = %q; want %q", c.files, got["drop"], wantDrop)
			}
			want := fmt.Sprintf("CapInh: %016x; CapPrm: %016x; CapEff: %016x; CapBnd: %016x; CapAmb: %016x", 0, mask, mask, mask, 0)
			if got["sets"] != want {
				t.Errorf("the child's threads (%s) hold %q; want each %q", got["threads"], got["sets"], want)
			}
			if !strings.Contains(got["read another user's 0600 file"], wantRead) {
				t.Errorf("reading another user's file after the drop: %s; want %s", got["read another user's 0600 file"], wantRead)
			}
			if !strings.Contains(got["chown to another user"], "operation not permitted") {
				t.Errorf("chown to another user after the drop: %s; want EPERM (%s dropped)", got["chown to another user"], cap.CHOWN)
			}
		})
	}
}
