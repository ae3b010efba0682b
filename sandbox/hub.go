package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"sync"

	"github.com/capsa-sandbox/capsa/hub"
	"github.com/capsa-sandbox/capsa/hub/proto"
	"github.com/capsa-sandbox/capsa/internal/statedir"
	"github.com/capsa-sandbox/capsa/virtio/vsock"
)

// HubSpec is what the sandbox may reach of the host's mailbox and
// key-value store (package hub), and who it is there.
type HubSpec struct {
	// Dir is the hub's directory; empty: the state directory
	// (statedir.Default, where the CLI keeps it).
	Dir string `json:"dir,omitempty"`
	// Identity is the sandbox's name in the hub: the sender of what it
	// publishes. A detached sandbox's is its name; empty: a random one.
	Identity string   `json:"identity,omitempty"`
	Topics   []string `json:"topics,omitempty"`   // Builder.Mailbox
	Prefixes []string `json:"prefixes,omitempty"` // Builder.KV
}

func (b *Builder) hubCfg() *HubSpec {
	if b.c.Hub == nil {
		b.c.Hub = &HubSpec{}
	}
	return b.c.Hub
}

// Mailbox grants the sandbox the mailbox topics named: each a topic, or
// PREFIX* for every topic starting with PREFIX ("*": all). Inside, it
// publishes and subscribes with `capsa mailbox ...`; what it publishes
// carries its Identity as the sender.
func (b *Builder) Mailbox(topics ...string) *Builder {
	if len(topics) == 0 {
		return b
	}
	for _, t := range topics {
		if err := hub.CheckTopicGrant(t); err != nil {
			b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: %w", err))
			return b
		}
	}
	h := b.hubCfg()
	h.Topics = append(h.Topics, topics...)
	return b
}

// KV grants the sandbox the keys of the host's key-value store that start
// with each prefix ("" is every key). Inside, `capsa kv ...` reaches them.
func (b *Builder) KV(prefixes ...string) *Builder {
	if len(prefixes) == 0 {
		return b
	}
	for _, p := range prefixes {
		if err := proto.CheckKey("key prefix", p, true); err != nil {
			b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: --kv: %w", err))
			return b
		}
	}
	h := b.hubCfg()
	h.Prefixes = append(h.Prefixes, prefixes...)
	return b
}

// HubDir sets the hub's directory (default: the state directory, as the
// CLI's capsa kv and capsa mailbox use).
func (b *Builder) HubDir(dir string) *Builder { b.hubCfg().Dir = dir; return b }

// Identity names the sandbox in the hub: the sender of its messages and
// the owner of what it stores (default: a random sandbox-XXXXXXXX).
func (b *Builder) Identity(name string) *Builder {
	if err := proto.CheckKey("identity", name, false); err != nil {
		b.c.errs = append(b.c.errs, fmt.Errorf("sandbox: identity: %w", err))
		return b
	}
	b.hubCfg().Identity = name
	return b
}

// hubServer answers the guest's connections to the hub's port with one
// session: its grants and its rate limit shared by all of them.
type hubServer struct {
	l       *vsock.Listener
	h       *hub.Hub // nil without grants: every request is refused
	session *hub.Session
	log     *slog.Logger
	wg      sync.WaitGroup
	conns   chan struct{} // a token per connection being served
}

// maxHubConns bounds the connections one guest may hold open to the hub.
const maxHubConns = 64

// serveHub listens on the hub's port of dev. Every guest has the capsa
// command, so one without grants is answered too, with permission errors
// that say which flags grant what.
func serveHub(dev *vsock.Device, spec *HubSpec, log *slog.Logger) (*hubServer, error) {
	g := hub.Grants{Identity: "sandbox-" + randomHex(4)}
	var h *hub.Hub
	if spec != nil {
		if spec.Identity != "" {
			g.Identity = spec.Identity
		}
		g.Topics, g.Prefixes = spec.Topics, spec.Prefixes
		if len(g.Topics)+len(g.Prefixes) > 0 {
			dir := spec.Dir
			if dir == "" {
				var err error
				if dir, err = statedir.Default(); err != nil {
					return nil, fmt.Errorf("sandbox: the hub: %w", err)
				}
			}
			var err error
			if h, err = hub.Open(dir); err != nil {
				return nil, fmt.Errorf("sandbox: %w", err)
			}
		}
	}
	l, err := dev.Listen(proto.Port)
	if err != nil {
		if h != nil {
			h.Close()
		}
		return nil, fmt.Errorf("sandbox: the hub's port: %w", err)
	}
	s := &hubServer{l: l, h: h, session: h.As(g), log: log.With("hub", g.Identity), conns: make(chan struct{}, maxHubConns)}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

func (s *hubServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.l.Accept()
		if err != nil {
			return
		}
		select {
		case s.conns <- struct{}{}:
		default:
			s.log.Warn("hub: too many connections from the guest; refusing one", "max", maxHubConns)
			c.Close()
			continue
		}
		s.wg.Add(1)
		go func(c net.Conn) {
			defer s.wg.Done()
			proto.Serve(context.Background(), c, s.session, s.log)
			<-s.conns
		}(c)
	}
}

// close stops listening; the connections end with the vsock device.
func (s *hubServer) close() error {
	if s == nil {
		return nil
	}
	err := s.l.Close()
	if s.h != nil {
		// Connections still served use the hub: it closes once they end.
		go func() {
			s.wg.Wait()
			s.h.Close()
		}()
	}
	return err
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
