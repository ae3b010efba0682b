package virtioblk

import (
	"encoding/binary"
	"os"
	"testing"
	"time"
)

// FuzzRequest sends one request of any type, sector and framing (the
// header's 16 bytes, then up to three more readable buffers and up to
// three writable ones, sized by the input) and checks that the device
// answers it with a valid status, stays up, and never changes the disk's
// size.
func FuzzRequest(f *testing.F) {
	f.Add(uint32(typeIn), uint64(0), []byte{0, 0, 2, 0, 1})
	f.Add(uint32(typeOut), uint64(3), []byte{2, 0, 0, 0, 1})
	f.Add(uint32(typeDiscard), uint64(0), []byte{1, 16, 0, 0, 1})
	f.Add(uint32(typeGetID), uint64(0), []byte{0, 0, 0, 20, 1})
	f.Add(uint32(typeOut), ^uint64(0), []byte{1, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, typ uint32, sector uint64, shape []byte) {
		const sectors = 32
		g := newGuest(t, newDisk(t, sectors*SectorSize), Options{})
		outs := [][]byte{header(typ, sector)}
		var ins []int
		// shape: [n readable][their sizes in 64-byte units, or a
		// discard range]...[n writable][their sizes in sectors, 0 =
		// one byte]
		i := 0
		next := func() int {
			if i < len(shape) {
				i++
				return int(shape[i-1])
			}
			return 0
		}
		for range next() % 4 {
			n := next()
			b := make([]byte, n*64%(4*SectorSize+1))
			if len(b) >= discardSegLen {
				binary.LittleEndian.PutUint64(b, uint64(next()))
				binary.LittleEndian.PutUint32(b[8:], uint32(next()))
			}
			outs = append(outs, b)
		}
		for range next() % 4 {
			n := next() % 8
			if n == 0 {
				ins = append(ins, 1)
			} else {
				ins = append(ins, n*SectorSize)
			}
		}
		if _, err := g.q.AddChain(outs, ins); err != nil {
			t.Fatal(err)
		}
		g.dev.Notify(0)
		used := g.q.WaitUsed(1, 5*time.Second)
		if len(used) != 1 {
			t.Fatalf("device returned %d chains, want 1", len(used))
		}
		if p := g.failed.Load(); p != nil {
			t.Fatalf("a well-formed ring failed the device: %v", *p)
		}
		total := 0
		for _, n := range ins {
			total += n
		}
		u := used[0]
		if total == 0 {
			if u.Len != 0 {
				t.Fatalf("chain without a writable byte: %d bytes written", u.Len)
			}
		} else if int(u.Len) != total || u.Written[total-1] > statusUnsupp {
			t.Fatalf("wrote %d bytes of %d, status %d", u.Len, total, u.Written[len(u.Written)-1])
		}
		if fi, err := os.Stat(g.path); err != nil || fi.Size() != sectors*SectorSize {
			t.Fatalf("disk file after the request: %v, %v", fi, err)
		}
		if st, _ := g.read(0, 1); st != statusOK {
			t.Fatalf("the next read = status %d", st)
		}
	})
}
