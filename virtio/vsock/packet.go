// Package vsock is a virtio-vsock device (virtio 1.2 §5.10) whose host end
// is Go: Dial(port) connects to a guest listener, Listen(port) accepts guest
// connections, both as net.Conn; a Unix socket can speak Firecracker's
// hybrid-vsock handshake for other tools.
//
// The guest is hostile: every packet is validated, a connection that breaks
// the protocol (more data than the credit it was given, a wrong type, an
// unknown operation) is reset, and limits bound what a guest can make the
// host hold.
package vsock

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// HostCID is the host's context id; guests get 3 and up.
const HostCID = 2

// Packet header fields (struct virtio_vsock_hdr, little-endian).
const (
	hdrSize = 44

	typeStream = 1

	opRequest       = 1
	opResponse      = 2
	opRst           = 3
	opShutdown      = 4
	opRW            = 5
	opCreditUpdate  = 6
	opCreditRequest = 7

	shutdownRcv  = 1
	shutdownSend = 2

	// maxPayload bounds one packet's data, as Linux's 64 KiB rx buffers do.
	maxPayload = 64 << 10
)

// header is a parsed struct virtio_vsock_hdr.
type header struct {
	SrcCID, DstCID   uint64
	SrcPort, DstPort uint32
	Len              uint32
	Type, Op         uint16
	Flags            uint32
	BufAlloc, FwdCnt uint32
}

var errShortHeader = errors.New("vsock: packet shorter than its 44-byte header")

func parseHeader(b []byte) (header, error) {
	if len(b) < hdrSize {
		return header{}, errShortHeader
	}
	le := binary.LittleEndian
	h := header{
		SrcCID: le.Uint64(b[0:]), DstCID: le.Uint64(b[8:]),
		SrcPort: le.Uint32(b[16:]), DstPort: le.Uint32(b[20:]),
		Len: le.Uint32(b[24:]), Type: le.Uint16(b[28:]), Op: le.Uint16(b[30:]),
		Flags: le.Uint32(b[32:]), BufAlloc: le.Uint32(b[36:]), FwdCnt: le.Uint32(b[40:]),
	}
	if h.Len > maxPayload {
		return h, fmt.Errorf("vsock: packet claims %d bytes of data, more than %d", h.Len, maxPayload)
	}
	return h, nil
}

func (h header) marshal(b []byte) {
	le := binary.LittleEndian
	le.PutUint64(b[0:], h.SrcCID)
	le.PutUint64(b[8:], h.DstCID)
	le.PutUint32(b[16:], h.SrcPort)
	le.PutUint32(b[20:], h.DstPort)
	le.PutUint32(b[24:], h.Len)
	le.PutUint16(b[28:], h.Type)
	le.PutUint16(b[30:], h.Op)
	le.PutUint32(b[32:], h.Flags)
	le.PutUint32(b[36:], h.BufAlloc)
	le.PutUint32(b[40:], h.FwdCnt)
}

func opName(op uint16) string {
	switch op {
	case opRequest:
		return "REQUEST"
	case opResponse:
		return "RESPONSE"
	case opRst:
		return "RST"
	case opShutdown:
		return "SHUTDOWN"
	case opRW:
		return "RW"
	case opCreditUpdate:
		return "CREDIT_UPDATE"
	case opCreditRequest:
		return "CREDIT_REQUEST"
	}
	return fmt.Sprintf("op %d", op)
}
