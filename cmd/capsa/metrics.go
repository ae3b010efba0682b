package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/internal/bearer"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// metricsTokenEnv gives `capsa metrics` its bearer token (else it makes
// one and prints it).
const metricsTokenEnv = "CAPSA_METRICS_TOKEN"

// runMetrics serves every detached sandbox's use as Prometheus metrics,
// labelled by sandbox name, measured at each scrape.
//
// The exposition is Prometheus's text format (version 0.0.4), written
// here: client_golang would bring protobuf and 2.3 MB to the binary (of
// the 25 MB it may weigh) for fifteen series.
func runMetrics(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("metrics", "[flags]", stdout)
	listen := fs.String("listen", "127.0.0.1:9464", "serve /metrics on this TCP address (port 0: any free port), for clients with the bearer token it prints (or CAPSA_METRICS_TOKEN's); or unix:PATH, a socket only this user may open")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 0 {
		fmt.Fprintln(stderr, "capsa metrics: takes no arguments")
		return 2
	}
	m, err := openManager()
	if err != nil {
		fmt.Fprintf(stderr, "capsa metrics: %v\n", err)
		return 1
	}
	c := newSandboxCollector(ctx, m)
	mux := http.NewServeMux()
	mux.Handle("/metrics", c.handler(slog.New(slog.NewTextHandler(stderr, nil))))
	var handler http.Handler = mux
	var l net.Listener
	if path, ok := strings.CutPrefix(*listen, "unix:"); ok {
		// The socket's mode is what guards it: this user's only.
		os.Remove(path)
		if l, err = net.Listen("unix", path); err == nil {
			if err = os.Chmod(path, 0o600); err != nil {
				l.Close()
			}
		}
		if err != nil {
			fmt.Fprintf(stderr, "capsa metrics: --listen: %v\n", err)
			return 2
		}
		fmt.Fprintf(stdout, "capsa metrics: serving unix:%s /metrics\n", path)
	} else {
		// A TCP port is open to every local user and, through the NAT's
		// gateway, to a guest allowed everything: only the token's
		// holder reads the sandboxes' use.
		if l, err = net.Listen("tcp", *listen); err != nil {
			fmt.Fprintf(stderr, "capsa metrics: --listen: %v\n", err)
			return 2
		}
		token, given := os.LookupEnv(metricsTokenEnv)
		if !given || token == "" {
			token = bearer.NewToken()
		}
		handler = bearer.Guard(mux, token, "capsa metrics", "capsa metrics: want the bearer token capsa metrics printed (or was given in "+metricsTokenEnv+")")
		if given {
			fmt.Fprintf(stdout, "capsa metrics: serving http://%s/metrics (the bearer token is %s's)\n", l.Addr(), metricsTokenEnv)
		} else {
			fmt.Fprintf(stdout, "capsa metrics: serving http://%s/metrics (header Authorization: Bearer %s)\n", l.Addr(), token)
		}
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
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

// sandboxCollector measures the running sandboxes at each scrape.
type sandboxCollector struct {
	ctx context.Context
	m   *supervisor.Manager

	mu sync.Mutex // scrapes may come at once: one measures at a time
}

func newSandboxCollector(ctx context.Context, m *supervisor.Manager) *sandboxCollector {
	return &sandboxCollector{ctx: ctx, m: m}
}

// metric describes one per-sandbox series and how to read it from Stats.
type metric struct {
	family
	value func(*sandbox.Stats) float64
}

func perSandbox(name, help, kind string, value func(*sandbox.Stats) float64) metric {
	return metric{family{name: "capsa_sandbox_" + name, help: help, kind: kind, label: "sandbox"}, value}
}

// family is a metric family of the exposition: its samples differ by one
// label.
type family struct {
	name, help, kind, label string // kind: counter or gauge
	samples                 []sample
}

type sample struct {
	label string
	value float64
	// more is further labels, written out: `,kind="tcp"` (escaped).
	more string
}

var (
	sandboxMetrics = []metric{
		perSandbox("cpu_seconds_total", "CPU time of the sandbox's vCPU threads.", "counter",
			func(s *sandbox.Stats) float64 { return s.CPUTime.Seconds() }),
		perSandbox("vcpus", "vCPUs of the sandbox.", "gauge",
			func(s *sandbox.Stats) float64 { return float64(s.CPUs) }),
		perSandbox("memory_resident_bytes", "Guest memory the host holds now.", "gauge",
			func(s *sandbox.Stats) float64 { return float64(s.MemoryResident) }),
		perSandbox("memory_bytes", "Guest memory configured.", "gauge",
			func(s *sandbox.Stats) float64 { return float64(s.MemoryBytes) }),
		perSandbox("memory_returned_bytes_total", "Guest memory the guest reported free and the host discarded (free memory it never held included).", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.MemoryReturned) }),
		perSandbox("uptime_seconds", "Time since the sandbox started.", "gauge",
			func(s *sandbox.Stats) float64 { return s.Uptime.Seconds() }),
		perSandbox("network_receive_bytes_total", "Bytes the guest received.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.NetRxBytes) }),
		perSandbox("network_receive_packets_total", "Frames the guest received.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.NetRxPackets) }),
		perSandbox("network_transmit_bytes_total", "Bytes the guest sent.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.NetTxBytes) }),
		perSandbox("network_transmit_packets_total", "Frames the guest sent.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.NetTxPackets) }),
		perSandbox("disk_read_bytes_total", "Bytes the guest read from its disks.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.DiskReadBytes) }),
		perSandbox("disk_reads_total", "Read requests of the guest's disks.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.DiskReads) }),
		perSandbox("disk_write_bytes_total", "Bytes the guest wrote to its disks.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.DiskWriteBytes) }),
		perSandbox("disk_writes_total", "Write requests of the guest's disks.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.DiskWrites) }),
		perSandbox("vm_exits_total", "VM exits to capsa.", "counter",
			func(s *sandbox.Stats) float64 { return float64(s.Exits) }),
	}
	sandboxUp = family{name: "capsa_sandbox_up", help: "1 if the running sandbox could be measured at this scrape.",
		kind: "gauge", label: "sandbox"}
	sandboxesByState = family{name: "capsa_sandboxes", help: "Detached sandboxes recorded, by state.", kind: "gauge", label: "state"}
	sandboxFlows     = family{name: "capsa_sandbox_net_flows_total", help: "DNS queries, TCP connections and UDP flows of the sandbox, by kind, verdict and the network policy's rule that decided.",
		kind: "counter", label: "sandbox"}
)

// scrapeTimeout bounds one sandbox's measurement.
const scrapeTimeout = 5 * time.Second

// handler serves the exposition; a failure to list the sandboxes is a 500.
func (c *sandboxCollector) handler(log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fams, err := c.collect()
		if err != nil {
			log.Error("capsa metrics: scrape", "err", err)
			http.Error(w, "capsa metrics: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		writeExposition(w, fams)
	})
}

// collect measures every running sandbox.
func (c *sandboxCollector) collect() ([]family, error) {
	recs, err := c.m.List()
	if err != nil {
		return nil, err
	}
	states := map[supervisor.State]int{supervisor.Created: 0, supervisor.Creating: 0, supervisor.Running: 0, supervisor.Paused: 0, supervisor.Suspended: 0, supervisor.Exited: 0, supervisor.Crashed: 0}
	running := map[string]bool{}
	for _, r := range recs {
		states[r.State]++
		if r.State == supervisor.Running {
			running[r.Name] = true
		}
	}
	sandboxes := sandboxesByState
	for s, n := range states {
		sandboxes.samples = append(sandboxes.samples, sample{label: string(s), value: float64(n)})
	}
	up, flows := sandboxUp, sandboxFlows
	per := make([]family, len(sandboxMetrics))
	for i, m := range sandboxMetrics {
		per[i] = m.family
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for name := range running {
		ctx, cancel := context.WithTimeout(c.ctx, scrapeTimeout)
		s, err := c.m.Stats(ctx, name)
		cancel()
		if err != nil {
			up.samples = append(up.samples, sample{label: name, value: 0})
			continue
		}
		up.samples = append(up.samples, sample{label: name, value: 1})
		for i, m := range sandboxMetrics {
			per[i].samples = append(per[i].samples, sample{label: name, value: m.value(s)})
		}
		for _, f := range s.NetFlows {
			verdict := "refused"
			if f.Allowed {
				verdict = "allowed"
			}
			more := fmt.Sprintf(`,kind="%s",verdict="%s",rule="%s"`, labelEscaper.Replace(f.Kind), verdict, labelEscaper.Replace(f.Rule))
			flows.samples = append(flows.samples, sample{label: name, value: float64(f.Count), more: more})
		}
	}
	return append(append([]family{sandboxes, up}, per...), flows), nil
}

// writeExposition writes fams in the text format, samples in label order;
// a family with no samples is left out, as client_golang does.
func writeExposition(w io.Writer, fams []family) error {
	var b strings.Builder
	for _, f := range fams {
		if len(f.samples) == 0 {
			continue
		}
		slices.SortFunc(f.samples, func(a, b sample) int { return strings.Compare(a.label+a.more, b.label+b.more) })
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", f.name, helpEscaper.Replace(f.help), f.name, f.kind)
		for _, s := range f.samples {
			fmt.Fprintf(&b, "%s{%s=\"%s\"%s} %s\n", f.name, f.label, labelEscaper.Replace(s.label), s.more, formatValue(s.value))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// The text format's escapes: a help text's backslashes and line feeds, a
// label value's double quotes too.
var (
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
	labelEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)
)

func formatValue(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}
