package p9server

import (
	"encoding/binary"
	"fmt"
	"io"
	"sync"
)

// ServeStream serves the 9P messages read from rw, one after another, and
// writes each reply whole: the transport of a socket or pipe (virtio-9p
// has its own, package ninep). It returns when reading fails, or a
// message's size is out of bounds (no reply can be trusted to line up
// after it), once every request being served has been answered and every
// fid released.
func (s *Session) ServeStream(rw io.ReadWriter) error {
	var wmu sync.Mutex
	write := func(b []byte) {
		wmu.Lock()
		rw.Write(b) // a failed write shows as a failed read
		wmu.Unlock()
	}
	defer s.Close()
	for {
		hdr := make([]byte, 4)
		if _, err := io.ReadFull(rw, hdr); err != nil {
			return err
		}
		n := binary.LittleEndian.Uint32(hdr)
		if n < headerLen || n > s.maxMsg {
			return fmt.Errorf("p9server: a message of %d bytes (%d to %d)", n, headerLen, s.maxMsg)
		}
		msg := append(hdr, make([]byte, n-4)...)
		if _, err := io.ReadFull(rw, msg[4:]); err != nil {
			return err
		}
		s.Serve(msg, write)
	}
}
