package vmm

import (
	"bytes"
	"testing"
)

func TestConsoleWatch(t *testing.T) {
	for _, tc := range []struct {
		name   string
		chunks []string
		panic  string
	}{
		{"quiet boot", []string{"hello\n", "world\n"}, ""},
		{"panic split across writes", []string{"[    1.2] Kernel pa", "nic - not syncing: Attempted to kill init! exitcode=0x00000300\r\n", "more\n"},
			"Attempted to kill init! exitcode=0x00000300"},
		{"first panic wins", []string{"Kernel panic - not syncing: one\nKernel panic - not syncing: two\n"}, "one"},
		{"unterminated", []string{"Kernel panic - not syncing: VFS: Unable to mount root fs"}, "VFS: Unable to mount root fs"},
		{"banner in a long line is still seen", []string{string(bytes.Repeat([]byte("x"), 100)) + "Kernel panic - not syncing: late\n"}, "late"},
	} {
		var out bytes.Buffer
		c := &consoleWatch{out: &out}
		var all string
		for _, ch := range tc.chunks {
			c.Write([]byte(ch))
			all += ch
		}
		got, ok := c.Panic()
		if got != tc.panic || ok != (tc.panic != "") {
			t.Errorf("%s: Panic() = %q, %v; want %q", tc.name, got, ok, tc.panic)
		}
		if out.String() != all {
			t.Errorf("%s: output not passed through", tc.name)
		}
	}
}
