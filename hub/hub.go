// Package hub is the host side of what sandboxes share besides volumes: a
// mailbox (topics, each a bounded, durable log of messages stamped with
// their sender) and a versioned key-value store with compare-and-swap and
// watches. Its starting point is Open, which gives a Hub over one
// directory; Hub.As gives a Session for one caller (a sandbox with its
// grants, or the host), which implements proto.API; proto.Serve answers
// a guest's connection with a Session.
//
// Every capsa process (each detached sandbox's supervisor, the CLI) opens
// the same directory, so there is no daemon: the data is one bbolt file,
// hub.db, opened for each operation under a flock of hub.lock (bbolt
// allows one process at a time), and watchers learn of changes from
// inotify on the file, with a slow poll behind it in case an event is
// missed. Each change to a key bumps the store's revision, which becomes
// the key's version and is logged (bounded) for watches.
package hub

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/hub/proto"
)

// Retention and quotas. A topic keeps its last MaxMessages messages, and
// no more than MaxTopicBytes of payload; the store keeps the last
// MaxChanges key changes for watches.
const (
	MaxMessages   = 1000
	MaxTopicBytes = 1 << 20
	MaxChanges    = 10000
)

// Hub is the mailbox and key-value store in one directory.
type Hub struct {
	db   string
	lock *os.File

	mu sync.Mutex // one operation at a time in this process (the flock is per open file)

	wmu       sync.Mutex
	waiters   map[chan struct{}]struct{} // changed's callers; nil until the first
	closed    chan struct{}
	closeOnce sync.Once
}

// Open returns the hub in dir, making the directory (0700) and its files
// if needed.
func Open(dir string) (*Hub, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("hub: open %s: %w", dir, err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "hub.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("hub: open %s: %w", dir, err)
	}
	h := &Hub{db: filepath.Join(dir, "hub.db"), lock: lock, closed: make(chan struct{})}
	// Make the file and its buckets, so readers can open it read-only.
	// Only the Open that made the file has to: every write makes them.
	if _, err := os.Stat(h.db); errors.Is(err, os.ErrNotExist) {
		if err := h.update(func(*bolt.Tx) error { return nil }); err != nil {
			lock.Close()
			return nil, err
		}
	}
	return h, nil
}

// Files are the files the hub opens for each operation: its database and
// its lock.
func (h *Hub) Files() []string { return []string{h.db, h.lock.Name()} }

// Close releases the hub's lock file and ends its watches' notifier.
func (h *Hub) Close() error {
	h.closeOnce.Do(func() { close(h.closed) })
	return h.lock.Close()
}

var (
	bMeta    = []byte("meta")    // "rev" -> uint64
	bKV      = []byte("kv")      // key -> record
	bChanges = []byte("changes") // rev -> change
	bOwners  = []byte("owners")  // owner -> usage
	bTopics  = []byte("topics")  // topic -> topicMeta
	bLogs    = []byte("logs")    // topic -> bucket: offset -> Message
)

// with runs fn on the database, opened for this operation alone under
// the hub's lock.
func (h *Hub) with(write bool, fn func(tx *bolt.Tx) error) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	how := unix.LOCK_SH
	if write {
		how = unix.LOCK_EX
	}
	if err := flock(h.lock, how); err != nil {
		return fmt.Errorf("hub: lock: %w", err)
	}
	defer flock(h.lock, unix.LOCK_UN)
	// The flock above orders every process; bbolt's own lock is then
	// always free, and the timeout only guards against a stranger.
	db, err := bolt.Open(h.db, 0o600, &bolt.Options{Timeout: 10 * time.Second, ReadOnly: !write})
	if err != nil {
		return fmt.Errorf("hub: open %s: %w", h.db, err)
	}
	defer db.Close()
	if write {
		return db.Update(func(tx *bolt.Tx) error {
			for _, b := range [][]byte{bMeta, bKV, bChanges, bOwners, bTopics, bLogs} {
				if _, err := tx.CreateBucketIfNotExists(b); err != nil {
					return err
				}
			}
			return fn(tx)
		})
	}
	return db.View(fn)
}

func (h *Hub) update(fn func(tx *bolt.Tx) error) error { return h.with(true, fn) }
func (h *Hub) view(fn func(tx *bolt.Tx) error) error   { return h.with(false, fn) }

