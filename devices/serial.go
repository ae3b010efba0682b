package devices

import (
	"io"
	"sync"
)

// 8250/16550 register offsets and bits (see the PC16550D data sheet).
const (
	uartRBR = 0 // receive buffer (read, DLAB=0)
	uartTHR = 0 // transmit holding (write, DLAB=0)
	uartIER = 1 // interrupt enable (DLAB=0)
	uartIIR = 2 // interrupt identification (read)
	uartFCR = 2 // FIFO control (write)
	uartLCR = 3
	uartMCR = 4
	uartLSR = 5
	uartMSR = 6
	uartSCR = 7

	ierRDA  = 0x01 // received data available
	ierTHRE = 0x02 // transmit holding register empty

	iirNone  = 0x01
	iirTHRE  = 0x02
	iirRDA   = 0x04
	iirFIFOs = 0xc0

	lcrDLAB = 0x80

	mcrLoop = 0x10

	lsrDR   = 0x01
	lsrTHRE = 0x20
	lsrTEMT = 0x40

	// With no loopback, a connected modem: carrier, data set ready, clear to send.
	msrConnected = 0x80 | 0x20 | 0x10

	// SerialPortCOM1 is the legacy base port of ttyS0.
	SerialPortCOM1 = 0x3f8
	// SerialIRQCOM1 is its ISA interrupt line.
	SerialIRQCOM1 = 4

	serialRxLimit = 64 << 10
)

// Serial is an 8250-compatible UART: what the guest transmits goes to an
// io.Writer, what the host queues with Input the guest receives. The FIFO is
// modelled as always ready, so transmission never waits.
//
// Its interrupt output is a level, as on the chip: high while IIR names a
// pending interrupt, set under the UART's lock whenever it changes, so that
// the line the guest's interrupt controller sees always agrees with IIR.
// (Pulsing the line for each event instead loses interrupts: two threads'
// pulses can interleave into one edge, and an edge that comes while the
// guest has the pin masked is gone.)
type Serial struct {
	mu         sync.Mutex
	out        io.Writer
	irq        IRQLevel
	line       bool // the level last set
	ier, lcr   uint8
	mcr, scr   uint8
	dll, dlm   uint8
	fcr        uint8
	thrPending bool // a THR-empty interrupt is owed and not yet identified
	rx         []byte
}

// NewSerial returns a UART writing the guest's output to out and driving
// the interrupt line irq.
func NewSerial(out io.Writer, irq IRQLevel) *Serial {
	if out == nil {
		out = io.Discard
	}
	if irq == nil {
		irq = func(bool) {}
	}
	return &Serial{out: out, irq: irq, dll: 12} // 9600 baud until the guest sets it
}

// Input queues bytes for the guest to read and raises the receive interrupt.
// Bytes beyond an internal limit are dropped, as a real UART overruns.
func (s *Serial) Input(p []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	room := serialRxLimit - len(s.rx)
	if len(p) > room {
		p = p[:room]
	}
	s.rx = append(s.rx, p...)
	s.updateIRQ()
}

// updateIRQ sets the interrupt line to what IIR says; s.mu is held.
func (s *Serial) updateIRQ() {
	if pending := s.iir()&iirNone == 0; pending != s.line {
		s.line = pending
		s.irq(pending)
	}
}

func (s *Serial) iir() uint8 {
	id := uint8(iirNone)
	switch {
	case s.ier&ierRDA != 0 && len(s.rx) > 0:
		id = iirRDA
	case s.ier&ierTHRE != 0 && s.thrPending:
		id = iirTHRE
	}
	if s.fcr&0x01 != 0 {
		id |= iirFIFOs
	}
	return id
}

