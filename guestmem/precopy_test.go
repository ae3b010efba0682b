package guestmem

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPreCopy: a copy begun while the memory changes, finished once it no
// longer does, holds exactly what WriteFile writes then: pages written
// during the copy and after it, pages zeroed, pages given back to the
// host (MADV_DONTNEED: zeros) and pages untouched. Where the kernel does
// not track soft-dirty pages (the development machine's), PreCopy says so
// and the test skips; the KVM tier runs it on the nested host's kernel,
// which does.
func TestPreCopy(t *testing.T) {
	m, err := New(16 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	host := m.Regions()[0].Host
	for p := 0; p < len(host)/pageSize; p += 3 {
		host[p*pageSize+p%pageSize] = byte(p) | 1
	}
	clearRefs, err := OpenClearRefs()
	if err != nil {
		t.Skipf("no soft-dirty tracking here: %v", err)
	}
	defer clearRefs.Close()
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "copy"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// A writer changes pages of the first 2 MiB while the copy runs, as a
	// guest would. (The memory may be in huge pages: a write makes all
	// 2 MiB around it soft-dirty.)
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			p := (i * 7919) % (hugePage / pageSize)
			host[p*pageSize+100] = byte(i) | 1
		}
	}()
	pc, err := m.PreCopy(f, clearRefs, nil)
	stop.Store(true)
	wg.Wait()
	if errors.Is(err, ErrNoSoftDirty) {
		t.Skipf("no soft-dirty tracking here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	// One at a time in a process: a second would clear the first's bits.
	other, err := New(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.PreCopy(f, clearRefs, nil); !errors.Is(err, ErrBusy) {
		t.Errorf("a second pre-copy while one is under way: %v; want ErrBusy", err)
	}
	// After the copy, in the same 2 MiB: a page that was zero written, a
	// written one changed, one zeroed, one given back to the host, and
	// one given back (Discard, as the balloon does) and read again: the
	// kernel's zero page, present and not soft-dirty.
	host[1*pageSize+5] = 9
	host[3*pageSize+5] = 9
	clear(host[6*pageSize : 7*pageSize])
	if err := unix.Madvise(host[9*pageSize:10*pageSize], unix.MADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Discard(host[12*pageSize : 13*pageSize]); err != nil {
		t.Fatal(err)
	}
	if host[12*pageSize+12%pageSize] != 0 {
		t.Fatal("a discarded page reads non-zero")
	}
	n, err := pc.Finish()
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.Create(filepath.Join(dir, "whole"))
	if err != nil {
		t.Fatal(err)
	}
	defer want.Close()
	if err := m.WriteFile(want, nil, nil); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(f.Name())
	exp, _ := os.ReadFile(want.Name())
	if !bytes.Equal(got, exp) {
		for i := 0; i < len(exp); i += pageSize {
			if !bytes.Equal(got[i:i+pageSize], exp[i:i+pageSize]) {
				t.Fatalf("the finished copy differs from the memory first at page %d (of %d; Finish wrote %d)", i/pageSize, len(exp)/pageSize, n)
			}
		}
		t.Fatalf("the finished copy is %d bytes, the memory %d", len(got), len(exp))
	}
	if n == 0 || n > len(exp)/pageSize/2 {
		t.Errorf("Finish wrote %d pages of %d; want those of the 2 MiB changed, at most half", n, len(exp)/pageSize)
	}
	t.Logf("Finish wrote or cleared %d pages of %d", n, len(exp)/pageSize)
	// Over: another may begin.
	if pc2, err := other.PreCopy(f, clearRefs, nil); err != nil {
		t.Errorf("a pre-copy after the first finished: %v", err)
	} else {
		pc2.Close()
	}
}

// TestPreCopyOfFileMemory: memory mapped from a file is refused.
func TestPreCopyOfFileMemory(t *testing.T) {
	dir := t.TempDir()
	src, err := os.Create(filepath.Join(dir, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	src.Truncate(1 << 20)
	m, err := Map(src, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := m.PreCopy(src, nil, nil); err == nil {
		t.Error("PreCopy of memory mapped from a file succeeded")
	}
}
