package shim

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// podTap is the tap device the shim makes in a pod's network namespace.
const podTap = "capsa-tap0"

// netnsPath is the network namespace CRI made for the pod (the sandbox
// container's spec names it), or "" (ctr run: the VM gets no NIC).
func netnsPath(s *specs.Spec) string {
	if s.Linux == nil {
		return ""
	}
	for _, n := range s.Linux.Namespaces {
		if n.Type == specs.NetworkNamespace {
			return n.Path
		}
	}
	return ""
}

// inNetns runs fn on a thread that is in the network namespace at path,
// then returns the thread to its own. What fn starts (a process, a
// netlink socket, a tap) is made in that namespace; the Go runtime starts
// no other thread from a locked one. A thread that cannot go back is
// left locked, so that the runtime ends it with the goroutine.
func inNetns(path string, fn func() error) error {
	runtime.LockOSThread()
	own, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("pod network: %w", err)
	}
	defer own.Close()
	ns, err := os.Open(path)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("pod network: %w", err)
	}
	defer ns.Close()
	if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("pod network: enter %s: %w", path, err)
	}
	ferr := fn()
	if err := unix.Setns(int(own.Fd()), unix.CLONE_NEWNET); err != nil {
		return errors.Join(ferr, fmt.Errorf("pod network: leave %s: %w", path, err))
	}
	runtime.UnlockOSThread()
	return ferr
}

// joinPodNetwork moves the pod's network to its VM; it runs in the pod's
// network namespace (inNetns). It finds the interface CNI gave the pod,
// makes a tap beside it and joins the two with tc: each one's ingress
// redirected to the other's egress (what Kata Containers' tcfilter
// networking does), then takes the interface's IPv4 address off it, so
// that the namespace's own stack no longer answers for the address the
// guest now holds. It returns the NIC the guest gets: the interface's MAC,
// address, gateway and MTU.
func joinPodNetwork() (*sandbox.TapSpec, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("pod network: list links: %w", err)
	}
	var pod netlink.Link
	for _, l := range links {
		if l.Attrs().Flags&net.FlagLoopback == 0 && l.Attrs().Name != podTap {
			if pod != nil {
				return nil, fmt.Errorf("pod network: two interfaces, %s and %s: capsa joins one to the VM", pod.Attrs().Name, l.Attrs().Name)
			}
			pod = l
		}
	}
	if pod == nil {
		return nil, errors.New("pod network: the namespace has no interface but loopback (CNI gave the pod none)")
	}
	name := pod.Attrs().Name
	addrs, err := netlink.AddrList(pod, netlink.FAMILY_V4)
	if err != nil || len(addrs) == 0 {
		return nil, fmt.Errorf("pod network: %s has no IPv4 address (%v)", name, err)
	}
	addr, ok := netip.AddrFromSlice(addrs[0].IP.To4())
	ones, _ := addrs[0].Mask.Size()
	if !ok {
		return nil, fmt.Errorf("pod network: %s: address %s", name, addrs[0].IP)
	}
	t := &sandbox.TapSpec{Name: podTap, MAC: pod.Attrs().HardwareAddr.String(), Address: netip.PrefixFrom(addr, ones).String(), MTU: pod.Attrs().MTU}
	routes, err := netlink.RouteList(pod, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("pod network: %s's routes: %w", name, err)
	}
	for _, r := range routes {
		if (r.Dst == nil || r.Dst.IP.IsUnspecified()) && r.Gw != nil {
			t.Gateway = r.Gw.String()
		}
	}
	tap := &netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: podTap, MTU: t.MTU}, Mode: netlink.TUNTAP_MODE_TAP, Flags: netlink.TUNTAP_NO_PI}
	if err := netlink.LinkAdd(tap); err != nil {
		return nil, fmt.Errorf("pod network: make the tap: %w", err)
	}
	tapLink, err := netlink.LinkByName(podTap)
	if err != nil {
		return nil, fmt.Errorf("pod network: the tap: %w", err)
	}
	if err := netlink.LinkSetUp(tapLink); err != nil {
		return nil, fmt.Errorf("pod network: bring the tap up: %w", err)
	}
	for _, pair := range [][2]netlink.Link{{pod, tapLink}, {tapLink, pod}} {
		from, to := pair[0].Attrs().Index, pair[1].Attrs().Index
		ingress := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: from, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}
		if err := netlink.QdiscAdd(ingress); err != nil {
			return nil, fmt.Errorf("pod network: ingress qdisc on %s: %w", pair[0].Attrs().Name, err)
		}
		redirect := &netlink.U32{ // no selector: every frame
			FilterAttrs: netlink.FilterAttrs{LinkIndex: from, Parent: netlink.MakeHandle(0xffff, 0), Priority: 1, Protocol: unix.ETH_P_ALL},
			Actions: []netlink.Action{&netlink.MirredAction{ActionAttrs: netlink.ActionAttrs{Action: netlink.TC_ACT_STOLEN},
				MirredAction: netlink.TCA_EGRESS_REDIR, Ifindex: to}},
		}
		if err := netlink.FilterAdd(redirect); err != nil {
			return nil, fmt.Errorf("pod network: redirect %s to %s: %w", pair[0].Attrs().Name, pair[1].Attrs().Name, err)
		}
	}
	for _, a := range addrs {
		if err := netlink.AddrDel(pod, &a); err != nil {
			return nil, fmt.Errorf("pod network: take %s off %s: %w", a.IPNet, name, err)
		}
	}
	// IPv6 would have the namespace's stack speak from the pod's MAC
	// (router solicitations); the guest has the address family alone.
	for _, n := range []string{name, podTap} {
		os.WriteFile("/proc/sys/net/ipv6/conf/"+n+"/disable_ipv6", []byte("1"), 0)
	}
	return t, nil
}
