package devices

import (
	"bytes"
	"testing"
	"time"
)

func rd(d Device, off uint64) uint8 {
	b := []byte{0xaa}
	d.Read(off, b)
	return b[0]
}

func wr(d Device, off uint64, v uint8) { d.Write(off, []byte{v}) }

// edges returns an IRQLevel that counts rising edges, and reads the level.
func edges() (IRQLevel, *int, *bool) {
	n, level := new(int), new(bool)
	return func(high bool) {
		if high && !*level {
			*n++
		}
		*level = high
	}, n, level
}

func TestSerialTransmit(t *testing.T) {
	var out bytes.Buffer
	irq, irqs, _ := edges()
	s := NewSerial(&out, irq)
	for _, c := range []byte("hi\n") {
		if rd(s, uartLSR)&lsrTHRE == 0 {
			t.Fatal("transmitter not ready")
		}
		wr(s, uartTHR, c)
	}
	if out.String() != "hi\n" {
		t.Errorf("output %q", out.String())
	}
	if *irqs != 0 {
		t.Errorf("%d interrupts with IER=0", *irqs)
	}
}

func TestSerialTHREInterrupt(t *testing.T) {
	irq, irqs, level := edges()
	s := NewSerial(nil, irq)
	if got := rd(s, uartIIR); got != iirNone {
		t.Fatalf("IIR idle = %#x", got)
	}
	wr(s, uartIER, ierTHRE)
	if *irqs != 1 || !*level {
		t.Fatalf("enabling THRE with an empty transmitter raised %d interrupts (line high %v), want 1", *irqs, *level)
	}
	if got := rd(s, uartIIR); got != iirTHRE {
		t.Fatalf("IIR = %#x, want THRE", got)
	}
	if *level {
		t.Fatal("the line stays high after THRE was identified")
	}
	if got := rd(s, uartIIR); got != iirNone {
		t.Fatalf("IIR after identification = %#x, want none", got)
	}
	wr(s, uartTHR, 'x')
	if *irqs != 2 || !*level {
		t.Fatalf("after THR write: %d interrupts, line high %v", *irqs, *level)
	}
	// A second character before the first THRE was identified still makes
	// an edge: each transmitted byte is an interrupt the driver waits for.
	wr(s, uartTHR, 'x')
	if *irqs != 3 || rd(s, uartIIR) != iirTHRE {
		t.Fatalf("after a second THR write: %d interrupts", *irqs)
	}
	wr(s, uartFCR, 0x07)
	wr(s, uartTHR, 'y')
	if got := rd(s, uartIIR); got != iirTHRE|iirFIFOs {
		t.Errorf("IIR with FIFOs = %#x", got)
	}
}

func TestSerialReceive(t *testing.T) {
	irq, irqs, level := edges()
	s := NewSerial(nil, irq)
	s.Input([]byte("ab"))
	if *irqs != 0 {
		t.Fatal("interrupt with RDA disabled")
	}
	wr(s, uartIER, ierRDA)
	if *irqs != 1 {
		t.Fatalf("enabling RDA with data pending raised %d interrupts", *irqs)
	}
	if rd(s, uartIIR) != iirRDA || rd(s, uartLSR)&lsrDR == 0 {
		t.Fatal("data not signalled")
	}
	if a, b := rd(s, uartRBR), rd(s, uartRBR); a != 'a' || b != 'b' {
		t.Fatalf("read %q %q", a, b)
	}
	if rd(s, uartLSR)&lsrDR != 0 || rd(s, uartIIR) != iirNone || *level {
		t.Fatal("data still signalled after draining")
	}
	s.Input(make([]byte, serialRxLimit+100))
	if len(s.rx) != serialRxLimit {
		t.Errorf("rx queue %d bytes, want capped at %d", len(s.rx), serialRxLimit)
	}
}

func TestSerialDivisorAndLoopback(t *testing.T) {
	var out bytes.Buffer
	s := NewSerial(&out, nil)
	wr(s, uartLCR, lcrDLAB|0x03)
	wr(s, uartTHR, 0x01) // DLL
	wr(s, uartIER, 0x00) // DLM
	if rd(s, uartRBR) != 0x01 || rd(s, uartIER) != 0 {
		t.Fatal("divisor latch not readable")
	}
	wr(s, uartLCR, 0x03)
	if rd(s, uartIER) != 0 {
		t.Fatal("IER changed by divisor writes")
	}
	wr(s, uartMCR, mcrLoop|0x0f)
	if got := rd(s, uartMSR); got != 0xf0 {
		t.Errorf("loopback MSR = %#x, want 0xf0", got)
	}
	wr(s, uartTHR, 'z')
	if out.Len() != 0 || rd(s, uartRBR) != 'z' {
		t.Error("loopback byte left the UART or did not come back")
	}
	wr(s, uartMCR, 0)
	if rd(s, uartMSR) != msrConnected {
		t.Error("MSR without loopback")
	}
	wr(s, uartSCR, 0x5a)
	if rd(s, uartSCR) != 0x5a {
		t.Error("scratch register")
	}
}

