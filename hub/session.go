package hub

import (
	"context"
	"fmt"
	"strings"

	"golang.org/x/time/rate"

	"github.com/capsa-sandbox/capsa/hub/proto"
)

// Grants say what a caller may reach and who it is.
type Grants struct {
	// Identity is the caller's name: the sender of what it publishes,
	// the owner of what it stores. A sandbox's is its name.
	Identity string
	// Host grants everything, with no limits (the host's own CLI and
	// API).
	Host bool
	// Topics the caller may publish to and read: a topic by name, or
	// every topic starting with a prefix written PREFIX*.
	Topics []string
	// Prefixes of the keys the caller may read and change ("" is every
	// key).
	Prefixes []string
	// Limits bound a sandbox's use (zero fields: DefaultLimits').
	Limits Limits
}

// Limits bound what one sandbox may hold and how fast it may ask.
type Limits struct {
	Keys   int     // keys it owns (made or last set)
	Bytes  int64   // bytes of its keys and values
	Topics int     // topics it made (by publishing first)
	Rate   float64 // operations per second, with bursts of twice that
}

// DefaultLimits are a sandbox's limits unless its grants say otherwise.
var DefaultLimits = Limits{Keys: 10000, Bytes: 64 << 20, Topics: 100, Rate: 500}

// Session is one caller's view of the hub: every operation checked
// against its grants and limits.
type Session struct {
	h       *Hub
	g       Grants
	lim     *Limits // nil for the host
	limiter *rate.Limiter
}

var _ proto.API = (*Session)(nil)

// As returns the session of a caller with grants g.
func (h *Hub) As(g Grants) *Session {
	s := &Session{h: h, g: g}
	if !g.Host {
		l := g.Limits
		d := DefaultLimits
		if l.Keys == 0 {
			l.Keys = d.Keys
		}
		if l.Bytes == 0 {
			l.Bytes = d.Bytes
		}
		if l.Topics == 0 {
			l.Topics = d.Topics
		}
		if l.Rate == 0 {
			l.Rate = d.Rate
		}
		s.lim = &l
		s.limiter = rate.NewLimiter(rate.Limit(l.Rate), int(2*l.Rate)+1)
	}
	return s
}

// CheckTopicGrant refuses a topic grant that is not a topic or PREFIX*.
func CheckTopicGrant(g string) error {
	t := strings.TrimSuffix(g, "*")
	if t == "" && g == "*" {
		return nil
	}
	if strings.Contains(t, "*") {
		return fmt.Errorf("mailbox grant %q: '*' may only end it", g)
	}
	return proto.CheckTopic(t)
}

func topicGranted(grants []string, topic string) bool {
	for _, g := range grants {
		if p, ok := strings.CutSuffix(g, "*"); ok {
			if strings.HasPrefix(topic, p) {
				return true
			}
		} else if g == topic {
			return true
		}
	}
	return false
}

func prefixGranted(grants []string, key string) bool {
	for _, p := range grants {
		if strings.HasPrefix(key, p) {
			return true
		}
	}
	return false
}

// admit checks the rate and that the caller may reach key (a key, or
// with prefix a listing's prefix).
func (s *Session) admitKey(op, key string, prefix bool) error {
	if err := proto.CheckKey("key", key, prefix); err != nil {
		return fmt.Errorf("kv %s: %w", op, err)
	}
	if err := s.admit(); err != nil {
		return fmt.Errorf("kv %s %s: %w", op, key, err)
	}
	if !s.g.Host && !prefixGranted(s.g.Prefixes, key) {
		return fmt.Errorf("kv %s %q: %w: %s was granted %s (capsa run --kv PREFIX)", op, key, proto.ErrPermission, s.g.Identity, granted("the key prefixes", s.g.Prefixes))
	}
	return nil
}

func (s *Session) admitTopic(op, topic string) error {
	if err := proto.CheckTopic(topic); err != nil {
		return fmt.Errorf("mailbox %s: %w", op, err)
	}
	if err := s.admit(); err != nil {
		return fmt.Errorf("mailbox %s %s: %w", op, topic, err)
	}
	if !s.g.Host && !topicGranted(s.g.Topics, topic) {
		return fmt.Errorf("mailbox %s %q: %w: %s was granted %s (capsa run --mailbox TOPIC)", op, topic, proto.ErrPermission, s.g.Identity, granted("the topics", s.g.Topics))
	}
	return nil
}

// granted describes a list of grants in an error.
func granted(what string, gs []string) string {
	if len(gs) == 0 {
		return "none of them"
	}
	return fmt.Sprintf("%s %q", what, gs)
}

func (s *Session) admit() error {
	if s.limiter != nil && !s.limiter.Allow() {
		return fmt.Errorf("%w: more than %g operations a second", proto.ErrLimit, s.lim.Rate)
	}
	return nil
}

func (s *Session) owner() string {
	if s.g.Identity == "" {
		return "host"
	}
	return s.g.Identity
}

