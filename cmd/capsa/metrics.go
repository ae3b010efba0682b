package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/store"
)

// runMetrics serves every detached sandbox's use as Prometheus metrics,
// labelled by sandbox name, measured at each scrape.
func runMetrics(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("metrics", "[flags]", stdout)
	listen := fs.String("listen", "127.0.0.1:9464", "serve /metrics on this address (port 0: any free port)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 0 {
		fmt.Fprintln(stderr, "capsa metrics: takes no arguments")
		return 2
	}
	st, err := openStateStore()
	if err != nil {
		fmt.Fprintf(stderr, "capsa metrics: %v\n", err)
		return 1
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(newSandboxCollector(ctx, st))
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(stderr, "capsa metrics: --listen: %v\n", err)
		return 2
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slogErrorLog{slog.New(slog.NewTextHandler(stderr, nil))}}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(stdout, "capsa metrics: serving http://%s/metrics\n", l.Addr())
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintf(stderr, "capsa metrics: %v\n", err)
		return 1
	}
	return 0
}

// slogErrorLog is promhttp's error log, on slog.
type slogErrorLog struct{ l *slog.Logger }

func (s slogErrorLog) Println(v ...any) { s.l.Error(fmt.Sprint(v...)) }

// sandboxCollector measures the running sandboxes at each scrape.
type sandboxCollector struct {
	ctx context.Context
	st  *store.Store

	mu      sync.Mutex // scrapes may come at once
	handles *statsHandles
}

func newSandboxCollector(ctx context.Context, st *store.Store) *sandboxCollector {
	return &sandboxCollector{ctx: ctx, st: st, handles: newStatsHandles(st)}
}

// metric describes one per-sandbox series and how to read it from Stats.
type metric struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(*sandbox.Stats) float64
}

func perSandbox(name, help string, kind prometheus.ValueType, value func(*sandbox.Stats) float64) metric {
	return metric{prometheus.NewDesc("capsa_sandbox_"+name, help, []string{"sandbox"}, nil), kind, value}
}

var (
	sandboxMetrics = []metric{
		perSandbox("cpu_seconds_total", "CPU time of the sandbox's vCPU threads.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return s.CPUTime.Seconds() }),
		perSandbox("vcpus", "vCPUs of the sandbox.", prometheus.GaugeValue,
			func(s *sandbox.Stats) float64 { return float64(s.CPUs) }),
		perSandbox("memory_resident_bytes", "Guest memory the host holds now.", prometheus.GaugeValue,
			func(s *sandbox.Stats) float64 { return float64(s.MemoryResident) }),
		perSandbox("memory_bytes", "Guest memory configured.", prometheus.GaugeValue,
			func(s *sandbox.Stats) float64 { return float64(s.MemoryBytes) }),
		perSandbox("uptime_seconds", "Time since the sandbox started.", prometheus.GaugeValue,
			func(s *sandbox.Stats) float64 { return s.Uptime.Seconds() }),
		perSandbox("network_receive_bytes_total", "Bytes the guest received.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.NetRxBytes) }),
		perSandbox("network_receive_packets_total", "Frames the guest received.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.NetRxPackets) }),
		perSandbox("network_transmit_bytes_total", "Bytes the guest sent.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.NetTxBytes) }),
		perSandbox("network_transmit_packets_total", "Frames the guest sent.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.NetTxPackets) }),
		perSandbox("disk_read_bytes_total", "Bytes the guest read from its disks.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.DiskReadBytes) }),
		perSandbox("disk_reads_total", "Read requests of the guest's disks.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.DiskReads) }),
		perSandbox("disk_write_bytes_total", "Bytes the guest wrote to its disks.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.DiskWriteBytes) }),
		perSandbox("disk_writes_total", "Write requests of the guest's disks.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.DiskWrites) }),
		perSandbox("vm_exits_total", "VM exits to capsa.", prometheus.CounterValue,
			func(s *sandbox.Stats) float64 { return float64(s.Exits) }),
	}
	sandboxUp = prometheus.NewDesc("capsa_sandbox_up", "1 if the running sandbox could be measured at this scrape.",
		[]string{"sandbox"}, nil)
	sandboxesDesc = prometheus.NewDesc("capsa_sandboxes", "Detached sandboxes recorded, by state.",
		[]string{"state"}, nil)
)

func (c *sandboxCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range sandboxMetrics {
		ch <- m.desc
	}
	ch <- sandboxUp
	ch <- sandboxesDesc
}

// scrapeTimeout bounds one sandbox's measurement.
const scrapeTimeout = 5 * time.Second

func (c *sandboxCollector) Collect(ch chan<- prometheus.Metric) {
	recs, err := c.st.List()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(sandboxesDesc, err)
		return
	}
	states := map[store.State]int{store.Created: 0, store.Creating: 0, store.Running: 0, store.Paused: 0, store.Exited: 0, store.Crashed: 0}
	running := map[string]bool{}
	for _, r := range recs {
		states[r.State]++
		if r.State == store.Running {
			running[r.Name] = true
		}
	}
	for s, n := range states {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(n), string(s))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.handles.keep(running)
	for name := range running {
		ctx, cancel := context.WithTimeout(c.ctx, scrapeTimeout)
		s, err := c.handles.stats(ctx, name)
		cancel()
		if err != nil {
			ch <- prometheus.MustNewConstMetric(sandboxUp, prometheus.GaugeValue, 0, name)
			continue
		}
		ch <- prometheus.MustNewConstMetric(sandboxUp, prometheus.GaugeValue, 1, name)
		for _, m := range sandboxMetrics {
			ch <- prometheus.MustNewConstMetric(m.desc, m.kind, m.value(s), name)
		}
	}
}
