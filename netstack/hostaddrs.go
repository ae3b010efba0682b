package netstack

import (
	"net"
	"net/netip"
	"sync"
	"time"
)

// hostAddrs caches the host's own interface addresses, which public-only
// refuses (a public address of the host would reach its services bound to
// 0.0.0.0). The list is refreshed at most every hostAddrsTTL.
type hostAddrs struct {
	mu      sync.Mutex
	fetched time.Time
	set     map[netip.Addr]struct{}
}

const hostAddrsTTL = 30 * time.Second

func newHostAddrs() *hostAddrs { return &hostAddrs{} }

func (h *hostAddrs) contains(a netip.Addr) bool {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.set == nil || now.Sub(h.fetched) > hostAddrsTTL {
		h.refreshLocked(now)
	}
	_, ok := h.set[a.Unmap()]
	return ok
}

func (h *hostAddrs) refreshLocked(now time.Time) {
	set := make(map[netip.Addr]struct{})
	addrs, err := net.InterfaceAddrs()
	if err != nil && h.set != nil {
		return // keep the previous list
	}
	for _, a := range addrs {
		var ip net.IP
		switch v := a.(type) {
		case *net.IPNet:
			ip = v.IP
		case *net.IPAddr:
			ip = v.IP
		}
		if na, ok := netip.AddrFromSlice(ip); ok {
			set[na.Unmap()] = struct{}{}
		}
	}
	h.set, h.fetched = set, now
}
