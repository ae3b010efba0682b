package stressload

import (
	"bytes"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/iotest"
)

func TestPatternIsTheSameWhateverTheReadSizes(t *testing.T) {
	whole, _ := io.ReadAll(Pattern(7, 1001))
	if len(whole) != 1001 {
		t.Fatalf("Pattern(7, 1001) gave %d bytes", len(whole))
	}
	bytewise, _ := io.ReadAll(iotest.OneByteReader(Pattern(7, 1001)))
	if !bytes.Equal(whole, bytewise) {
		t.Error("Pattern(7, 1001) read a byte at a time differs from one read")
	}
	other, _ := io.ReadAll(Pattern(8, 1001))
	if bytes.Equal(whole, other) {
		t.Error("Pattern(7) = Pattern(8)")
	}
}

func TestConfigRoundTrip(t *testing.T) {
	c := Config{Work: []string{"9p", "net"}, Dir: "/mnt", Addr: "10.0.2.2:4000", Bytes: 1 << 20}
	got, err := Parse(c.String())
	if err != nil || got.String() != c.String() {
		t.Errorf("Parse(%q) = %v, %v", c, got, err)
	}
	for _, bad := range []string{"work", "bytes=-1", "colour=red"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) succeeded", bad)
		}
	}
}

// TestRunAndCheck runs the guest side against a real host server on
// loopback and a real directory, and checks that Check accepts the result
// and rejects a tampered one.
func TestRunAndCheck(t *testing.T) {
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "tree", "a"), 0o755)
	os.WriteFile(filepath.Join(dir, "tree", "a", "x"), []byte("x"), 0o644)
	os.WriteFile(filepath.Join(dir, "tree", "y"), []byte("yy"), 0o644)
	big, _ := io.ReadAll(Pattern(3, 3<<20+5))
	os.WriteFile(filepath.Join(dir, "big.bin"), big, 0o644)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go ServeConn(c, 1<<30)
		}
	}()
	c := Config{Work: []string{"9p", "net"}, Dir: dir, Addr: l.Addr().String(), Bytes: 1<<20 + 3}
	var out strings.Builder
	if err := Run(c, &out); err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	if err := Check(c, out.String(), dir); err != nil {
		t.Errorf("Check of a good run: %v\n%s", err, out.String())
	}
	if r := Results(out.String()); r["hash"] == "" || !strings.Contains(r["hash"], "files 2 bytes 3") {
		t.Errorf("hash result %q", r["hash"])
	}
	bad := strings.Replace(out.String(), "capsa-stress: done", "", 1)
	if err := Check(c, bad, dir); err == nil {
		t.Error("Check accepted output without done")
	}
	os.WriteFile(filepath.Join(dir, "out.bin"), big[:100], 0o644)
	if err := Check(c, out.String(), dir); err == nil {
		t.Error("Check accepted a short out.bin")
	}
}
