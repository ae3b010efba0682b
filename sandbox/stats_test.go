package sandbox

import (
	"testing"
	"time"
)

func TestCPUPercent(t *testing.T) {
	t0 := time.Now()
	at := func(d time.Duration, cpu time.Duration) *Stats { return &Stats{Taken: t0.Add(d), CPUTime: cpu} }
	for _, tc := range []struct {
		name      string
		prev, cur *Stats
		want      float64
	}{
		{"one vCPU busy", at(0, time.Second), at(time.Second, 2*time.Second), 100},
		{"two vCPUs busy", at(0, 0), at(time.Second, 2*time.Second), 200},
		{"a quarter", at(0, 0), at(2*time.Second, 500*time.Millisecond), 25},
		{"no previous", nil, at(time.Second, time.Second), 0},
		{"same instant", at(time.Second, 0), at(time.Second, time.Second), 0},
		{"time went back", at(0, 2*time.Second), at(time.Second, time.Second), 0},
	} {
		if got := CPUPercent(tc.prev, tc.cur); got != tc.want {
			t.Errorf("%s: CPUPercent = %v, want %v", tc.name, got, tc.want)
		}
	}
}