func TestI8042Reset(t *testing.T) {
	for _, tc := range []struct {
		name   string
		writes [][2]uint8 // offset, value
		reset  bool
	}{
		{"pulse", [][2]uint8{{4, 0xfe}}, true},
		{"output port low", [][2]uint8{{4, 0xd1}, {0, 0xfe}}, true},
		{"output port high", [][2]uint8{{4, 0xd1}, {0, 0xff}}, false},
		{"data alone", [][2]uint8{{0, 0xfe}}, false},
		{"other command", [][2]uint8{{4, 0xad}}, false},
	} {
		resets := 0
		k := NewI8042(func() { resets++ })
		if rd(k, 4)&0x02 != 0 {
			t.Fatalf("%s: input buffer reported full", tc.name)
		}
		for _, w := range tc.writes {
			wr(k, uint64(w[0]), w[1])
		}
		if (resets > 0) != tc.reset {
			t.Errorf("%s: resets=%d, want reset=%v", tc.name, resets, tc.reset)
		}
	}
	k := NewI8042(nil)
	wr(k, 4, 0x20)
	if rd(k, 4)&i8042StatusOutputFull == 0 || rd(k, 0) != 0x45 {
		t.Error("command byte not readable")
	}
}

// TestI8042AnswersProbes: every command a guest driver waits on has its
// reply ready on the first status read, and the replies say the
// controller is fine and has no mouse port (Linux's i8042_check_aux).
func TestI8042AnswersProbes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		writes [][2]uint8
		want   uint8
	}{
		{"controller self test", [][2]uint8{{4, 0xaa}}, 0x55},
		{"keyboard port test", [][2]uint8{{4, 0xab}}, 0x00},
		{"aux loopback", [][2]uint8{{4, 0xd3}, {0, 0x5a}}, 0xa5},
		{"aux port test", [][2]uint8{{4, 0xa9}}, 0x01},
	} {
		k := NewI8042(nil)
		for _, w := range tc.writes {
			wr(k, uint64(w[0]), w[1])
		}
		if rd(k, 4)&i8042StatusOutputFull == 0 {
			t.Errorf("%s: no reply ready", tc.name)
			continue
		}
		if got := rd(k, 0); got != tc.want {
			t.Errorf("%s: reply %#x, want %#x", tc.name, got, tc.want)
		}
		if rd(k, 4)&i8042StatusOutputFull != 0 {
			t.Errorf("%s: more than one reply byte", tc.name)
		}
	}
}

func TestPortBus(t *testing.T) {
	b := NewPortBus()
	s := NewSerial(nil, nil)
	if err := b.Register(0x3f8, 8, s); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]uint64{{0x3f0, 9}, {0x3ff, 1}, {0xffff, 2}, {0x100, 0}} {
		if err := b.Register(bad[0], bad[1], s); err == nil {
			t.Errorf("Register(%#x, %d) accepted", bad[0], bad[1])
		}
	}
	if err := b.Register(0x3f0, 8, NewBootMarker(time.Now(), nil)); err != nil {
		t.Fatal(err)
	}
	d := []byte{0x5a}
	if !b.Write(0x3ff, d) {
		t.Fatal("scratch write unclaimed")
	}
	d[0] = 0
	if !b.Read(0x3ff, d) || d[0] != 0x5a {
		t.Fatalf("scratch read %#x", d[0])
	}
	d2 := []byte{0, 0}
	if b.Read(0x400, d2) || d2[0] != 0xff || d2[1] != 0xff {
		t.Errorf("unclaimed read = %x", d2)
	}
	if b.Write(0x80, d) {
		t.Error("unclaimed write claimed")
	}
}

func TestBootMarker(t *testing.T) {
	fired := 0
	m := NewBootMarker(time.Now().Add(-time.Second), func(time.Duration) { fired++ })
	wr(m, 0, 1)
	if _, ok := m.Elapsed(); ok {
		t.Fatal("wrong value counted")
	}
	wr(m, 0, BootMarkerValue)
	wr(m, 0, BootMarkerValue)
	at, ok := m.Elapsed()
	if !ok || at < time.Second || fired != 1 {
		t.Errorf("elapsed=%v ok=%v fired=%d", at, ok, fired)
	}
}

func TestACPISleep(t *testing.T) {
	for _, c := range []struct {
		off   uint64
		data  []byte
		power bool
	}{
		{0, []byte{0x20 | 5<<2}, true},  // SLP_EN, SLP_TYP 5: soft off
		{0, []byte{5 << 2}, false},      // SLP_TYP without SLP_EN
		{0, []byte{0x20 | 3<<2}, false}, // S3: not offered
		{0, []byte{0x20 | 5<<2 | 0x80 | 0x03}, true},
		{1, []byte{0x20 | 5<<2}, false}, // the status register
		{0, nil, false},
	} {
		n := 0
		a := NewACPISleep(5, func() { n++ })
		a.Write(c.off, c.data)
		if (n == 1) != c.power || n > 1 {
			t.Errorf("Write(%d, % x): powered off %d times, want %v", c.off, c.data, n, c.power)
		}
		got := []byte{0xff, 0xff}
		a.Read(c.off, got)
		if got[0] != 0 || got[1] != 0 {
			t.Errorf("Read(%d) = % x, want 0", c.off, got)
		}
	}
}
