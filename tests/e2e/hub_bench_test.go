package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mdlayher/vsock"

	"github.com/capsa-sandbox/capsa/hub"
	"github.com/capsa-sandbox/capsa/hub/proto"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// casIncrements does n compare-and-swap increments of key through api and
// returns how many attempts they took.
func casIncrements(ctx context.Context, api proto.API, key string, n int) (int, error) {
	attempts := 0
	for done := 0; done < n; {
		attempts++
		var ver, val uint64
		e, err := api.Get(ctx, key)
		if err == nil {
			ver = e.Version
			val, _ = strconv.ParseUint(string(e.Value), 10, 64)
		} else if !errors.Is(err, proto.ErrNotFound) {
			return attempts, err
		}
		if _, err := api.CAS(ctx, key, ver, []byte(strconv.FormatUint(val+1, 10))); err == nil {
			done++
		} else if !errors.Is(err, proto.ErrVersionMismatch) {
			return attempts, err
		}
	}
	return attempts, nil
}

// hubProbe is the guest side of BenchmarkHub, over one connection to the
// host's hub: cas KEY N (N increments; prints attempts and seconds), pong
// (answers each message on bench/ping with the same on bench/pong) and
// ping N (N round trips through a pong; prints each in microseconds).
func hubProbe(args []string) int {
	ctx := context.Background()
	c := &proto.Client{Dial: func(context.Context) (net.Conn, error) { return vsock.Dial(vsock.Host, proto.Port, nil) }}
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "probe:", err); return 1 }
	switch args[0] {
	case "cas":
		n, _ := strconv.Atoi(args[2])
		start := time.Now()
		attempts, err := casIncrements(ctx, c, args[1], n)
		if err != nil {
			return fail(err)
		}
		fmt.Printf("%d %f\n", attempts, time.Since(start).Seconds())
	case "pong":
		err := c.Subscribe(ctx, "bench/ping", proto.New, func(m proto.Message) error {
			_, err := c.Publish(ctx, "bench/pong", m.Payload)
			return err
		})
		return fail(err)
	case "ping":
		n, _ := strconv.Atoi(args[1])
		pongs := make(chan string, 1)
		sub := &proto.Client{Dial: c.Dial}
		go sub.Subscribe(ctx, "bench/pong", proto.New, func(m proto.Message) error { pongs <- string(m.Payload); return nil })
		time.Sleep(time.Second) // the subscription takes its start
		for i := 0; i < n; i++ {
			start := time.Now()
			if _, err := c.Publish(ctx, "bench/ping", []byte(strconv.Itoa(i))); err != nil {
				return fail(err)
			}
			select {
			case p := <-pongs:
				if p != strconv.Itoa(i) {
					return fail(fmt.Errorf("pong %q, want %d", p, i))
				}
			case <-time.After(time.Minute):
				return fail(fmt.Errorf("no pong %d within a minute", i))
			}
			fmt.Println(time.Since(start).Microseconds())
		}
	}
	return 0
}

// BenchmarkHub measures the hub: compare-and-swap increments per second
// from inside one guest and from four at once (each over one vsock
// connection), beside the same loop on the host (the anchor: no VM, no
// vsock); and a mailbox message's round trip between two sandboxes (one
// publishes, the other answers on a second topic), of which
// publish-to-receive is about half.
func BenchmarkHub(b *testing.B) {
	ctx := context.Background()
	dir := b.TempDir()
	start := func(name string) *sandbox.Sandbox {
		sb := startSandbox(b, ctx, sandbox.New().HubDir(dir).Identity(name).KV("bench/").Mailbox("bench/*"))
		copySelf(b, ctx, sb, "/tmp/probe")
		return sb
	}
	probeCmd := func(args ...string) sandbox.ExecOptions {
		o := sandbox.Command("/tmp/probe", args...)
		o.Env = []string{probeEnv + "=1"}
		o.Timeout = 5 * time.Minute
		return o
	}
	const n = 200
	b.Run("kv-cas-host", func(b *testing.B) {
		h, err := hub.Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		defer h.Close()
		s := h.As(hub.Grants{Identity: "host", Host: true})
		for i := 0; b.Loop(); i++ {
			t0 := time.Now()
			if _, err := casIncrements(ctx, s, fmt.Sprintf("bench/host%d", i), n); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(n/time.Since(t0).Seconds(), "cas/s")
		}
	})
	sbs := []*sandbox.Sandbox{start("g1"), start("g2"), start("g3"), start("g4")}
	// guestCAS runs the cas probe in each of sbs at once on key and
	// returns the increments per second they made together.
	guestCAS := func(b *testing.B, sbs []*sandbox.Sandbox, key string) float64 {
		var wg sync.WaitGroup
		secs := make([]float64, len(sbs))
		for i, sb := range sbs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r, err := sb.Exec(ctx, probeCmd("cas", key, strconv.Itoa(n)))
				if err != nil || r.Code != 0 {
					b.Errorf("probe cas in %d: %v, %+v", i, err, r)
					return
				}
				f := strings.Fields(string(r.Stdout))
				secs[i], _ = strconv.ParseFloat(f[len(f)-1], 64)
			}()
		}
		wg.Wait()
		if b.Failed() {
			b.FailNow()
		}
		return float64(n*len(sbs)) / slices.Max(secs)
	}
	b.Run("kv-cas-1-guest", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			b.ReportMetric(guestCAS(b, sbs[:1], fmt.Sprintf("bench/one%d", i)), "cas/s")
		}
	})
	b.Run("kv-cas-4-guests", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			b.ReportMetric(guestCAS(b, sbs, fmt.Sprintf("bench/four%d", i)), "cas/s")
		}
	})
	b.Run("mailbox-round-trip", func(b *testing.B) {
		pong, err := sbs[1].Stream(ctx, probeCmd("pong"))
		if err != nil {
			b.Fatal(err)
		}
		defer pong.Signal(ctx, "KILL")
		time.Sleep(time.Second)
		var samples []time.Duration
		for b.Loop() {
			r, err := sbs[0].Exec(ctx, probeCmd("ping", "20"))
			if err != nil || r.Code != 0 {
				b.Fatalf("probe ping: %v, %+v", err, r)
			}
			for _, f := range strings.Fields(string(r.Stdout)) {
				us, _ := strconv.Atoi(f)
				samples = append(samples, time.Duration(us)*time.Microsecond)
			}
		}
		reportSpread(b, samples)
	})
}
