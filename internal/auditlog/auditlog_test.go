package auditlog

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

type rec struct {
	N int `json:"n"`
}

// TestRingAndLines: the ring keeps the last records, oldest first, and
// every record is a JSON line of the writer.
func TestRingAndLines(t *testing.T) {
	var out bytes.Buffer
	l := New[rec](3, &SyncWriter{W: &out})
	if got := l.Records(); len(got) != 0 {
		t.Errorf("an empty log's records: %v", got)
	}
	for i := range 5 {
		l.Add(rec{i})
	}
	if got := l.Records(); !slices.Equal(got, []rec{{2}, {3}, {4}}) {
		t.Errorf("Records = %v, want the last three, oldest first", got)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 5 {
		t.Fatalf("%d lines written, want 5: %q", len(lines), out.String())
	}
	for i, line := range lines {
		var r rec
		if err := json.Unmarshal([]byte(line), &r); err != nil || r.N != i {
			t.Errorf("line %d = %q (%v)", i, line, err)
		}
	}
	none := New[rec](0, nil) // keeps one, writes nowhere
	none.Add(rec{7})
	none.Add(rec{8})
	if got := none.Records(); !slices.Equal(got, []rec{{8}}) {
		t.Errorf("a log keeping at least one: %v", got)
	}
}
