package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/snapshot"
)

// Fork makes n running copies of the sandbox: it is snapshotted (paused
// only meanwhile: LastPause says for how long) and each copy restored from
// that snapshot, with its own memory (shared with the others and with the
// sandbox until written), network stack, hostname (the sandbox's,
// suffixed -1, -2...) and reseeded random numbers. The copies' main
// processes' output goes to o.Stdout and o.Stderr. The copies have the
// sandbox's own host-facing settings (its shares, network, grants) unless
// o.Settings gives others.
//
// The snapshot is a fork snapshot (SnapshotOptions.Fork) in a temporary
// directory of the sandbox's, kept until it ends: the first fork writes
// the memory in use as the chain's base, each later one only what the
// sandbox wrote since that (see SnapshotOptions.Fork). Each fork prunes
// the chain to its newest snapshot once no fork is under way.
func (s *Sandbox) Fork(ctx context.Context, n int, o RestoreOptions) ([]*Sandbox, error) {
	if n < 1 {
		return nil, fmt.Errorf("sandbox: fork: %d copies: want at least 1", n)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("sandbox: fork: %w", err)
	}
	dir, err := s.nextForkDir()
	if err != nil {
		return nil, fmt.Errorf("sandbox: fork: %w", err)
	}
	// The chain is pruned once no fork is under way, this one included.
	s.forkUse.RLock()
	defer func() {
		s.forkUse.RUnlock()
		if s.forkUse.TryLock() {
			s.snapMu.Lock()
			if s.forkChain != "" {
				snapshot.PruneChain(s.forkChain)
			}
			s.snapMu.Unlock()
			s.forkUse.Unlock()
		}
	}()
	if err := s.SnapshotWith(ctx, dir, SnapshotOptions{Fork: true}); err != nil {
		return nil, fmt.Errorf("sandbox: fork: %w", err)
	}
	copies := make([]*Sandbox, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			co := o
			if co.Settings == nil { // the source's own
				own := s.c.Spec
				co.Settings = &own
			}
			co.Hostname = fmt.Sprintf("%s-%d", info.Hostname, i+1)
			if co.Secrets == nil {
				co.Secrets = s.c.secrets
			}
			if co.VsockSocket != "" {
				co.VsockSocket = fmt.Sprintf("%s.%d", o.VsockSocket, i+1)
			}
			copies[i], errs[i] = Restore(ctx, dir, co)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, c := range copies {
			if c != nil {
				c.Close()
			}
		}
		return nil, fmt.Errorf("sandbox: fork: %w", err)
	}
	return copies, nil
}

// nextForkDir is a new directory name in the sandbox's fork chain's
// directory, made (temporary) for its first fork.
func (s *Sandbox) nextForkDir() (string, error) {
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	if s.forkChain == "" {
		var err error
		if s.forkChain, err = os.MkdirTemp("", "capsa-fork-"); err != nil {
			return "", err
		}
		s.forkOwn = true
	}
	return filepath.Join(s.forkChain, strconv.FormatInt(time.Now().UnixNano(), 10)), nil
}

// Pool keeps sandboxes restored from one snapshot ready, so that getting
// one costs a hand-out, not a boot or even a restore: E2B's and
// microsandbox's warm pools. A background goroutine refills it.
type Pool struct {
	dir   string
	o     RestoreOptions
	ready chan *Sandbox
	errc  chan error
	stop  chan struct{}
	done  chan struct{}
}

// NewPool starts keeping size sandboxes restored from the snapshot in dir
// (see Restore; o applies to each). The snapshot is checked at once.
func NewPool(dir string, size int, o RestoreOptions) (*Pool, error) {
	if size < 1 {
		return nil, fmt.Errorf("sandbox: pool of %d: want at least 1", size)
	}
	snap, err := snapshot.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: pool: %w", err)
	}
	snap.Close()
	if snap.Manifest.DiskOnly {
		return nil, fmt.Errorf("sandbox: pool: snapshot %s: %w", dir, snapshot.ErrDiskOnly)
	}
	p := &Pool{dir: dir, o: o, ready: make(chan *Sandbox, size), errc: make(chan error, 1),
		stop: make(chan struct{}), done: make(chan struct{})}
	go p.fill()
	return p, nil
}

// fill restores sandboxes while there is room, until Close.
func (p *Pool) fill() {
	defer close(p.done)
	for {
		sb, err := Restore(context.Background(), p.dir, p.o)
		if err != nil {
			select {
			case p.errc <- err:
			default:
			}
			select {
			case <-p.stop:
				return
			case <-time.After(time.Second): // back off, then try again
			}
			continue
		}
		select {
		case p.ready <- sb:
		case <-p.stop:
			sb.Close()
			return
		}
	}
}

// Get hands out a ready sandbox, waiting for one if the pool is empty; the
// caller closes it. A restore that failed is reported here.
func (p *Pool) Get(ctx context.Context) (*Sandbox, error) {
	select {
	case sb := <-p.ready:
		return sb, nil
	case <-ctx.Done():
		select {
		case err := <-p.errc:
			return nil, fmt.Errorf("sandbox: pool: %w", err)
		default:
		}
		return nil, ctx.Err()
	case err := <-p.errc:
		return nil, fmt.Errorf("sandbox: pool: %w", err)
	}
}

// Ready is how many sandboxes wait to be handed out.
func (p *Pool) Ready() int { return len(p.ready) }

// Close stops refilling and closes the sandboxes not handed out.
func (p *Pool) Close() error {
	close(p.stop)
	<-p.done
	var errs []error
	for {
		select {
		case sb := <-p.ready:
			errs = append(errs, sb.Close())
		default:
			return errors.Join(errs...)
		}
	}
}
