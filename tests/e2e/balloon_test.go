package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestBalloonGivesMemoryBack: a workload that fills 200 MiB of a 512 MiB
// sandbox's memory and frees it costs the host that memory, then, within
// seconds, most of it no longer: the guest reports the freed pages through
// its balloon (2 s after they were freed) and capsa gives them back. Without
// the balloon the host would hold them until the sandbox ended.
func TestBalloonGivesMemoryBack(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sb := startSized(t, ctx, sandbox.New().CPUs(1).Memory(512).Balloon(true))
	stats := func() *sandbox.Stats {
		t.Helper()
		st, err := sb.Stats()
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	run := func(script string) {
		t.Helper()
		out, err := sb.Exec(ctx, sandbox.Shell(script))
		if err != nil || out.Code != 0 {
			t.Fatalf("%s: %+v, %v\n%s", script, out, err, out.Stderr)
		}
	}
	const fill = 200 << 20
	base := stats().MemoryResident
	run("dd if=/dev/zero of=/tmp/fill bs=1M count=200")
	full := stats()
	if full.MemoryResident < base+fill*9/10 {
		t.Fatalf("the host holds %d MiB of guest memory after the guest filled 200 MiB, %d MiB before: the test's premise fails", full.MemoryResident>>20, base>>20)
	}
	returned := full.MemoryReturned
	run("rm /tmp/fill")
	freed := time.Now()
	var st *sandbox.Stats
	for {
		st = stats()
		if full.MemoryResident-min(st.MemoryResident, full.MemoryResident) >= fill*3/4 {
			break
		}
		if time.Since(freed) > 30*time.Second {
			t.Fatalf("30 s after the guest freed 200 MiB the host still holds %d MiB of its memory (%d MiB full, %d MiB before the fill; %d MiB returned so far)",
				st.MemoryResident>>20, full.MemoryResident>>20, base>>20, st.MemoryReturned>>20)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("guest memory the host holds: %d MiB at the start, %d MiB filled, %d MiB %v after the free (%d MiB reported since the free, %d MiB in all)",
		base>>20, full.MemoryResident>>20, st.MemoryResident>>20, time.Since(freed).Round(100*time.Millisecond), (st.MemoryReturned-returned)>>20, st.MemoryReturned>>20)
	// The counter is checked exactly by the device's unit test; here only
	// that it accounts for what came back (the guest's report of its
	// untouched free memory, over its first half minute, may add to it).
	if got := st.MemoryReturned - returned; got < full.MemoryResident-st.MemoryResident {
		t.Errorf("Stats().MemoryReturned grew by %d MiB after the free, want at least the %d MiB the host gave back", got>>20, (full.MemoryResident-st.MemoryResident)>>20)
	}
	// The memory works after it came back: fill and check it again.
	run("dd if=/dev/zero of=/tmp/fill bs=1M count=100 && rm /tmp/fill")
}
