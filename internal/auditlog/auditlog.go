// Package auditlog is an audit log's two ends: the latest records kept in a
// bounded ring for the caller to read, and every record written as a JSON
// line to a writer (a sandbox's rotated log file). Package tlsproxy keeps
// its intercepted requests in one, package sandbox its NAT's flows.
package auditlog

import (
	"encoding/json"
	"io"
	"sync"
)

// Log keeps the last records of type T and writes each as a JSON line to
// a writer, if it has one. A write error is dropped: the log must never
// stop what it records.
type Log[T any] struct {
	mu   sync.Mutex
	w    io.Writer
	ring []T
	next int
	full bool
}

// New keeps the last keep records (at least one) and writes every record
// to w (nil: none). Writes to w are serialised by the Log; a writer that
// several Logs share must serialise its own Write calls.
func New[T any](keep int, w io.Writer) *Log[T] {
	return &Log[T]{w: w, ring: make([]T, max(keep, 1))}
}

// Add records r.
func (l *Log[T]) Add(r T) {
	b, err := json.Marshal(r)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ring[l.next] = r
	l.next = (l.next + 1) % len(l.ring)
	l.full = l.full || l.next == 0
	if l.w != nil && err == nil {
		l.w.Write(append(b, '\n'))
	}
}

// Records returns the records kept, oldest first.
func (l *Log[T]) Records() []T {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.full {
		return append([]T(nil), l.ring[:l.next]...)
	}
	return append(append([]T(nil), l.ring[l.next:]...), l.ring[:l.next]...)
}

// SyncWriter serialises Write calls to W, for a writer several Logs share.
type SyncWriter struct {
	mu sync.Mutex
	W  io.Writer
}

func (s *SyncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.W.Write(p)
}