// Read implements Device.
func (s *Serial) Read(off uint64, data []byte) {
	if len(data) == 0 {
		return
	}
	for i := range data {
		data[i] = 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.updateIRQ()
	dlab := s.lcr&lcrDLAB != 0
	var v uint8
	switch off {
	case uartRBR:
		if dlab {
			v = s.dll
		} else if len(s.rx) > 0 {
			v = s.rx[0]
			s.rx = s.rx[1:]
		}
	case uartIER:
		if dlab {
			v = s.dlm
		} else {
			v = s.ier
		}
	case uartIIR:
		v = s.iir()
		if v&0x0f == iirTHRE {
			s.thrPending = false // identifying THRE clears it
		}
	case uartLCR:
		v = s.lcr
	case uartMCR:
		v = s.mcr
	case uartLSR:
		v = lsrTHRE | lsrTEMT
		if len(s.rx) > 0 {
			v |= lsrDR
		}
	case uartMSR:
		if s.mcr&mcrLoop != 0 {
			// Loopback: DTR->DSR, RTS->CTS, OUT1->RI, OUT2->DCD.
			m := s.mcr
			v = (m&0x01)<<5 | (m&0x02)<<3 | (m&0x04)<<4 | (m&0x08)<<4
		} else {
			v = msrConnected
		}
	case uartSCR:
		v = s.scr
	}
	data[0] = v
}

// Write implements Device.
func (s *Serial) Write(off uint64, data []byte) {
	if len(data) == 0 {
		return
	}
	v := data[0]
	s.mu.Lock()
	dlab := s.lcr&lcrDLAB != 0
	var out []byte
	switch off {
	case uartTHR:
		if dlab {
			s.dll = v
			break
		}
		if s.mcr&mcrLoop != 0 {
			if len(s.rx) < serialRxLimit {
				s.rx = append(s.rx, v)
			}
		} else {
			out = []byte{v}
		}
		// Sent at once: the holding register is empty again, and a THRE
		// interrupt is owed. Clearing it first makes a fresh edge when
		// the previous one was never identified.
		s.thrPending = false
		s.updateIRQ()
		s.thrPending = true
	case uartIER:
		if dlab {
			s.dlm = v
			break
		}
		old := s.ier
		s.ier = v & 0x0f
		// Enabling the THRE interrupt with the transmitter empty raises it
		// at once; Linux's 8250 driver depends on that.
		if old&ierTHRE == 0 && s.ier&ierTHRE != 0 {
			s.thrPending = true
		}
	case uartFCR:
		if s.lcr == 0xbf {
			break // with LCR 0xbf this address is the 16650's EFR, not the FCR
		}
		s.fcr = v
		if v&0x02 != 0 {
			s.rx = s.rx[:0]
		}
	case uartLCR:
		s.lcr = v
	case uartMCR:
		s.mcr = v & 0x1f
	case uartSCR:
		s.scr = v
	}
	s.updateIRQ()
	s.mu.Unlock()
	if out != nil {
		s.out.Write(out) // a failing console must not stop the guest
	}
}

// SerialState is the UART's registers as the guest set them: plain data
// for a snapshot. Input the host had queued and the guest not yet read is
// not part of it.
type SerialState struct {
	IER        uint8 `json:"ier"`
	LCR        uint8 `json:"lcr"`
	MCR        uint8 `json:"mcr"`
	SCR        uint8 `json:"scr"`
	DLL        uint8 `json:"dll"`
	DLM        uint8 `json:"dlm"`
	FCR        uint8 `json:"fcr"`
	THRPending bool  `json:"thr_pending"`
}

// State returns the UART's registers.
func (s *Serial) State() SerialState {
	s.mu.Lock()
	defer s.mu.Unlock()
	return SerialState{IER: s.ier, LCR: s.lcr, MCR: s.mcr, SCR: s.scr, DLL: s.dll, DLM: s.dlm, FCR: s.fcr, THRPending: s.thrPending}
}

// Restore sets the UART's registers (any byte values are registers the
// guest could have written) and its interrupt line to match.
func (s *Serial) Restore(st SerialState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ier, s.lcr, s.mcr, s.scr, s.dll, s.dlm, s.fcr, s.thrPending = st.IER, st.LCR, st.MCR, st.SCR, st.DLL, st.DLM, st.FCR, st.THRPending
	s.rx = nil
	// Set the line whatever it was believed to be: the restored
	// interrupt controller holds the level saved with it.
	s.line = s.iir()&iirNone == 0
	s.irq(s.line)
}
