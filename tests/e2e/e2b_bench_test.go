package e2e

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkE2BSDK measures capsa serve through E2B's JS SDK (e2b 2.51.0,
// Node 22), in one run: create to a command's first output from a
// pre-booted template against a cold boot of the same image (the
// anchor); a commands.run('true') round trip against `capsa exec NAME --
// true` on the same sandbox (the anchor); and 8 creates at once from the
// pre-booted template, wall time. Each sample is timed in Node, around
// the SDK's calls.
func BenchmarkE2BSDK(b *testing.B) {
	dir := b.TempDir()
	cli := func(timeout time.Duration, args ...string) result {
		return capsaWith(b, timeout, func(c *exec.Cmd) { c.Env = append(os.Environ(), "CAPSA_STATE="+dir) }, args...)
	}
	b.Cleanup(func() { stopAll(b, dir) })
	ref := e2bImage(b)
	r := cli(time.Minute, "serve", "key", "create")
	key := strings.TrimSpace(r.stdout)
	if r.code != 0 {
		b.Fatalf("capsa serve key create: exit %d, %q", r.code, r.stderr)
	}
	if r := cli(5*time.Minute, "template", "create", "pre", "--image", ref, "--preboot"); r.code != 0 {
		b.Fatalf("capsa template create pre --preboot: exit %d, %q", r.code, r.stderr)
	}
	addr := freeAddr(b)
	startServe(b, dir, addr)
	env := []string{"E2B_API_URL=http://" + addr, "E2B_SANDBOX_URL=http://" + addr, "E2B_API_KEY=" + key, "TEMPLATE=" + ref}

	node, script := nodeScript(b, "e2b-client.mjs", e2bClientScript)
	cmd := exec.Command(node, script, "bench")
	cmd.Env = append(os.Environ(), env...)
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { in.Close(); cmd.Wait() }()
	out := bufio.NewScanner(outp)
	ask := func(b *testing.B, line string) string {
		b.Helper()
		if _, err := io.WriteString(in, line+"\n"); err != nil {
			b.Fatal(err)
		}
		if !out.Scan() {
			b.Fatalf("%s: the client ended: %v", line, out.Err())
		}
		return out.Text()
	}
	sample := func(b *testing.B, line string) time.Duration {
		b.Helper()
		ans := ask(b, line)
		ms, ok := strings.CutPrefix(ans, "ms ")
		f, err := strconv.ParseFloat(ms, 64)
		if !ok || err != nil {
			b.Fatalf("%s: %s", line, ans)
		}
		return time.Duration(f * float64(time.Millisecond))
	}
	medians := map[string]time.Duration{}
	timed := func(name, line string, anchor func() time.Duration) {
		b.Run(name, func(b *testing.B) {
			var samples []time.Duration
			for b.Loop() {
				if anchor != nil {
					samples = append(samples, anchor())
				} else {
					samples = append(samples, sample(b, line))
				}
			}
			reportSpread(b, samples)
			medians[name] = median(samples)
		})
	}
	timed("create-to-first-output-cold", "first-output "+ref, nil)
	timed("create-to-first-output-prebooted", "first-output pre", nil)
	id, ok := strings.CutPrefix(ask(b, "keep pre"), "id ")
	if !ok {
		b.Fatalf("keep pre: no sandbox")
	}
	timed("commands-run-true", "run-true", nil)
	timed("capsa-exec-true", "", func() time.Duration {
		t0 := time.Now()
		if r := cli(time.Minute, "exec", id, "--", "true"); r.code != 0 {
			b.Fatalf("capsa exec %s -- true: exit %d, %q", id, r.code, r.stderr)
		}
		return time.Since(t0)
	})
	timed("8-concurrent-creates-prebooted", "concurrent pre 8", nil)
	ratio := func(a, of string) string {
		if medians[of] == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", float64(medians[a])/float64(medians[of]))
	}
	fmt.Printf("BenchmarkE2BSDK ratios of medians: pre-booted/cold create-to-first-output %s; commands.run('true')/capsa exec true %s\n",
		ratio("create-to-first-output-prebooted", "create-to-first-output-cold"), ratio("commands-run-true", "capsa-exec-true"))
}

// median is samples' median.
func median(samples []time.Duration) time.Duration {
	s := slices.Clone(samples)
	slices.Sort(s)
	return s[len(s)/2]
}
