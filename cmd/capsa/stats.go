package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// statsRow is one sandbox's line of `capsa stats`.
type statsRow struct {
	Name       string  `json:"name"`
	CPUPercent float64 `json:"cpu_percent"`
	// VMMCPUPercent is the VMM's own threads' (I/O, NAT), beside the
	// vCPUs'.
	VMMCPUPercent float64 `json:"vmm_cpu_percent"`
	*sandbox.Stats
	Err string `json:"error,omitempty"`
}

// statsSample is the interval over which --no-stream measures CPU use.
const statsSample = 500 * time.Millisecond

func runStats(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("stats", "[flags] [NAME...]", stdout)
	noStream := fs.Bool("no-stream", false, "print one measurement and exit")
	format := fs.String("format", "table", "table or json")
	interval := fs.Duration("interval", time.Second, "time between measurements")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	fail := func(code int, format string, a ...any) int {
		fmt.Fprintf(stderr, "capsa stats: "+format+"\n", a...)
		return code
	}
	if *format != "table" && *format != "json" {
		return fail(2, "--format %q: want table or json", *format)
	}
	if *interval < 100*time.Millisecond {
		return fail(2, "--interval %v: must be at least 100ms", *interval)
	}
	m, err := openManager()
	if err != nil {
		return fail(1, "%v", err)
	}
	names := fs.Args()
	all := len(names) == 0
	for _, n := range names {
		if _, err := m.Get(n); err != nil {
			return fail(1, "%v", err)
		}
	}
	clear := !*noStream && *format == "table" && isTerminal(stdout)
	prev := map[string]*sandbox.Stats{}
	// measure takes one round; rows for names that stopped say so.
	measure := func() []statsRow {
		if all {
			names = names[:0]
			recs, err := m.List()
			if err != nil {
				return []statsRow{{Err: err.Error()}}
			}
			running := map[string]bool{}
			for _, r := range recs {
				if r.State == supervisor.Running {
					names = append(names, r.Name)
					running[r.Name] = true
				}
			}
			for n := range prev { // sandboxes that ended since
				if !running[n] {
					delete(prev, n)
				}
			}
		}
		rows := make([]statsRow, 0, len(names))
		for _, n := range names {
			row := statsRow{Name: n}
			var err error
			if row.Stats, err = m.Stats(ctx, n); err != nil {
				row.Err = err.Error()
				delete(prev, n)
			} else {
				row.CPUPercent = sandbox.CPUPercent(prev[n], row.Stats)
				row.VMMCPUPercent = sandbox.VMMCPUPercent(prev[n], row.Stats)
				prev[n] = row.Stats
			}
			rows = append(rows, row)
		}
		return rows
	}
	if *noStream {
		// CPU use is a rate: it needs two measurements.
		measure()
		select {
		case <-ctx.Done():
			return 130
		case <-time.After(statsSample):
		}
		return printStats(stdout, measure(), *format, false)
	}
	measure()
	tick := time.NewTicker(*interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return 0
		case <-tick.C:
		}
		printStats(stdout, measure(), *format, clear)
	}
}

// printStats prints one round; its exit code is 1 if a sandbox could not
// be measured.
func printStats(w io.Writer, rows []statsRow, format string, clear bool) int {
	code := 0
	for _, r := range rows {
		if r.Err != "" {
			code = 1
		}
	}
	if format == "json" {
		json.NewEncoder(w).Encode(rows)
		return code
	}
	if clear {
		fmt.Fprint(w, "\033[2J\033[H")
	}
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCPU %\tVMM CPU %\tMEM USAGE / LIMIT\tMEM %\tNET I/O\tBLOCK I/O\tUPTIME")
	for _, r := range rows {
		if r.Err != "" {
			fmt.Fprintf(tw, "%s\t%s\n", r.Name, r.Err)
			continue
		}
		s := r.Stats
		memPct := 0.0
		if s.MemoryBytes > 0 {
			memPct = 100 * float64(s.MemoryResident) / float64(s.MemoryBytes)
		}
		fmt.Fprintf(tw, "%s\t%.1f%%\t%.1f%%\t%s / %s\t%.1f%%\t%s / %s\t%s / %s\t%s\n", r.Name, r.CPUPercent, r.VMMCPUPercent,
			humanBytes(s.MemoryResident), humanBytes(s.MemoryBytes), memPct,
			humanBytes(s.NetRxBytes), humanBytes(s.NetTxBytes),
			humanBytes(s.DiskReadBytes), humanBytes(s.DiskWriteBytes), s.Uptime.Round(time.Second))
	}
	tw.Flush()
	return code
}

// humanBytes writes a byte count as B, KiB, MiB or GiB.
func humanBytes(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2fGiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1fKiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%dB", n)
}
