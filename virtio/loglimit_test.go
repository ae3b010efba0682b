package virtio

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestLogLimit(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	now := time.Unix(1000, 0)
	l := &LogLimit{Burst: 3, Window: time.Second, now: func() time.Time { return now }}
	for range 100 {
		l.Warn(log, "bad driver")
	}
	if got := strings.Count(buf.String(), "bad driver"); got != 3 {
		t.Errorf("100 warnings in one window logged %d times, want 3", got)
	}
	if got := strings.Count(buf.String(), "suppressed"); got != 1 {
		t.Errorf("suppression noted %d times, want 1", got)
	}
	now = now.Add(time.Second)
	l.Warn(log, "bad driver")
	if got := strings.Count(buf.String(), "bad driver"); got != 4 {
		t.Errorf("after the window: %d warnings logged, want 4", got)
	}
}
