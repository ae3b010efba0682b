package supervisor

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// The log keeps at most its bound on disk, in two files, and always the
// newest output.
func TestRotatingLog(t *testing.T) {
	path := filepath.Join(t.TempDir(), "main.log")
	l, err := newRotatingLog(path, 1000)
	if err != nil {
		t.Fatal(err)
	}
	var all bytes.Buffer
	for i := range 200 {
		line := fmt.Sprintf("line %03d\n", i)
		all.WriteString(line)
		if n, err := l.Write([]byte(line)); n != len(line) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", line, n, err)
		}
	}
	big := bytes.Repeat([]byte("x"), 5000)
	big[len(big)-1] = 'E'
	if n, err := l.Write(big); n != len(big) || err != nil {
		t.Fatalf("Write(5000 bytes) = %d, %v", n, err)
	}
	l.Close()
	cur, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	old, err := os.ReadFile(path + ".1")
	if err != nil {
		t.Fatal(err)
	}
	if len(cur) > 500 || len(old) > 500 {
		t.Errorf("log files of %d and %d bytes, want at most 500 each", len(cur), len(old))
	}
	if cur[len(cur)-1] != 'E' {
		t.Errorf("the newest byte is %q, want the last one written", cur[len(cur)-1])
	}
	if !bytes.HasSuffix(all.Bytes(), old) {
		t.Errorf("the rotated file %q is not the tail of the lines written before the big write", old)
	}
}

func TestLastLines(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"a\nb\nc\n", 2, "b\nc\n"},
		{"a\nb\nc", 2, "b\nc"},
		{"a\nb\n", 5, "a\nb\n"},
		{"a\nb\n", 0, ""},
		{"", 3, ""},
	} {
		if got := string(lastLines([]byte(tc.in), tc.n)); got != tc.want {
			t.Errorf("lastLines(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}

// TestLogStart: following a log's last lines starts at the beginning of a
// line still being written, so that it comes out whole (capsa logs -f
// --tail 0 once printed the end of one as a line of its own).
func TestLogStart(t *testing.T) {
	for _, tc := range []struct {
		old, cur   string
		lines      int
		follow     bool
		want       string
		wantOffset int64
	}{
		{"", "a\nb\ntick", 0, true, "", 4},
		{"", "a\nb\ntick", 1, true, "b\n", 4},
		{"", "a\nb\ntick", 1, false, "tick", 8},
		{"", "a\nb\n", 0, true, "", 4},
		{"", "a\nb\ntick", -1, true, "a\nb\ntick", 8},
		{"x\n", "a\ntick", 5, true, "x\na\n", 2},
		{"x\npart", "ial", 1, true, "x\n", 0},
	} {
		got, offset := logStart([]byte(tc.old), []byte(tc.cur), tc.lines, tc.follow)
		if string(got) != tc.want || offset != tc.wantOffset {
			t.Errorf("logStart(%q, %q, %d, %v) = %q, %d; want %q, %d", tc.old, tc.cur, tc.lines, tc.follow, got, offset, tc.want, tc.wantOffset)
		}
	}
}
