package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// BenchmarkCRIStart measures what a kubelet waits for when it starts a
// pod: crictl runp, create and start of a container, until the
// container's first output line is in its log, through containerd 1.6's
// CRI plugin with capsa's shim (runtime handler capsa: a microVM per
// pod, on the CNI bridge network) and, in the same run, with runc (the
// anchor: containers on the node's kernel). Each pod is stopped and
// removed after it is measured. pods/min is how many pods one after
// another would start in a minute at the measured median.
func BenchmarkCRIStart(b *testing.B) {
	e := startCRI(b, "containerd")
	dir := b.TempDir()
	for _, handler := range []string{"capsa", "runc"} {
		b.Run(handler, func(b *testing.B) {
			var samples []time.Duration
			n := 0
			for b.Loop() {
				n++
				logs := filepath.Join(dir, fmt.Sprintf("%s-%d", handler, n))
				pod := writeJSON(b, dir, fmt.Sprintf("pod-%s-%d.json", handler, n), map[string]any{
					"metadata":      map[string]any{"name": fmt.Sprintf("bench-%s-%d", handler, n), "namespace": "default", "uid": fmt.Sprintf("%s-%d", handler, n)},
					"log_directory": logs,
					"linux":         map[string]any{},
				})
				ctr := writeJSON(b, dir, fmt.Sprintf("ctr-%s-%d.json", handler, n), map[string]any{
					"metadata": map[string]any{"name": "first"},
					"image":    map[string]any{"image": "capsa.test/python:1"},
					"command":  []string{"sh", "-c", "echo first-output; exec sleep 1000"},
					"log_path": "first.log",
				})
				start := time.Now()
				podID := strings.TrimSpace(e.cri("", "runp", "--runtime", handler, pod))
				id := strings.TrimSpace(e.cri("", "create", podID, ctr, pod))
				e.cri("", "start", id)
				deadline := time.Now().Add(2 * time.Minute)
				for {
					if b, _ := os.ReadFile(filepath.Join(logs, "first.log")); strings.Contains(string(b), "first-output") {
						break
					}
					if time.Now().After(deadline) {
						b.Fatalf("%s: the container's log never showed its first output", handler)
					}
					time.Sleep(5 * time.Millisecond)
				}
				samples = append(samples, time.Since(start))
				e.cri("", "stopp", podID)
				e.cri("", "rmp", podID)
			}
			reportSpread(b, samples)
			median := samples[len(samples)/2]
			b.ReportMetric(float64(time.Minute)/float64(median), "pods/min")
		})
	}
}
