package virtio

import (
	"log/slog"
	"sync"
	"time"
)

// LogLimit rate-limits warnings a guest can trigger at will (a driver that
// negotiates badly or breaks its queues on purpose), so that it cannot
// flood the host's log: at most Burst records per Window, then one record
// saying the rest are suppressed until the window ends.
type LogLimit struct {
	Burst  int           // 0: 10
	Window time.Duration // 0: one minute

	mu    sync.Mutex
	start time.Time
	n     int
	now   func() time.Time // for the tests
}

// Warn logs msg at warning level unless the limit is reached.
func (l *LogLimit) Warn(log *slog.Logger, msg string, args ...any) {
	if l.allow(log) {
		log.Warn(msg, args...)
	}
}

func (l *LogLimit) allow(log *slog.Logger) bool {
	burst, window := l.Burst, l.Window
	if burst == 0 {
		burst = 10
	}
	if window == 0 {
		window = time.Minute
	}
	now := time.Now
	if l.now != nil {
		now = l.now
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if t := now(); t.Sub(l.start) >= window {
		l.start, l.n = t, 0
	}
	l.n++
	if l.n == burst+1 {
		log.Warn("further guest-triggered warnings are suppressed for a while", "burst", burst, "window", window)
	}
	return l.n <= burst
}
