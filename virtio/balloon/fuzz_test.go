package virtioballoon

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/virtio/virtiotest"
)

// FuzzChains sends one chain of any shape to any of the three queues
// (buffers at addresses and lengths the input picks, readable or
// writable, and page frame numbers) and checks that the device returns it
// or marks itself broken, never panics, and gives back no page the chain
// did not name: a sentinel page the input cannot name keeps its content.
func FuzzChains(f *testing.F) {
	f.Add(byte(queueReporting), []byte{1, 0x40, 0, 0x20, 1})
	f.Add(byte(queueInflate), []byte{1, 0x10, 0, 0x01, 0, 0x20, 0x03, 0, 0, 0xff, 0xff, 0xff, 0xff})
	f.Add(byte(queueDeflate), []byte{2, 0x10, 0, 0, 0, 0x10, 0x8, 0, 0})
	f.Add(byte(queueReporting), []byte{3, 0xff, 0xf0, 0xff, 1, 0, 0, 0, 1, 0x7f, 0, 0x40, 0})
	f.Fuzz(func(t *testing.T, queue byte, shape []byte) {
		g := newGuest(t, FeatureReporting)
		// The sentinel: the page at 15 MiB, which no buffer below may
		// cover (addresses are under 15 MiB and lengths bounded).
		const sentinel = 15 << 20
		g.fill(sentinel, pageSize, 0x5a)
		g.fill(2<<20, 8<<20, 0x11)
		i := 0
		next := func() int {
			if i < len(shape) {
				i++
				return int(shape[i-1])
			}
			return 0
		}
		var bufs []virtiotest.Buffer
		// keep: byte 17 of every page the chain cannot give back (one
		// not wholly inside a reported buffer, not a frame it names)
		// must still read as filled; pages that frames were written
		// over at that byte are skipped.
		touched := map[uint64]bool{}
		for range next()%4 + 1 {
			// Address in 4 KiB units plus a byte offset; length up to
			// 1 MiB; the PFNs an inflate chain holds.
			addr := uint64(next()<<8|next())*pageSize%(sentinel-2<<20) + uint64(next())
			n := uint32(next()<<12 | next())
			write := next()%2 == 1
			if n > 0 && !write {
				var frames []byte
				for range min(n/4, 8) {
					frames = binary.LittleEndian.AppendUint32(frames, uint32(next()<<8|next()))
				}
				if addr+uint64(len(frames)) <= sentinel {
					_ = g.mem.WriteAt(frames, addr)
					for a := addr; a < addr+uint64(len(frames)); a++ {
						if a%pageSize == 17 {
							touched[a/pageSize] = true
						}
					}
				}
			}
			bufs = append(bufs, virtiotest.Buffer{Addr: addr, Len: n, Write: write})
		}
		qi := int(queue % 3)
		if _, err := g.qs[qi].AddBuffers(bufs); err != nil {
			t.Skip(err) // more descriptors than the queue holds
		}
		// After the chain is posted (its buffers may cover the rings the
		// posting wrote) and before the device is told of it.
		allowed := givable(g, qi, bufs)
		g.dev.Notify(qi)
		deadline := time.Now().Add(5 * time.Second)
		var used []virtiotest.Used
		for len(used) == 0 && g.failed.Load() == nil && time.Now().Before(deadline) {
			used = g.qs[qi].TakeUsed()
			time.Sleep(100 * time.Microsecond)
		}
		if len(used) == 0 && g.failed.Load() == nil {
			t.Fatal("the device neither returned the chain nor failed")
		}
		for _, u := range used {
			if u.Len != 0 {
				t.Errorf("the device wrote %d bytes into a chain", u.Len)
			}
		}
		for p := uint64(2 << 20 / pageSize); p < 10<<20/pageSize; p++ {
			if !allowed[p] && !touched[p] && g.byteAt(p*pageSize+17) != 0x11 {
				t.Fatalf("page %#x was given back, and the chain on queue %d did not name it: %+v (failed: %v)", p, qi, bufs, g.failed.Load() != nil)
			}
		}
		if g.byteAt(sentinel+17) != 0x5a && !allowed[sentinel/pageSize] {
			t.Errorf("the sentinel page at %#x was given back, unnamed", sentinel)
		}
	})
}

// givable is the pages a chain on queue qi may give back: those wholly
// inside its writable buffers on the reporting queue, the frames its
// readable bytes name (the first maxPFNBytes of them, as the device reads
// them) on the inflate queue, none on the deflate queue. It is read
// before the device runs, since a frame may name its own page.
// (Before the device runs: its worker took its first kick at Activate,
// long done by then; only Notify starts it again.)
func givable(g *guest, qi int, bufs []virtiotest.Buffer) map[uint64]bool {
	pages := map[uint64]bool{}
	switch qi {
	case queueReporting:
		for _, b := range bufs {
			if b.Write {
				for p := (b.Addr + pageSize - 1) / pageSize; (p+1)*pageSize <= b.Addr+uint64(b.Len); p++ {
					pages[p] = true
				}
			}
		}
	case queueInflate:
		var data []byte
		for _, b := range bufs {
			if b.Write || len(data) >= maxPFNBytes {
				continue
			}
			chunk := make([]byte, min(int(b.Len), maxPFNBytes-len(data)))
			if err := g.mem.ReadAt(chunk, b.Addr); err != nil {
				return pages // a buffer outside memory: the queue refuses the chain
			}
			data = append(data, chunk...)
		}
		for ; len(data) >= 4; data = data[4:] {
			pages[uint64(binary.LittleEndian.Uint32(data))] = true
		}
	}
	return pages
}
