package tap

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TestTapPassesFrames makes a tap in a network namespace of the test's
// own and plays the guest on it: the host kernel's ARP request for a
// neighbour comes out of ReadFrame whole, the reply DeliverFrame gives it
// enters the kernel's neighbour table, and a read ends when its context
// does.
func TestTapPassesFrames(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("making a tap and a network namespace needs root")
	}
	// The thread stays in the new namespace: never unlocked, it ends
	// with the test.
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatalf("unshare the network namespace: %v", err)
	}
	if _, err := Open("capsatest0", 10); err == nil {
		t.Error("Open with MTU 10 = nil error, want it refused")
	}
	d, err := Open("capsatest0", 1500)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	link, err := netlink.LinkByName("capsatest0")
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("10.9.0.1/24")
	if err := netlink.AddrAdd(link, addr); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		t.Fatal(err)
	}
	// A datagram to a neighbour: the kernel asks for its MAC on the tap.
	c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.IPv4(10, 9, 0, 2), Port: 9})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("x"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var req []byte
	for {
		f, err := d.ReadFrame(ctx)
		if err != nil {
			t.Fatalf("no ARP request for 10.9.0.2 came out of the tap: %v", err)
		}
		if len(f) >= 42 && binary.BigEndian.Uint16(f[12:]) == unix.ETH_P_ARP && net.IP(f[38:42]).Equal(net.IPv4(10, 9, 0, 2)) {
			req = f
			break
		}
	}
	if len(req) > 14+1500 {
		t.Errorf("a frame of %d bytes, more than the MTU allows", len(req))
	}
	// The guest answers: 10.9.0.2 is at 52:54:00:00:00:02.
	guest := net.HardwareAddr{0x52, 0x54, 0, 0, 0, 2}
	reply := make([]byte, 42)
	copy(reply[0:6], req[6:12])
	copy(reply[6:12], guest)
	binary.BigEndian.PutUint16(reply[12:], unix.ETH_P_ARP)
	copy(reply[14:22], []byte{0, 1, 8, 0, 6, 4, 0, 2}) // Ethernet, IPv4, reply
	copy(reply[22:28], guest)
	copy(reply[28:32], net.IPv4(10, 9, 0, 2).To4())
	copy(reply[32:38], req[6:12])
	copy(reply[38:42], net.IPv4(10, 9, 0, 1).To4())
	if err := d.DeliverFrame(reply); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		neigh, _ := netlink.NeighList(link.Attrs().Index, netlink.FAMILY_V4)
		found := false
		for _, n := range neigh {
			if n.IP.Equal(net.IPv4(10, 9, 0, 2)) && n.HardwareAddr.String() == guest.String() {
				found = true
			}
		}
		if found {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the kernel never learnt the guest's MAC from the delivered reply: %+v", neigh)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// A read waiting for a frame ends with its context.
	rctx, rcancel := context.WithCancel(context.Background())
	go func() { time.Sleep(200 * time.Millisecond); rcancel() }()
	start := time.Now()
	for {
		_, err := d.ReadFrame(rctx)
		if err != nil {
			if !errors.Is(err, context.Canceled) {
				t.Errorf("ReadFrame after its context ended = %v, want context.Canceled", err)
			}
			break
		}
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("ReadFrame took %v to end with its context", time.Since(start))
	}
}
