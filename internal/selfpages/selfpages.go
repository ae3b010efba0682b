// Package selfpages gives back the pages of the running binary's own code
// and read-only data that a long-lived capsa process holds mapped after
// its start: the supervisor of a detached sandbox calls Release once the
// sandbox runs.
//
// Starting a sandbox runs code that never runs again (flag parsing, image
// unpacking, the boot tables, the confinement), and the kernel's
// read-ahead and fault-around map its neighbours too, so the process's
// RSS keeps about 13 MiB of the binary's text and read-only data that it
// will not use (BenchmarkDetachedExec/memory). MADV_DONTNEED on a private
// mapping of a file that was never written to only removes the process's
// page-table entries: the pages stay in the page cache, shared with every
// other capsa process, and what runs again is mapped back by a minor
// fault. Writable mappings (.data) and any mapping with a private
// (copied-on-write) page are left alone, since dropping those would lose
// what was written.
//
// The starting point is madvise(2) and proc(5)'s /proc/[pid]/smaps.
// golang.org/x/sys/unix.Madvise wants a []byte, which for a mapping the
// Go runtime made (the binary's own) would take package unsafe outside
// kvm; the raw system call takes the addresses as numbers.
package selfpages

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// A mapping is one region of /proc/self/smaps that Release may drop.
type mapping struct {
	start, end uint64
	rssKiB     uint64
}

// Release drops the calling process's page-table entries for the read-only
// mappings of its own executable, and returns how many bytes were resident
// in them before. It is always safe: what runs afterwards faults its pages
// back in from the page cache.
func Release() (int64, error) {
	ms, err := ownMappings()
	if err != nil {
		return 0, err
	}
	var freed int64
	for _, m := range ms {
		if _, _, e := syscall.Syscall(unix.SYS_MADVISE, uintptr(m.start), uintptr(m.end-m.start), unix.MADV_DONTNEED); e != 0 {
			return freed, fmt.Errorf("selfpages: madvise(%#x-%#x, MADV_DONTNEED): %w", m.start, m.end, e)
		}
		freed += int64(m.rssKiB) << 10
	}
	return freed, nil
}

// ownMappings is droppable for the calling process and its executable.
func ownMappings() ([]mapping, error) {
	exe, err := os.Readlink("/proc/self/exe")
	if err != nil {
		return nil, fmt.Errorf("selfpages: %w", err)
	}
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return nil, fmt.Errorf("selfpages: %w", err)
	}
	defer f.Close()
	ms, err := droppable(f, exe)
	if err != nil {
		return nil, fmt.Errorf("selfpages: /proc/self/smaps: %w", err)
	}
	return ms, nil
}

// droppable reads smaps and returns the mappings of the file at path that
// are not writable and hold no private page.
func droppable(r io.Reader, path string) ([]mapping, error) {
	var out []mapping
	var cur *mapping // the current region, if it is a candidate
	var anon uint64
	flush := func() {
		if cur != nil && anon == 0 {
			out = append(out, *cur)
		}
		cur, anon = nil, 0
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		if start, end, ok := parseRange(fields[0]); ok && len(fields) >= 5 {
			// A region's header: start-end perms offset dev inode [path].
			flush()
			perms := fields[1]
			name := ""
			if len(fields) >= 6 {
				// The path is the rest of the line after the inode, and may
				// hold spaces.
				_, rest, _ := strings.Cut(line, " "+fields[4]+" ")
				name = strings.TrimSpace(rest)
			}
			if name == path && len(perms) == 4 && perms[0] == 'r' && perms[1] != 'w' {
				cur = &mapping{start: start, end: end}
			}
			continue
		}
		if cur == nil {
			continue
		}
		switch strings.TrimSuffix(fields[0], ":") {
		case "Rss":
			if len(fields) >= 2 {
				cur.rssKiB, _ = strconv.ParseUint(fields[1], 10, 64)
			}
		case "Anonymous":
			// Any copied-on-write page, or a line not understood, keeps
			// the region.
			if len(fields) < 2 || fields[1] != "0" {
				anon = 1
			}
		}
	}
	flush()
	return out, sc.Err()
}

// parseRange parses smaps' "start-end" in hexadecimal.
func parseRange(s string) (start, end uint64, ok bool) {
	a, b, found := strings.Cut(s, "-")
	if !found {
		return 0, 0, false
	}
	start, err1 := strconv.ParseUint(a, 16, 64)
	end, err2 := strconv.ParseUint(b, 16, 64)
	if err1 != nil || err2 != nil || end <= start {
		return 0, 0, false
	}
	return start, end, true
}
