package shim

import (
	"context"
	bin "encoding/binary"
	"fmt"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/tap"
)

// TestJoinPodNetwork builds what CNI's bridge plugin leaves a pod: a
// network namespace whose eth0 (10.8.0.5/24, default route via 10.8.0.1)
// is one end of a veth pair whose other end is on the node. Joined to a
// VM, the pod's namespace has a tap that takes what eth0 receives (the
// node's ARP request for the pod's address comes out of the tap), eth0
// keeps no address, and the NIC the guest gets has eth0's MAC, address,
// gateway and MTU.
func TestJoinPodNetwork(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	// The pod's namespace lives as long as a thread of its own sits in it.
	podNS := make(chan string)
	release := make(chan struct{})
	defer close(release)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			podNS <- ""
			return
		}
		podNS <- fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		<-release
	}()
	nsPath := <-podNS
	if nsPath == "" {
		t.Fatal("could not make the pod's network namespace")
	}
	nsFile, err := os.Open(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer nsFile.Close()
	// The node's side: this thread, in a namespace of its own.
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatal(err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "node0", MTU: 1400}, PeerName: "eth0"}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	eth0, err := netlink.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetNsFd(eth0, int(nsFile.Fd())); err != nil {
		t.Fatal(err)
	}
	node, _ := netlink.LinkByName("node0")
	nodeAddr, _ := netlink.ParseAddr("10.8.0.1/24")
	netlink.AddrAdd(node, nodeAddr)
	if err := netlink.LinkSetUp(node); err != nil {
		t.Fatal(err)
	}
	var mac string
	err = inNetns(nsPath, func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		mac = eth0.Attrs().HardwareAddr.String()
		a, _ := netlink.ParseAddr("10.8.0.5/24")
		if err := netlink.AddrAdd(eth0, a); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(eth0); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: net.IPv4(10, 8, 0, 1)})
	})
	if err != nil {
		t.Fatalf("set up the pod's eth0 as CNI does: %v", err)
	}

	var spec *struct {
		name, mac, addr, gw string
		mtu                 int
	}
	var dev *tap.Device
	err = inNetns(nsPath, func() error {
		ts, err := joinPodNetwork()
		if err != nil {
			return err
		}
		spec = &struct {
			name, mac, addr, gw string
			mtu                 int
		}{ts.Name, ts.MAC, ts.Address, ts.Gateway, ts.MTU}
		eth0, _ := netlink.LinkByName("eth0")
		if addrs, _ := netlink.AddrList(eth0, netlink.FAMILY_V4); len(addrs) != 0 {
			return fmt.Errorf("eth0 keeps %v after the join", addrs)
		}
		if dev, err = tap.Open(ts.Name, ts.MTU); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatalf("join the pod's network: %v", err)
	}
	defer dev.Close()
	if spec.name != podTap || spec.mac != mac || spec.addr != "10.8.0.5/24" || spec.gw != "10.8.0.1" || spec.mtu != 1400 {
		t.Errorf("the guest's NIC = %+v; want %s with eth0's MAC %s, 10.8.0.5/24, gateway 10.8.0.1, MTU 1400", spec, podTap, mac)
	}
	// The node speaks to the pod's address: its ARP request reaches the tap.
	c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.IPv4(10, 8, 0, 5), Port: 9})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("x"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		f, err := dev.ReadFrame(ctx)
		if err != nil {
			t.Fatalf("the node's ARP request for the pod's address never came out of the tap: %v", err)
		}
		if len(f) >= 42 && bin.BigEndian.Uint16(f[12:]) == unix.ETH_P_ARP && net.IP(f[38:42]).Equal(net.IPv4(10, 8, 0, 5)) {
			break
		}
	}
}
