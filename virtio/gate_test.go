package virtio

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"
)

// laterDevice answers each chain from another goroutine once released, as
// the 9P device answers when its server replies: chains stay in its hands
// meanwhile.
type laterDevice struct {
	echoDevice
	mu      sync.Mutex
	release chan struct{} // closed: answer; nil: answer at once
	got     chan struct{} // a chain was taken
}

func (l *laterDevice) Notify(i int) {
	q := l.act.Queues[i]
	for {
		l.mu.Lock()
		c, err := q.Next()
		release := l.release
		l.mu.Unlock()
		if err != nil || c == nil {
			return
		}
		l.got <- struct{}{}
		go func() {
			if release != nil {
				<-release
			}
			io.Copy(c, c)
			l.mu.Lock()
			q.Push(c)
			l.mu.Unlock()
		}()
	}
}

func newGatedMMIO(t *testing.T) (*mmioDriver, *laterDevice, *Gate) {
	dev := &laterDevice{got: make(chan struct{}, 16), release: make(chan struct{})}
	d, _ := newMMIO(t, dev)
	g := NewGate()
	d.m.UseGate(g)
	if st := d.bringUp(FeatureVersion1 | 1<<3); st&StatusDriverOK == 0 {
		t.Fatalf("status %#x", st)
	}
	return d, dev, g
}

func (d *mmioDriver) request(i uint16) {
	d.drv.mem.WriteAt([]byte("ping"), testData)
	d.drv.add(2*i, buf{testData, 4, false}, buf{testData + 0x100 + 8*uint64(i), 8, true})
	d.w(regQueueNotify, 0)
}

func (d *mmioDriver) usedIdx() uint16 {
	v, _ := d.drv.mem.LoadUint16(testUsed + 2)
	return v
}

// TestGateWaitsForHeldChains: Close returns only once the chain the device
// took before it has been pushed, and while closed no chain leaves the
// ring; Open and Kick hand the waiting one over.
func TestGateWaitsForHeldChains(t *testing.T) {
	d, dev, g := newGatedMMIO(t)
	d.request(0)
	<-dev.got
	if g.Held() != 1 {
		t.Fatalf("Held() = %d with one request taken, want 1", g.Held())
	}
	closed := make(chan error, 1)
	go func() { closed <- g.Close(context.Background()) }()
	select {
	case err := <-closed:
		t.Fatalf("Close() = %v before the held request was answered", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(dev.release)
	if err := <-closed; err != nil || g.Held() != 0 || d.usedIdx() != 1 {
		t.Fatalf("Close() = %v, Held() = %d, used index %d; want nil, 0, 1", err, g.Held(), d.usedIdx())
	}
	// Closed: a new request stays in the ring.
	d.request(1)
	select {
	case <-dev.got:
		t.Fatal("the device took a chain through a closed gate")
	case <-time.After(100 * time.Millisecond):
	}
	if d.usedIdx() != 1 {
		t.Fatalf("used index %d while closed, want 1", d.usedIdx())
	}
	g.Open()
	d.m.Kick()
	<-dev.got
	deadline := time.Now().Add(5 * time.Second)
	for d.usedIdx() != 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if d.usedIdx() != 2 {
		t.Fatalf("used index %d after Open and Kick, want 2", d.usedIdx())
	}
}

// TestGateCloseTimesOutAndResetReleases: a device that never answers makes
// Close fail with ctx, naming what is held; a reset of the device gives its
// chains up, and Close then succeeds.
func TestGateCloseTimesOutAndResetReleases(t *testing.T) {
	d, dev, g := newGatedMMIO(t)
	d.request(0)
	<-dev.got
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := g.Close(ctx); err == nil || !strings.Contains(err.Error(), "1 requests") {
		t.Fatalf("Close() = %v, want an error naming 1 request held", err)
	}
	d.w(regStatus, 0) // the driver resets the device
	if err := g.Close(context.Background()); err != nil || g.Held() != 0 {
		t.Fatalf("after reset: Close() = %v, Held() = %d; want nil, 0", err, g.Held())
	}
	close(dev.release) // the late answer is not counted again
	time.Sleep(10 * time.Millisecond)
	if g.Held() != 0 {
		t.Fatalf("Held() = %d after a late push, want 0", g.Held())
	}
}
