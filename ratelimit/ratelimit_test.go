package ratelimit

import (
	"strings"
	"testing"
	"time"
)

// A bucket never lets more through than its burst plus its rate over the
// time taken: the lower bounds here cannot be beaten however fast the
// machine; the upper ones are loose, for a slow one.
func TestWaitKeepsTheRate(t *testing.T) {
	l := New(Limit{Bytes: Rate{Per: 1 << 20, Burst: 64 << 10}})
	start := time.Now()
	for range 32 {
		if !l.Wait(nil, 1, 16<<10) {
			t.Fatal("Wait gave up without a stop")
		}
	}
	// 512 KiB at 1 MiB/s after a 64 KiB burst: at least 448 ms.
	if d := time.Since(start); d < 430*time.Millisecond || d > 5*time.Second {
		t.Errorf("512 KiB at 1 MiB/s took %v; want about 450 ms", d)
	}
}

// A request bigger than the burst goes through, at the rate.
func TestWaitBiggerThanBurst(t *testing.T) {
	l := New(Limit{Bytes: Rate{Per: 1 << 20, Burst: 64 << 10}})
	start := time.Now()
	if !l.Wait(nil, 1, 320<<10) {
		t.Fatal("Wait gave up")
	}
	if d := time.Since(start); d < 230*time.Millisecond || d > 5*time.Second {
		t.Errorf("320 KiB with a 64 KiB burst at 1 MiB/s took %v; want about 250 ms", d)
	}
}

func TestWaitOps(t *testing.T) {
	l := New(Limit{Ops: Rate{Per: 100, Burst: 1}})
	start := time.Now()
	for range 21 {
		l.Wait(nil, 1, 1<<30) // bytes unlimited
	}
	if d := time.Since(start); d < 190*time.Millisecond || d > 5*time.Second {
		t.Errorf("21 operations at 100/s took %v; want about 200 ms", d)
	}
}

func TestWaitStops(t *testing.T) {
	l := New(Limit{Bytes: Rate{Per: MinBytesPerSec, Burst: 1}})
	stop := make(chan struct{})
	go func() { time.Sleep(50 * time.Millisecond); close(stop) }()
	start := time.Now()
	if l.Wait(stop, 1, 10*MinBytesPerSec) {
		t.Error("Wait of 10 s of tokens returned true though stopped")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("a stopped Wait returned after %v", d)
	}
}

// Set changes a limit in place: raised, the next waits are short.
func TestSetRaises(t *testing.T) {
	l := New(Limit{Bytes: Rate{Per: MinBytesPerSec}})
	l.Wait(nil, 1, MinBytesPerSec) // empty the bucket
	l.Set(Limit{Bytes: Rate{Per: 100 << 20}})
	start := time.Now()
	l.Wait(nil, 1, 10<<20)
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("10 MiB after raising the limit to 100 MiB/s took %v", d)
	}
	l.Set(Limit{})
	if !l.Limit().Unlimited() || !l.Wait(nil, 1<<30, 1<<40) {
		t.Error("an unlimited Limiter waited or says it limits")
	}
	var none *Limiter
	if !none.Wait(nil, 1, 1) {
		t.Error("a nil Limiter waited")
	}
}

func TestParseLimits(t *testing.T) {
	l, err := ParseLimits("net=10MB/s,disk=50MiB:100MiB,disk-iops=2000,net-tx-pps=5000,share=1M", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	want := Limits{
		NetRx: Limit{Bytes: Rate{Per: 10e6}},
		NetTx: Limit{Bytes: Rate{Per: 10e6}, Ops: Rate{Per: 5000}},
		Disk:  Limit{Bytes: Rate{Per: 50 << 20, Burst: 100 << 20}, Ops: Rate{Per: 2000}},
		Share: Limit{Bytes: Rate{Per: 1e6}},
	}
	if l != want {
		t.Errorf("ParseLimits = %+v, want %+v", l, want)
	}
	if s := l.String(); s != "net-rx=10MB/s,net-tx=10MB/s,net-tx-pps=5000/s,disk=50MiB/s:100MiB,disk-iops=2000/s,share=1MB/s" {
		t.Errorf("String = %q", s)
	}
	back, err := ParseLimits(l.String(), Limits{})
	if err != nil || back != l {
		t.Errorf("ParseLimits(String()) = %+v, %v; want %+v", back, err, l)
	}
	// An update on top of the current limits; 0 removes one.
	up, err := ParseLimits("disk=0,net-rx=20MB", l)
	if err != nil || !up.Disk.Bytes.Unlimited() || up.Disk.Ops.Per != 2000 || up.NetRx.Bytes.Per != 20e6 || up.NetTx.Bytes.Per != 10e6 {
		t.Errorf("update = %+v, %v", up, err)
	}
	if (Limits{}).String() != "none" {
		t.Errorf("no limits: %q", Limits{}.String())
	}
	for _, bad := range []string{"net", "cpu=1", "net=fast", "net=-1", "net=1KB", "disk-iops=1", "net=1MB:0", "share=1e400", "disk=NaN"} {
		if _, err := ParseLimits(bad, Limits{}); err == nil || !strings.Contains(err.Error(), "limit") {
			t.Errorf("ParseLimits(%q) = %v; want an error naming the limit", bad, err)
		}
	}
}
