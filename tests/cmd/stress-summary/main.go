// Command stress-summary adds up the runs of `make stress` over the logs of
// one or more nested host sessions and prints, per phase and VMM, how many
// runs ended how.
//
// TestStress prints "stress-start: PHASE|VMM" before each run and
// "stress-result: PHASE|VMM|OUTCOME" after it. When the nested host's L1
// kernel crashes (capsa-nested says "nested L1 host kernel crashed"), the
// run that had started and not ended is counted as an "l1-crash" of the
// VMM that was running: under TCG's emulated SVM a failure can land on L1
// instead of the guest, and it belongs to the load that provoked it.
//
//	stress-summary [-fail-if-worse VMM,CONTROL] LOG...
//
// With -fail-if-worse, it exits 1 when VMM's failure rate in any phase is
// above CONTROL's.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

const (
	startPrefix  = "stress-start: "
	resultPrefix = "stress-result: "
	l1Crash      = "nested L1 host kernel crashed"
	l1Outcome    = "l1-crash"
)

// counts is phase -> VMM -> outcome -> runs.
type counts map[string]map[string]map[string]int

func (c counts) add(phase, vmm, outcome string) {
	if c[phase] == nil {
		c[phase] = map[string]map[string]int{}
	}
	if c[phase][vmm] == nil {
		c[phase][vmm] = map[string]int{}
	}
	c[phase][vmm][outcome]++
}

// read adds one log's runs.
func (c counts) read(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var open []string // phase, VMM of the run under way
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, startPrefix):
			open = strings.SplitN(strings.TrimPrefix(line, startPrefix), "|", 2)
		case strings.HasPrefix(line, resultPrefix):
			f := strings.SplitN(strings.TrimPrefix(line, resultPrefix), "|", 3)
			if len(f) == 3 {
				c.add(f[0], f[1], f[2])
			}
			open = nil
		case strings.Contains(line, l1Crash):
			if len(open) == 2 {
				c.add(open[0], open[1], l1Outcome)
			}
			open = nil
		}
	}
	return sc.Err()
}

func runs(m map[string]int) (total, failed int) {
	for o, n := range m {
		total += n
		if o != "ok" {
			failed += n
		}
	}
	return total, failed
}

// print writes the table, phases and VMMs in a stable order.
func (c counts) print(w io.Writer) {
	phases := make([]string, 0, len(c))
	for p := range c {
		phases = append(phases, p)
	}
	slices.Sort(phases)
	for _, p := range phases {
		vmms := make([]string, 0, len(c[p]))
		for v := range c[p] {
			vmms = append(vmms, v)
		}
		slices.Sort(vmms)
		for _, v := range vmms {
			total, failed := runs(c[p][v])
			var kinds []string
			for o, n := range c[p][v] {
				if o != "ok" {
					kinds = append(kinds, fmt.Sprintf("%d %s", n, o))
				}
			}
			slices.Sort(kinds)
			fmt.Fprintf(w, "%-36s %-18s %4d runs %4d failed (%5.1f%%) %s\n", p, v, total, failed,
				100*float64(failed)/float64(max(total, 1)), strings.Join(kinds, ", "))
		}
	}
}

// worse lists the phases where vmm failed more often than control.
func (c counts) worse(vmm, control string) []string {
	var out []string
	for p, byVMM := range c {
		t, f := runs(byVMM[vmm])
		ct, cf := runs(byVMM[control])
		if t > 0 && ct > 0 && float64(f)/float64(t) > float64(cf)/float64(ct) {
			out = append(out, fmt.Sprintf("%s: %s failed %d of %d, %s %d of %d", p, vmm, f, t, control, cf, ct))
		}
	}
	slices.Sort(out)
	return out
}

func main() {
	failIfWorse := flag.String("fail-if-worse", "", "VMM,CONTROL: exit 1 if VMM fails more often than CONTROL in a phase")
	flag.Parse()
	c := counts{}
	for _, name := range flag.Args() {
		f, err := os.Open(name)
		if err != nil {
			fmt.Fprintf(os.Stderr, "stress-summary: %v\n", err)
			os.Exit(2)
		}
		err = c.read(f)
		f.Close()
		if err != nil {
			fmt.Fprintf(os.Stderr, "stress-summary: %s: %v\n", name, err)
			os.Exit(2)
		}
	}
	c.print(os.Stdout)
	if *failIfWorse != "" {
		vmm, control, ok := strings.Cut(*failIfWorse, ",")
		if !ok {
			fmt.Fprintln(os.Stderr, "stress-summary: -fail-if-worse takes VMM,CONTROL")
			os.Exit(2)
		}
		if w := c.worse(vmm, control); len(w) > 0 {
			fmt.Printf("stress-summary: %s fails more often than %s:\n  %s\n", vmm, control, strings.Join(w, "\n  "))
			os.Exit(1)
		}
	}
}
