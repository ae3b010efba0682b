package netstack

import (
	"context"
	"sync"
	"sync/atomic"

	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
)

// linkEndpoint is the stack's Ethernet NIC. Frames from the guest come in
// through deliver; frames for the guest go to a bounded queue read by
// ReadFrame. It does the Ethernet framing itself (no nested endpoint) and
// advertises no offloads: every frame it emits carries full checksums, and it
// expects the same of the guest.
type linkEndpoint struct {
	mac tcpip.LinkAddress
	mtu atomic.Uint32

	mu         sync.RWMutex
	dispatcher stack.NetworkDispatcher
	onClose    func()

	out       chan []byte
	done      chan struct{}
	closeOnce sync.Once

	framesOut  atomic.Uint64
	droppedOut atomic.Uint64
}

var _ stack.LinkEndpoint = (*linkEndpoint)(nil)

func newLinkEndpoint(mac tcpip.LinkAddress, mtu uint32, queueLen int) *linkEndpoint {
	e := &linkEndpoint{
		mac:  mac,
		out:  make(chan []byte, queueLen),
		done: make(chan struct{}),
	}
	e.mtu.Store(mtu)
	return e
}

func (e *linkEndpoint) MTU() uint32             { return e.mtu.Load() }
func (e *linkEndpoint) SetMTU(mtu uint32)       { e.mtu.Store(mtu) }
func (e *linkEndpoint) MaxHeaderLength() uint16 { return header.EthernetMinimumSize }
func (e *linkEndpoint) LinkAddress() tcpip.LinkAddress {
	return e.mac
}
func (e *linkEndpoint) SetLinkAddress(tcpip.LinkAddress) {} // fixed at creation
func (e *linkEndpoint) Capabilities() stack.LinkEndpointCapabilities {
	return stack.CapabilityResolutionRequired
}

func (e *linkEndpoint) Attach(d stack.NetworkDispatcher) {
	e.mu.Lock()
	e.dispatcher = d
	e.mu.Unlock()
}

func (e *linkEndpoint) IsAttached() bool {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.dispatcher != nil
}

func (e *linkEndpoint) Wait() {}

func (e *linkEndpoint) ARPHardwareType() header.ARPHardwareType { return header.ARPHardwareEther }

func (e *linkEndpoint) AddHeader(pkt *stack.PacketBuffer) {
	src := pkt.EgressRoute.LocalLinkAddress
	if src == "" {
		src = e.mac
	}
	eth := header.Ethernet(pkt.LinkHeader().Push(header.EthernetMinimumSize))
	eth.Encode(&header.EthernetFields{
		SrcAddr: src,
		DstAddr: pkt.EgressRoute.RemoteLinkAddress,
		Type:    pkt.NetworkProtocolNumber,
	})
}

func (e *linkEndpoint) ParseHeader(pkt *stack.PacketBuffer) bool {
	_, ok := pkt.LinkHeader().Consume(header.EthernetMinimumSize)
	return ok
}

func (e *linkEndpoint) SetOnCloseAction(f func()) {
	e.mu.Lock()
	e.onClose = f
	e.mu.Unlock()
}

func (e *linkEndpoint) Close() {
	e.closeOnce.Do(func() {
		close(e.done)
		e.mu.Lock()
		f := e.onClose
		e.dispatcher = nil
		e.mu.Unlock()
		if f != nil {
			f()
		}
	})
}

// WritePackets copies each packet into a frame and queues it for the guest.
// A full queue drops frames, as a NIC with a full ring would; TCP recovers.
func (e *linkEndpoint) WritePackets(pkts stack.PacketBufferList) (int, tcpip.Error) {
	n := 0
	for _, pkt := range pkts.AsSlice() {
		n++
		select {
		case <-e.done:
			return n, &tcpip.ErrClosedForSend{}
		default:
		}
		frame := make([]byte, 0, pkt.Size())
		for _, s := range pkt.AsSlices() {
			frame = append(frame, s...)
		}
		select {
		case e.out <- frame:
			e.framesOut.Add(1)
		default:
			e.droppedOut.Add(1)
		}
	}
	return n, nil
}

// deliver hands a validated frame (copied, owned by the stack) to the stack.
func (e *linkEndpoint) deliver(frame []byte) bool {
	e.mu.RLock()
	d := e.dispatcher
	e.mu.RUnlock()
	if d == nil {
		return false
	}
	eth := header.Ethernet(frame)
	proto := eth.Type()
	var pktType tcpip.PacketType
	switch dst := eth.DestinationAddress(); {
	case dst == header.EthernetBroadcastAddress:
		pktType = tcpip.PacketBroadcast
	case header.IsMulticastEthernetAddress(dst):
		pktType = tcpip.PacketMulticast
	default:
		pktType = tcpip.PacketHost
	}
	pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithData(frame)})
	defer pkt.DecRef()
	if _, ok := pkt.LinkHeader().Consume(header.EthernetMinimumSize); !ok {
		return false
	}
	pkt.PktType = pktType
	d.DeliverNetworkPacket(proto, pkt)
	return true
}

// read blocks for the next frame toward the guest.
func (e *linkEndpoint) read(ctx context.Context) ([]byte, error) {
	// Prefer queued frames; then wait.
	select {
	case f := <-e.out:
		return f, nil
	default:
	}
	select {
	case f := <-e.out:
		return f, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-e.done:
		return nil, ErrClosed
	}
}

func (e *linkEndpoint) tryRead() ([]byte, bool) {
	select {
	case f := <-e.out:
		return f, true
	default:
		return nil, false
	}
}