func (s *Session) Get(ctx context.Context, key string) (proto.Entry, error) {
	if err := s.admitKey("get", key, false); err != nil {
		return proto.Entry{}, err
	}
	e, err := s.h.get(key)
	if err != nil {
		return e, fmt.Errorf("kv get %s: %w", key, err)
	}
	return e, nil
}

func (s *Session) Set(ctx context.Context, key string, value []byte) (uint64, error) {
	if err := s.admitKey("set", key, false); err != nil {
		return 0, err
	}
	if err := proto.CheckValue("value", value); err != nil {
		return 0, fmt.Errorf("kv set %s: %w", key, err)
	}
	v, err := s.h.put(key, value, s.owner(), s.lim, func(*record) error { return nil })
	if err != nil {
		return 0, fmt.Errorf("kv set %s: %w", key, err)
	}
	return v, nil
}

func (s *Session) CAS(ctx context.Context, key string, expected uint64, value []byte) (uint64, error) {
	if err := s.admitKey("cas", key, false); err != nil {
		return 0, err
	}
	if err := proto.CheckValue("value", value); err != nil {
		return 0, fmt.Errorf("kv cas %s: %w", key, err)
	}
	v, err := s.h.put(key, value, s.owner(), s.lim, func(cur *record) error {
		switch {
		case cur == nil && expected != 0:
			return fmt.Errorf("%w: the key is absent, not at version %d", proto.ErrVersionMismatch, expected)
		case cur != nil && cur.Version != expected:
			if expected == 0 {
				return fmt.Errorf("%w: the key exists (version %d)", proto.ErrVersionMismatch, cur.Version)
			}
			return fmt.Errorf("%w: the key is at version %d, not %d", proto.ErrVersionMismatch, cur.Version, expected)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("kv cas %s: %w", key, err)
	}
	return v, nil
}

func (s *Session) Delete(ctx context.Context, key string) error {
	if err := s.admitKey("rm", key, false); err != nil {
		return err
	}
	if err := s.h.delete(key); err != nil {
		return fmt.Errorf("kv rm %s: %w", key, err)
	}
	return nil
}

func (s *Session) List(ctx context.Context, prefix string) ([]proto.Entry, bool, error) {
	if err := s.admitKey("ls", prefix, true); err != nil {
		return nil, false, err
	}
	es, trunc, err := s.h.list(prefix)
	if err != nil {
		return nil, false, fmt.Errorf("kv ls %s: %w", prefix, err)
	}
	return es, trunc, nil
}

func (s *Session) Watch(ctx context.Context, prefix string, fn func(proto.Event) error) error {
	if err := s.admitKey("watch", prefix, true); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	changed := s.h.changed(ctx)
	rev, err := s.h.rev()
	for err == nil {
		var evs []proto.Event
		last := rev
		if evs, rev, err = s.h.changesSince(rev, prefix); err != nil {
			break
		}
		for _, e := range evs {
			if err = fn(e); err != nil {
				return err
			}
		}
		if rev != last {
			continue // there may be more at once
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		}
	}
	return fmt.Errorf("kv watch %s: %w", prefix, err)
}

func (s *Session) Publish(ctx context.Context, topic string, payload []byte) (proto.Message, error) {
	if err := s.admitTopic("publish", topic); err != nil {
		return proto.Message{}, err
	}
	if err := proto.CheckValue("payload", payload); err != nil {
		return proto.Message{}, fmt.Errorf("mailbox publish %s: %w", topic, err)
	}
	m, err := s.h.publish(topic, s.owner(), payload, s.lim)
	if err != nil {
		return m, fmt.Errorf("mailbox publish %s: %w", topic, err)
	}
	return m, nil
}

func (s *Session) Read(ctx context.Context, topic string, from int64, max int) ([]proto.Message, error) {
	if err := s.admitTopic("read", topic); err != nil {
		return nil, err
	}
	if max <= 0 || max > proto.MaxReadLen {
		max = proto.MaxReadLen
	}
	start, err := s.h.start(topic, from)
	if err != nil {
		return nil, fmt.Errorf("mailbox read %s: %w", topic, err)
	}
	ms, err := s.h.read(topic, start, max)
	if err != nil {
		return nil, fmt.Errorf("mailbox read %s: %w", topic, err)
	}
	return ms, nil
}

func (s *Session) Subscribe(ctx context.Context, topic string, from int64, fn func(proto.Message) error) error {
	if err := s.admitTopic("subscribe", topic); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	changed := s.h.changed(ctx)
	next, err := s.h.start(topic, from)
	if err != nil {
		return fmt.Errorf("mailbox subscribe %s: %w", topic, err)
	}
	for {
		ms, err := s.h.read(topic, next, 100)
		if err != nil {
			return fmt.Errorf("mailbox subscribe %s: %w", topic, err)
		}
		for _, m := range ms {
			if err := fn(m); err != nil {
				return err
			}
			next = m.Offset + 1
		}
		if len(ms) > 0 {
			continue
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		}
	}
}
