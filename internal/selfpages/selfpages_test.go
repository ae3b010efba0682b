package selfpages

import (
	"reflect"
	"strings"
	"testing"
)

const smaps = `00400000-00a00000 r-xp 00000000 08:01 1234                               /usr/bin/my capsa
Size:               6144 kB
Rss:                4096 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
00a00000-01000000 r--p 00600000 08:01 1234                               /usr/bin/my capsa
Rss:                2048 kB
Anonymous:             0 kB
01000000-01100000 rw-p 00c00000 08:01 1234                               /usr/bin/my capsa
Rss:                 512 kB
Anonymous:           512 kB
01100000-01200000 r--p 00d00000 08:01 1234                               /usr/bin/my capsa
Rss:                   8 kB
Anonymous:             4 kB
01200000-01300000 r--p 00000000 08:01 99                                 /usr/bin/other
Rss:                  64 kB
Anonymous:             0 kB
01300000-01400000 rw-p 00000000 00:00 0 
Rss:                  64 kB
Anonymous:            64 kB
7ff000000000-7ff000001000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   4 kB
Anonymous:             0 kB
`

func TestDroppable(t *testing.T) {
	got, err := droppable(strings.NewReader(smaps), "/usr/bin/my capsa")
	if err != nil {
		t.Fatal(err)
	}
	// The text and the read-only data; not .data (writable), not the
	// read-only region with a copied page, not another file's or anonymous
	// memory.
	want := []mapping{{0x400000, 0xa00000, 4096}, {0xa00000, 0x1000000, 2048}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("droppable(smaps) = %+v, want %+v", got, want)
	}
}

// written is set before Release and checked after it: the binary's
// writable data must survive.
var written = []int{1, 2, 3}

func exeRSS(t *testing.T) int64 {
	t.Helper()
	ms, err := ownMappings()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, m := range ms {
		n += int64(m.rssKiB) << 10
	}
	return n
}

func TestRelease(t *testing.T) {
	written[1] = 42
	before := exeRSS(t)
	freed, err := Release()
	if err != nil {
		t.Fatalf("Release() = %v", err)
	}
	// Release reads what is resident itself, a moment later: code that
	// ran in between (this test's, the runtime's) may have faulted in a
	// few more pages, or the kernel reclaimed some.
	if slack := max(256<<10, before/4); freed <= 0 || freed < before-slack || freed > before+slack {
		t.Errorf("Release() freed %d bytes, want about the %d resident before", freed, before)
	}
	after := exeRSS(t)
	// Reading smaps and this test's own code fault some back (with their
	// neighbours: the kernel's fault-around), not all.
	if after >= before {
		t.Errorf("resident in the executable's read-only mappings: %d bytes after Release, %d before; want fewer", after, before)
	}
	// Code and data still work: this test runs on, and what it wrote
	// stays.
	if !reflect.DeepEqual(written, []int{1, 42, 3}) {
		t.Errorf("written = %v after Release, want [1 42 3]", written)
	}
	t.Logf("released %d KiB; %d KiB resident again by the check", freed>>10, after>>10)
}
