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
				}
			}
			bufs = append(bufs, virtiotest.Buffer{Addr: addr, Len: n, Write: write})
		}
		qi := int(queue % 3)
		if _, err := g.qs[qi].AddBuffers(bufs); err != nil {
			t.Skip(err) // more descriptors than the queue holds
		}
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
		// Page frames name any page below 256 MiB; the sentinel's frame
		// is 0xf00, which the input can name: only count it as given
		// back wrongly when no frame in the chain named it.
		if g.byteAt(sentinel+17) != 0x5a && !names(g, bufs, sentinel>>pageShift) {
			t.Errorf("the sentinel page at %#x was given back, unnamed", sentinel)
		}
	})
}

// names reports whether an inflate chain's frames include pfn.
func names(g *guest, bufs []virtiotest.Buffer, pfn uint32) bool {
	for _, b := range bufs {
		if b.Write {
			continue
		}
		for off := uint64(0); off+4 <= uint64(min(b.Len, maxPFNBytes)); off += 4 {
			if v, err := g.mem.Uint32(b.Addr + off); err == nil && v == pfn {
				return true
			}
		}
	}
	return false
}
