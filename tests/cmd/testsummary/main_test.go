package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSummarize(t *testing.T) {
	events := `{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestA","Output":"--- PASS: TestA\n"}
{"Action":"pass","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestB","Output":"b.go:1: no kvm\n"}
{"Action":"skip","Package":"p","Test":"TestB"}
{"Action":"output","Package":"p","Test":"TestC/sub","Output":"c.go:9: broke\n"}
{"Action":"fail","Package":"p","Test":"TestC/sub"}
{"Action":"fail","Package":"p","Test":"TestC"}
{"Action":"output","Package":"p","Output":"FAIL\tp\t0.1s\n"}
{"Action":"fail","Package":"p"}
{"Action":"output","Package":"q","Test":"TestD","Output":"d.go:2: root only\n"}
{"Action":"skip","Package":"q","Test":"TestD"}
{"Action":"output","Package":"q","Output":"ok  \tq\t0.1s\n"}
{"Action":"pass","Package":"q"}
`
	var out bytes.Buffer
	s, err := summarize(strings.NewReader(events), &out, map[string]bool{"p TestB": true})
	if err != nil {
		t.Fatal(err)
	}
	if s.passed != 1 || s.failed != 2 || s.skipped != 2 || s.ok() {
		t.Errorf("summary %+v; want 1 passed, 2 failed, 2 skipped, not ok", s)
	}
	if len(s.unexpected) != 1 || s.unexpected[0] != "q TestD" {
		t.Errorf("unexpected skips %q; want q TestD", s.unexpected)
	}
	for _, want := range []string{"c.go:9: broke", "d.go:2: root only", "FAIL\tp\t0.1s", "ok  \tq\t0.1s"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "no kvm") {
		t.Errorf("an expected skip's output was shown:\n%s", out.String())
	}
	if s, _ := summarize(strings.NewReader(events), &out, map[string]bool{"p TestB": true, "q TestD": true}); len(s.unexpected) != 0 {
		t.Errorf("with both skips expected: %q", s.unexpected)
	}
	if s, _ := summarize(strings.NewReader(events), &out, map[string]bool{"p *": true, "q *": true}); len(s.unexpected) != 0 {
		t.Errorf("with both packages' skips expected: %q", s.unexpected)
	}
}

func TestReadExpected(t *testing.T) {
	p := filepath.Join(t.TempDir(), "skips")
	os.WriteFile(p, []byte("# comment\np TestB: no KVM here\n\nq  TestD/sub: as root\n"), 0o644)
	m, err := readExpected(p, true)
	if err != nil || len(m) != 2 || !m["p TestB"] || !m["q TestD/sub"] {
		t.Errorf("readExpected = %v, %v", m, err)
	}
	os.WriteFile(p, []byte("p TestB\n"), 0o644)
	if _, err := readExpected(p, true); err == nil {
		t.Error("a line without a reason was taken")
	}
	// A skip expected only where there is no /dev/kvm.
	os.WriteFile(p, []byte("p TestB: always\nk TestK without-kvm: its KVM tests need one\n"), 0o644)
	if m, err := readExpected(p, true); err != nil || len(m) != 1 || !m["p TestB"] {
		t.Errorf("readExpected with /dev/kvm = %v, %v; want only p TestB", m, err)
	}
	if m, err := readExpected(p, false); err != nil || len(m) != 2 || !m["k TestK"] {
		t.Errorf("readExpected without /dev/kvm = %v, %v; want k TestK too", m, err)
	}
	os.WriteFile(p, []byte("k TestK with-kvm: no such condition\n"), 0o644)
	if _, err := readExpected(p, false); err == nil {
		t.Error("a line with an unknown condition was taken")
	}
}
