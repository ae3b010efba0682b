// Package tap is a virtio-net backend on a Linux tap device: the guest's
// Ethernet frames pass to and from the host kernel unchanged, with no NAT.
// It is how a containerd pod's VM joins the pod's network (package shim):
// the tap lives in the pod's network namespace, joined to the pod's veth
// by tc redirection, and the guest takes the pod's address, as Kata
// Containers' tcfilter networking does.
//
// The tap is opened without IFF_VNET_HDR and without offloads, so the
// kernel segments and checksums what it hands the tap (validate_xmit_skb):
// every frame read is a whole frame of at most the MTU, which the virtio
// NIC (no offloads either) takes as it is.
package tap

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Device is an open tap device.
type Device struct {
	f        *os.File
	name     string
	maxFrame int
}

// Open attaches to the tap device name in the calling process's network
// namespace (making it if it does not exist, which needs CAP_NET_ADMIN);
// mtu bounds the frames it reads.
func Open(name string, mtu int) (*Device, error) {
	if mtu < 68 || mtu > 65535 {
		return nil, fmt.Errorf("tap %s: MTU %d: want 68 to 65535", name, mtu)
	}
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("tap %s: open /dev/net/tun: %w", name, err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("tap %s: %w", name, err)
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("tap %s: attach (TUNSETIFF): %w", name, err)
	}
	// os.NewFile on a non-blocking descriptor uses the runtime's poller,
	// so a read can be given a deadline.
	// An Ethernet header and a VLAN tag beside the MTU.
	return &Device{f: os.NewFile(uintptr(fd), "/dev/net/tun:"+name), name: name, maxFrame: 14 + 4 + mtu}, nil
}

// DeliverFrame sends a frame the guest sent out of the tap.
func (d *Device) DeliverFrame(frame []byte) error {
	if _, err := d.f.Write(frame); err != nil {
		return fmt.Errorf("tap %s: write: %w", d.name, err)
	}
	return nil
}

// ReadFrame waits for the next frame for the guest, until ctx ends or the
// device is closed.
func (d *Device) ReadFrame(ctx context.Context) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	d.f.SetReadDeadline(time.Time{})
	stop := context.AfterFunc(ctx, func() { d.f.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	buf := make([]byte, d.maxFrame)
	for {
		n, err := d.f.Read(buf)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if errors.Is(err, os.ErrDeadlineExceeded) {
				// A deadline an earlier activation's ctx left.
				d.f.SetReadDeadline(time.Time{})
				continue
			}
			return nil, fmt.Errorf("tap %s: read: %w", d.name, err)
		}
		if n > 0 {
			return buf[:n:n], nil
		}
	}
}

// Close detaches from the tap (a persistent tap stays, for its owner to
// delete).
func (d *Device) Close() error { return d.f.Close() }