func flock(f *os.File, how int) error {
	for {
		err := unix.Flock(int(f.Fd()), how)
		if err != unix.EINTR {
			return err
		}
	}
}

func u64(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }

func getU64(b []byte) uint64 {
	if len(b) != 8 {
		return 0
	}
	return binary.BigEndian.Uint64(b)
}

// record is a key's stored value.
type record struct {
	Version uint64 `json:"v"`
	Owner   string `json:"o"`
	Value   []byte `json:"d"`
}

// usage is what one owner holds, counted against its Limits.
type usage struct {
	Keys   int   `json:"keys"`
	Bytes  int64 `json:"bytes"`
	Topics int   `json:"topics"`
}

// topicMeta is a topic's log: offsets Oldest to Next-1 are kept.
type topicMeta struct {
	Next   uint64 `json:"next"`
	Oldest uint64 `json:"oldest"`
	Bytes  int64  `json:"bytes"`
	Owner  string `json:"owner"`
}

func getJSON(b *bolt.Bucket, key []byte, v any) (bool, error) {
	raw := b.Get(key)
	if raw == nil {
		return false, nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return false, fmt.Errorf("hub: corrupt entry %q in %s: %w", key, "hub.db", err)
	}
	return true, nil
}

func putJSON(b *bolt.Bucket, key []byte, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return b.Put(key, raw)
}

// charge adds d to owner's usage, refusing past its limits (nil: none).
func charge(tx *bolt.Tx, owner string, lim *Limits, d usage) error {
	b := tx.Bucket(bOwners)
	var u usage
	if _, err := getJSON(b, []byte(owner), &u); err != nil {
		return err
	}
	u.Keys += d.Keys
	u.Bytes += d.Bytes
	u.Topics += d.Topics
	if lim != nil {
		switch {
		case d.Keys > 0 && u.Keys > lim.Keys:
			return fmt.Errorf("%w: %s may hold at most %d keys", proto.ErrLimit, owner, lim.Keys)
		case d.Bytes > 0 && u.Bytes > lim.Bytes:
			return fmt.Errorf("%w: %s may hold at most %d bytes of keys and values", proto.ErrLimit, owner, lim.Bytes)
		case d.Topics > 0 && u.Topics > lim.Topics:
			return fmt.Errorf("%w: %s may make at most %d topics", proto.ErrLimit, owner, lim.Topics)
		}
	}
	if u == (usage{}) {
		return b.Delete([]byte(owner))
	}
	return putJSON(b, []byte(owner), &u)
}

// nextRev bumps the store's revision and logs the change of key.
func nextRev(tx *bolt.Tx, key string, deleted bool) (uint64, error) {
	meta := tx.Bucket(bMeta)
	rev := getU64(meta.Get([]byte("rev"))) + 1
	if err := meta.Put([]byte("rev"), u64(rev)); err != nil {
		return 0, err
	}
	ch := tx.Bucket(bChanges)
	op := byte(0)
	if deleted {
		op = 1
	}
	if err := ch.Put(u64(rev), append([]byte{op}, key...)); err != nil {
		return 0, err
	}
	if rev > MaxChanges {
		if err := ch.Delete(u64(rev - MaxChanges)); err != nil {
			return 0, err
		}
	}
	return rev, nil
}

func keySize(key string, value []byte) int64 { return int64(len(key) + len(value)) }

// put sets key (if cond accepts its current record, nil when absent) and
// returns the new version.
func (h *Hub) put(key string, value []byte, owner string, lim *Limits, cond func(*record) error) (uint64, error) {
	var ver uint64
	err := h.update(func(tx *bolt.Tx) error {
		kv := tx.Bucket(bKV)
		var old record
		found, err := getJSON(kv, []byte(key), &old)
		if err != nil {
			return err
		}
		var cur *record
		if found {
			cur = &old
		}
		if err := cond(cur); err != nil {
			return err
		}
		if found {
			if err := charge(tx, old.Owner, nil, usage{Keys: -1, Bytes: -keySize(key, old.Value)}); err != nil {
				return err
			}
		}
		if err := charge(tx, owner, lim, usage{Keys: 1, Bytes: keySize(key, value)}); err != nil {
			return err
		}
		if ver, err = nextRev(tx, key, false); err != nil {
			return err
		}
		return putJSON(kv, []byte(key), &record{Version: ver, Owner: owner, Value: value})
	})
	return ver, err
}

