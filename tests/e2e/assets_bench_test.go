package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// BenchmarkRunTrue measures `capsa run -- true` whole (start, boot, run,
// stop), taking turns in each iteration between: the kernel and initramfs
// given as uncompressed files (--kernel, --initrd: what the binary read
// before its assets were compressed), the built-in set with its unpacked
// copies in the cache (every run but a machine's first), and the built-in
// set decompressed (a fresh cache each time: a machine's first run). Given
// another capsa binary as the artifact capsa-before (one built before a
// change), it takes turns with its built-in kernel and initramfs too.
func BenchmarkRunTrue(b *testing.B) {
	bin := artifact(b, "capsa")
	kernel, initrd := artifact(b, "vmlinux"), artifact(b, "initramfs.cpio")
	state, warm := b.TempDir(), b.TempDir()
	type mode struct {
		name, bin string
		flags     []string
		cache     func() string
	}
	modes := []mode{
		{"files", bin, []string{"--kernel", kernel, "--initrd", initrd}, func() string { return warm }},
		{"builtin-unpacked", bin, nil, func() string { return warm }},
		{"builtin-decompress", bin, nil, func() string { return b.TempDir() }},
	}
	if before, err := filepath.Abs(filepath.Join(artifactDir(), "capsa-before")); err == nil && fileExists(before) {
		modes = append(modes, mode{"before", before, nil, func() string { return warm }})
	}
	runTrue := func(bin string, flags []string, cache string) time.Duration {
		cmd := exec.Command(bin, append(append([]string{"run", "--memory", "256M"}, flags...), "--", "true")...)
		cmd.Env = append(os.Environ(), "CAPSA_STATE="+state, "CAPSA_CACHE="+cache)
		start := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("capsa run %v: %v\n%s", flags, err, out)
		}
		return time.Since(start)
	}
	runTrue(bin, nil, warm) // unpacks the set into warm
	samples := map[string][]time.Duration{}
	for i := 0; b.Loop(); i++ {
		for j := range modes {
			m := modes[(i+j)%len(modes)]
			samples[m.name] = append(samples[m.name], runTrue(m.bin, m.flags, m.cache()))
		}
	}
	for _, m := range modes {
		reportSpreadAs(b, samples[m.name], m.name+"-")
	}
	if st, err := os.Stat(bin); err == nil {
		b.ReportMetric(float64(st.Size())/1e6, "capsa-MB")
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
