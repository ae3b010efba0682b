package p9server

import (
	"testing"
	"time"
)

// FuzzServe: any request, well-formed or not, after a session's version
// and attach, gets exactly one reply, in time, with its own tag, and no
// panic.
func FuzzServe(f *testing.F) {
	seed := func(typ uint8, body func(e *encoder)) { f.Add(typ, msg(typ, 0, body)[headerLen:]) }
	seed(msgTwalk, func(e *encoder) { e.u32(0); e.u32(1); e.u16(1); e.str("a") })
	seed(msgTlcreate, func(e *encoder) { e.u32(0); e.str("f"); e.u32(2); e.u32(0o644); e.u32(0) })
	seed(msgTmkdir, func(e *encoder) { e.u32(0); e.str("d"); e.u32(0o755); e.u32(0) })
	seed(msgTgetattr, func(e *encoder) { e.u32(0); e.u64(0x3fff) })
	seed(msgTsetattr, func(e *encoder) {
		e.u32(0)
		e.u32(1)
		e.u32(0o700)
		e.u32(0)
		e.u32(0)
		e.u64(0)
		e.u64(0)
		e.u64(0)
		e.u64(0)
		e.u64(0)
	})
	seed(msgTxattrwalk, func(e *encoder) { e.u32(0); e.u32(2); e.str("") })
	seed(msgTxattrcreat, func(e *encoder) { e.u32(0); e.str("user.x"); e.u64(1); e.u32(0) })
	seed(msgTreaddir, func(e *encoder) { e.u32(0); e.u64(0); e.u32(4096) })
	seed(msgTlock, func(e *encoder) {
		e.u32(0)
		e.u8(1)
		e.u32(0)
		e.u64(0)
		e.u64(0)
		e.u32(1)
		e.str("c")
	})
	seed(msgTversion, func(e *encoder) { e.u32(8192); e.str("9P2000.L") })
	_, a := share(f)
	f.Fuzz(func(t *testing.T, typ uint8, body []byte) {
		r := newRaw(t, a)
		r.start()
		m := msg(typ, 7, func(e *encoder) { e.b = append(e.b, body...) })
		c := make(chan []byte, 2)
		r.s.Serve(m, func(b []byte) { c <- b })
		select {
		case b := <-c:
			if _, tag, _, err := header(b); err != nil || tag != 7 {
				t.Fatalf("reply %x: %v, tag %d", b, err, tag)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no reply in 10 s")
		}
		select {
		case b := <-c:
			t.Fatalf("a second reply: %x", b)
		case <-time.After(time.Millisecond):
		}
	})
}