func (h *Hub) get(key string) (proto.Entry, error) {
	var e proto.Entry
	err := h.view(func(tx *bolt.Tx) error {
		var r record
		found, err := getJSON(tx.Bucket(bKV), []byte(key), &r)
		if err != nil {
			return err
		}
		if !found {
			return proto.ErrNotFound
		}
		e = proto.Entry{Key: key, Value: r.Value, Version: r.Version}
		return nil
	})
	return e, err
}

func (h *Hub) delete(key string) error {
	return h.update(func(tx *bolt.Tx) error {
		kv := tx.Bucket(bKV)
		var old record
		found, err := getJSON(kv, []byte(key), &old)
		if err != nil {
			return err
		}
		if !found {
			return proto.ErrNotFound
		}
		if err := charge(tx, old.Owner, nil, usage{Keys: -1, Bytes: -keySize(key, old.Value)}); err != nil {
			return err
		}
		if _, err := nextRev(tx, key, true); err != nil {
			return err
		}
		return kv.Delete([]byte(key))
	})
}

func (h *Hub) list(prefix string) ([]proto.Entry, bool, error) {
	var es []proto.Entry
	truncated := false
	err := h.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bKV).Cursor()
		for k, v := c.Seek([]byte(prefix)); k != nil && hasPrefix(k, prefix); k, v = c.Next() {
			if len(es) == proto.MaxListLen {
				truncated = true
				return nil
			}
			var r record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("hub: corrupt entry %q: %w", k, err)
			}
			es = append(es, proto.Entry{Key: string(k), Value: r.Value, Version: r.Version})
		}
		return nil
	})
	return es, truncated, err
}

func hasPrefix(k []byte, prefix string) bool {
	return len(k) >= len(prefix) && string(k[:len(prefix)]) == prefix
}

// rev is the store's current revision.
func (h *Hub) rev() (uint64, error) {
	var rev uint64
	err := h.view(func(tx *bolt.Tx) error {
		rev = getU64(tx.Bucket(bMeta).Get([]byte("rev")))
		return nil
	})
	return rev, err
}

// changesSince returns the events for keys with prefix changed after rev
// (at most a batch of them), and the revision they bring the caller to.
func (h *Hub) changesSince(rev uint64, prefix string) ([]proto.Event, uint64, error) {
	var evs []proto.Event
	last := rev
	err := h.view(func(tx *bolt.Tx) error {
		ch := tx.Bucket(bChanges)
		cur := getU64(tx.Bucket(bMeta).Get([]byte("rev")))
		if cur == rev {
			return nil
		}
		c := ch.Cursor()
		k, _ := c.First()
		if k == nil || getU64(k) > rev+1 {
			return fmt.Errorf("%w: the watch fell behind by more than %d changes", proto.ErrLimit, MaxChanges)
		}
		type change struct {
			rev     uint64
			deleted bool
		}
		latest := map[string]change{}
		var order []string
		n := 0
		for k, v := c.Seek(u64(rev + 1)); k != nil && n < 1000; k, v = c.Next() {
			n++
			last = getU64(k)
			if len(v) < 1 || !hasPrefix(v[1:], prefix) {
				continue
			}
			key := string(v[1:])
			if _, ok := latest[key]; !ok {
				order = append(order, key)
			}
			latest[key] = change{last, v[0] == 1}
		}
		// Each key's last change in the batch; one superseded by a
		// change after the batch is reported by a later batch.
		for _, key := range order {
			c := latest[key]
			if c.deleted {
				if tx.Bucket(bKV).Get([]byte(key)) == nil {
					evs = append(evs, proto.Event{Key: key, Version: c.rev, Deleted: true})
				}
				continue
			}
			var r record
			if found, err := getJSON(tx.Bucket(bKV), []byte(key), &r); err != nil {
				return err
			} else if found && r.Version == c.rev {
				evs = append(evs, proto.Event{Key: key, Value: r.Value, Version: r.Version})
			}
		}
		return nil
	})
	return evs, last, err
}

// start is the offset a read of topic from from (an offset, or
// proto.New: the topic's next) begins at.
func (h *Hub) start(topic string, from int64) (uint64, error) {
	if from >= 0 {
		return uint64(from), nil
	}
	var m topicMeta
	err := h.view(func(tx *bolt.Tx) error {
		_, err := getJSON(tx.Bucket(bTopics), []byte(topic), &m)
		return err
	})
	return m.Next, err
}

