package e2e

import (
	"os"
	"os/exec"
	"regexp"
	"testing"
	"time"
)

// BenchmarkConfinement measures what confining the VMM process costs, with
// confinement and with --no-confine taking turns in each iteration so that
// both see the same host: `capsa run -- true` whole (start, confine, run,
// stop), `true` run by `capsa exec` in a detached sandbox of each kind,
// and the confining itself (capsa run --verbose logs how long Apply took).
func BenchmarkConfinement(b *testing.B) {
	dir := b.TempDir()
	b.Cleanup(func() { stopAll(b, dir) })
	capsaCmd := func(b *testing.B, args ...string) string {
		c := exec.Command(artifact(b, "capsa"), args...)
		c.Env = append(os.Environ(), "CAPSA_STATE="+dir)
		out, err := c.CombinedOutput()
		if err != nil {
			b.Fatalf("capsa %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	modes := []struct {
		name  string
		flags []string
	}{{"confined", nil}, {"unconfined", []string{"--no-confine"}}}
	took := regexp.MustCompile(`capsa run: confined.* took=([0-9.]+[µm]?s)`)
	b.Run("run-true", func(b *testing.B) {
		samples := map[string][]time.Duration{}
		var apply []time.Duration
		for i := 0; b.Loop(); i++ {
			for j := range modes {
				m := modes[(i+j)%2]
				start := time.Now()
				out := capsaCmd(b, append(append([]string{"run", "--memory", "256M", "--verbose"}, m.flags...), "--", "true")...)
				samples[m.name] = append(samples[m.name], time.Since(start))
				if sm := took.FindStringSubmatch(out); sm != nil {
					d, _ := time.ParseDuration(sm[1])
					apply = append(apply, d)
				}
			}
		}
		for _, m := range modes {
			reportSpreadAs(b, samples[m.name], m.name+"-")
		}
		if len(apply) == 0 {
			b.Fatal("capsa run --verbose did not log how long confining took")
		}
		reportSpreadAs(b, apply, "confine-")
	})
	for _, m := range modes {
		capsaCmd(b, append(append([]string{"run", "-d", "--name", m.name, "--memory", "256M"}, m.flags...), "--", "sleep", "100000")...)
	}
	b.Run("exec-true", func(b *testing.B) {
		samples := map[string][]time.Duration{}
		for i := 0; b.Loop(); i++ {
			for j := range modes {
				m := modes[(i+j)%2]
				start := time.Now()
				capsaCmd(b, "exec", m.name, "--", "true")
				samples[m.name] = append(samples[m.name], time.Since(start))
			}
		}
		for _, m := range modes {
			reportSpreadAs(b, samples[m.name], m.name+"-")
		}
	})
}
