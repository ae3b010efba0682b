package virtio

// Limiter slows a device's I/O to a rate (package ratelimit's Limiter is
// one): Wait takes ops operations and n bytes from its buckets, waiting
// until they hold them, and returns false if stop closed first. A device
// waits before the I/O of each request, never holding its lock: the guest
// is slowed, its requests never failed.
type Limiter interface {
	Wait(stop <-chan struct{}, ops, n int) bool
}