func (h *Hub) publish(topic, sender string, payload []byte, lim *Limits) (proto.Message, error) {
	m := proto.Message{Topic: topic, Sender: sender, Payload: payload}
	err := h.update(func(tx *bolt.Tx) error {
		topics := tx.Bucket(bTopics)
		var meta topicMeta
		found, err := getJSON(topics, []byte(topic), &meta)
		if err != nil {
			return err
		}
		if !found {
			meta.Owner = sender
			if err := charge(tx, sender, lim, usage{Topics: 1}); err != nil {
				return err
			}
		}
		log, err := tx.Bucket(bLogs).CreateBucketIfNotExists([]byte(topic))
		if err != nil {
			return err
		}
		m.Offset = meta.Next
		m.Time = time.Now().UTC()
		if err := putJSON(log, u64(m.Offset), &m); err != nil {
			return err
		}
		meta.Next++
		meta.Bytes += int64(len(payload))
		// Drop the oldest messages past the topic's bounds.
		for meta.Next-meta.Oldest > MaxMessages || (meta.Bytes > MaxTopicBytes && meta.Oldest < m.Offset) {
			var old proto.Message
			if _, err := getJSON(log, u64(meta.Oldest), &old); err != nil {
				return err
			}
			if err := log.Delete(u64(meta.Oldest)); err != nil {
				return err
			}
			meta.Bytes -= int64(len(old.Payload))
			meta.Oldest++
		}
		return putJSON(topics, []byte(topic), &meta)
	})
	return m, err
}

// read returns up to max messages of topic from offset from on.
func (h *Hub) read(topic string, from uint64, max int) ([]proto.Message, error) {
	var ms []proto.Message
	err := h.view(func(tx *bolt.Tx) error {
		log := tx.Bucket(bLogs).Bucket([]byte(topic))
		if log == nil {
			return nil
		}
		c := log.Cursor()
		for k, v := c.Seek(u64(from)); k != nil && len(ms) < max; k, v = c.Next() {
			var m proto.Message
			if err := json.Unmarshal(v, &m); err != nil {
				return fmt.Errorf("hub: corrupt message %d of %q: %w", getU64(k), topic, err)
			}
			ms = append(ms, m)
		}
		return nil
	})
	return ms, err
}

// changed returns a channel that receives after the hub's file may have
// changed, until ctx ends. One inotify watch per Hub serves every caller
// (a process may have few inotify instances), and a poll every
// pollInterval backs it up in case an event is missed or inotify is
// unavailable.
func (h *Hub) changed(ctx context.Context) <-chan struct{} {
	ch := make(chan struct{}, 1)
	h.wmu.Lock()
	if h.waiters == nil {
		h.waiters = map[chan struct{}]struct{}{}
		go h.notify()
	}
	h.waiters[ch] = struct{}{}
	h.wmu.Unlock()
	context.AfterFunc(ctx, func() {
		h.wmu.Lock()
		delete(h.waiters, ch)
		h.wmu.Unlock()
	})
	return ch
}

// notify pokes every waiter on each inotify event and poll tick, until
// the Hub is closed.
func (h *Hub) notify() {
	events := make(chan struct{}, 1)
	if fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK); err == nil {
		if _, err := unix.InotifyAddWatch(fd, h.db, unix.IN_MODIFY|unix.IN_CLOSE_WRITE); err != nil {
			unix.Close(fd)
		} else {
			// A non-blocking descriptor in an os.File waits in Go's
			// poller, so closing it ends the read.
			f := os.NewFile(uintptr(fd), "inotify")
			go func() {
				<-h.closed
				f.Close()
			}()
			go func() {
				buf := make([]byte, 4096)
				for {
					if _, err := f.Read(buf); err != nil {
						return
					}
					select {
					case events <- struct{}{}:
					default:
					}
				}
			}()
		}
	}
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for {
		select {
		case <-h.closed:
			return
		case <-t.C:
		case <-events:
		}
		h.wmu.Lock()
		for ch := range h.waiters {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
		h.wmu.Unlock()
	}
}

// pollInterval backs inotify up.
const pollInterval = time.Second
