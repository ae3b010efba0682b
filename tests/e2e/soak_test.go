package e2e

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
)

var soakCycles = flag.Int("soak.cycles", 20, "TestSoak: create/exec/destroy cycles (make soak runs 200)")

// usage is what the test process holds: the leaks a soak looks for.
type usage struct {
	fds, goroutines, threads int
	rssKiB                   int64
}

func (u usage) String() string {
	return "fds " + strconv.Itoa(u.fds) + ", goroutines " + strconv.Itoa(u.goroutines) +
		", threads " + strconv.Itoa(u.threads) + ", RSS " + strconv.FormatInt(u.rssKiB>>10, 10) + " MiB"
}

func measure(t testing.TB) usage {
	t.Helper()
	// Freed heap handed back to the OS, so RSS is what is really held.
	debug.FreeOSMemory()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	u := usage{fds: len(ents), goroutines: runtime.NumGoroutine()}
	threads, err := procField("/proc/self/status", "Threads")
	if err != nil {
		t.Fatal(err)
	}
	if u.rssKiB, err = procField("/proc/self/status", "VmRSS"); err != nil {
		t.Fatal(err)
	}
	u.threads = int(threads)
	return u
}

// settle measures the test process until ok holds of it, for at most 10
// s, and returns the last measure: goroutines of closed sandboxes end
// shortly after Close, not at once.
func settle(t testing.TB, ok func(usage) bool) usage {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		u := measure(t)
		if ok(u) || time.Now().After(deadline) {
			return u
		}
	}
}

// TestSoak creates, uses and destroys sandboxes (a share and the network
// each) in one process, and fails if that leaks descriptors or goroutines
// or grows the process by more than 64 MiB. `make soak` runs 200 cycles;
// `make test` a short version.
func TestSoak(t *testing.T) {
	kernel, initrd := artifact(t, "vmlinux"), artifact(t, "initramfs.cpio")
	share := t.TempDir()
	if err := os.WriteFile(filepath.Join(share, "in"), []byte("soak\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cycle := func(i int) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		sb, err := sandbox.New().Memory(256).Kernel(kernel).Initrd(initrd).
			Share(share, "/mnt/share", sandbox.ReadOnly).Network(netstack.PublicOnly()).
			Run("sleep", "100000").Start(ctx)
		if err != nil {
			t.Fatalf("cycle %d: Start = %v", i, err)
		}
		defer sb.Close()
		out, err := sb.Exec(ctx, sandbox.Shell("cat /mnt/share/in; echo $((6*7))"))
		if err != nil || string(out.Stdout) != "soak\n42\n" {
			t.Fatalf("cycle %d: Exec = %v, %v; want \"soak\\n42\\n\"", i, out, err)
		}
		if b, err := sb.ReadFile(ctx, "/proc/version"); err != nil || !strings.HasPrefix(string(b), "Linux") {
			t.Fatalf("cycle %d: ReadFile(/proc/version) = %q, %v", i, b, err)
		}
		if err := sb.Close(); err != nil {
			t.Fatalf("cycle %d: Close = %v", i, err)
		}
	}
	// One cycle first: what the first sandbox sets up once (the runtime's
	// threads, cached kernels) is not a leak.
	cycle(0)
	base := measure(t)
	t.Logf("after 1 cycle: %v", base)
	for i := 1; i <= *soakCycles; i++ {
		cycle(i)
		if i%50 == 0 {
			t.Logf("after %d cycles: %v", i+1, measure(t))
		}
	}
	// Goroutines of closed sandboxes end shortly after Close.
	end := settle(t, func(u usage) bool { return u.fds <= base.fds+2 && u.goroutines <= base.goroutines+2 })
	t.Logf("after %d cycles: %v", *soakCycles+1, end)
	if end.fds > base.fds+2 {
		t.Errorf("descriptors: %d after the soak, %d before", end.fds, base.fds)
	}
	if end.goroutines > base.goroutines+2 {
		buf := make([]byte, 1<<20)
		t.Errorf("goroutines: %d after the soak, %d before\n%s", end.goroutines, base.goroutines, buf[:runtime.Stack(buf, true)])
	}
	if grew := end.rssKiB - base.rssKiB; grew > 64<<10 {
		t.Errorf("RSS grew by %d MiB over the soak, want at most 64", grew>>10)
	}
}
