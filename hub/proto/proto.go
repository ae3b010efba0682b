// Package proto is the wire protocol of capsa's hub (the mailbox and the
// key-value store sandboxes share, mediated by the host) and what speaks
// it: the operations' table (Ops), the API every implementation offers
// (the host's store, hub.Session, and a guest's Client), the errors that
// cross the wire with their codes, and the command line both sides share
// (RunCLI: `capsa kv ...` and `capsa mailbox ...` on the host and in
// every guest). It holds no storage, so the guest agent can link it.
//
// # The wire
//
// A guest connects to the host's vsock port Port (CID 2). Each request is
// one line of JSON (at most MaxLine bytes) and gets one line back:
//
//	{"id":1,"op":"kv.cas","key":"counter","version":7,"value":"MTI="}
//	{"id":1,"version":9}
//	{"id":2,"op":"kv.get","key":"nope"}
//	{"id":2,"error":"kv get nope: not found","code":"not_found"}
//
// Values and payloads are bytes, written as base64 (JSON's encoding of
// bytes). The streaming operations (kv.watch, mailbox.subscribe) answer
// with one line per event, {"id":N,"event":{...}}, until the client
// closes the connection; they take the connection for themselves. Every
// field of every operation is in Ops and the types below.
package proto

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"
)

// Port is the host's vsock port the hub listens on for its guest.
const Port = 1030

// Bounds of what one request may carry.
const (
	MaxLine    = 256 << 10 // one JSON line, base64 included
	MaxValue   = 64 << 10  // a value or a payload
	MaxKey     = 512       // a key, in bytes
	MaxTopic   = 256       // a topic's name, in bytes
	MaxListLen = 1000      // entries kv.list returns; more: Truncated
	MaxReadLen = 1000      // messages mailbox.read returns at once
)

// Entry is a key's value and version. A version is the store's revision
// at the key's last change: it only grows, so a key deleted and set again
// never gets an old version back (no ABA for compare-and-swap).
type Entry struct {
	Key     string `json:"key"`
	Value   []byte `json:"value"`
	Version uint64 `json:"version"`
}

// Event is a change a watch reports: the key's value and version after
// the change, or Deleted. Changes made in quick succession may be seen
// as their last one only; the versions seen always grow.
type Event struct {
	Key     string `json:"key"`
	Value   []byte `json:"value,omitempty"`
	Version uint64 `json:"version"`
	Deleted bool   `json:"deleted,omitempty"`
}

// Message is a mailbox message. The host fills Sender (the publishing
// sandbox's name, or "host"), Offset (its place in the topic's log,
// counting from 0) and Time; a guest cannot choose them.
type Message struct {
	Topic   string    `json:"topic"`
	Offset  uint64    `json:"offset"`
	Sender  string    `json:"sender"`
	Time    time.Time `json:"time"`
	Payload []byte    `json:"payload"`
}

// From values for Subscribe and Read: a number is an offset in the
// topic's log; New means only messages published from now on.
const New int64 = -1

// API is what the hub offers, whoever asks: the host directly, or a
// guest through Client. Each call checks the caller's grants.
type API interface {
	Get(ctx context.Context, key string) (Entry, error)
	Set(ctx context.Context, key string, value []byte) (version uint64, err error)
	// CAS sets key to value if its version is expected (0: the key must
	// not exist) and returns the new version, or ErrVersionMismatch.
	CAS(ctx context.Context, key string, expected uint64, value []byte) (version uint64, err error)
	Delete(ctx context.Context, key string) error
	// List returns the keys with prefix in order, at most MaxListLen
	// of them (truncated says there were more).
	List(ctx context.Context, prefix string) (entries []Entry, truncated bool, err error)
	// Watch calls fn for each change to a key with prefix made after it
	// started, until ctx ends or fn fails.
	Watch(ctx context.Context, prefix string, fn func(Event) error) error

	Publish(ctx context.Context, topic string, payload []byte) (Message, error)
	// Read returns up to max messages of topic's log from offset from
	// on (the oldest kept when from is older) without waiting.
	Read(ctx context.Context, topic string, from int64, max int) ([]Message, error)
	// Subscribe calls fn for each message of topic from offset from (or
	// New), waiting for new ones, until ctx ends or fn fails.
	Subscribe(ctx context.Context, topic string, from int64, fn func(Message) error) error
}

// Op describes one operation of the wire protocol.
type Op struct {
	Name   string
	Stream bool   // answers with events until the connection closes
	Args   string // the request's fields besides id and op
	Reply  string // the reply's fields besides id
}

// Ops is the protocol's table of operations, which the client, the
// server and docs/cli.md follow.
var Ops = []Op{
	{"kv.get", false, "key", "key, value, version"},
	{"kv.set", false, "key, value", "version"},
	{"kv.cas", false, "key, version (0: must be absent), value", "version"},
	{"kv.delete", false, "key", "(nothing)"},
	{"kv.list", false, "prefix", "entries [{key, value, version}], truncated"},
	{"kv.watch", true, "prefix", "events {key, value, version, deleted}"},
	{"mailbox.publish", false, "topic, payload", "message {topic, offset, sender, time, payload}"},
	{"mailbox.read", false, "topic, from (offset, -1: new), max", "messages [...]"},
	{"mailbox.subscribe", true, "topic, from (offset, -1: new)", "events: messages"},
}

// LookupOp returns the operation called name.
func LookupOp(name string) (Op, bool) {
	for _, o := range Ops {
		if o.Name == name {
			return o, true
		}
	}
	return Op{}, false
}

// Request is one line a client sends.
type Request struct {
	ID      uint64 `json:"id"`
	Op      string `json:"op"`
	Key     string `json:"key,omitempty"`
	Prefix  string `json:"prefix,omitempty"`
	Value   []byte `json:"value,omitempty"`
	Version uint64 `json:"version,omitempty"`
	Topic   string `json:"topic,omitempty"`
	Payload []byte `json:"payload,omitempty"`
	From    *int64 `json:"from,omitempty"` // nil: New
	Max     int    `json:"max,omitempty"`
}

// Response is one line the server sends: a reply, an event of a stream,
// or an error (Error and Code).
type Response struct {
	ID        uint64    `json:"id"`
	Error     string    `json:"error,omitempty"`
	Code      string    `json:"code,omitempty"`
	Key       string    `json:"key,omitempty"`
	Value     []byte    `json:"value,omitempty"`
	Version   uint64    `json:"version,omitempty"`
	Entries   []Entry   `json:"entries,omitempty"`
	Truncated bool      `json:"truncated,omitempty"`
	Message   *Message  `json:"message,omitempty"`
	Messages  []Message `json:"messages,omitempty"`
	Event     *Event    `json:"event,omitempty"`    // kv.watch
	Delivery  *Message  `json:"delivery,omitempty"` // mailbox.subscribe
}

// The errors that cross the wire, by code. errors.Is works with them on
// either side.
var (
	ErrNotFound        = errors.New("not found")
	ErrVersionMismatch = errors.New("version mismatch")
	ErrPermission      = errors.New("permission denied")
	ErrInvalid         = errors.New("invalid request")
	ErrLimit           = errors.New("limit reached")
	ErrUnavailable     = errors.New("hub unavailable")
)

var codes = []struct {
	code string
	err  error
}{
	{"not_found", ErrNotFound},
	{"version_mismatch", ErrVersionMismatch},
	{"permission", ErrPermission},
	{"invalid", ErrInvalid},
	{"limit", ErrLimit},
	{"unavailable", ErrUnavailable},
}

// Code is the wire code of err ("error" when it is none of the above).
func Code(err error) string {
	for _, c := range codes {
		if errors.Is(err, c.err) {
			return c.code
		}
	}
	return "error"
}

// remoteError is an error that came over the wire.
type remoteError struct {
	msg  string
	kind error // nil for "error"
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.kind }

// FromWire rebuilds the error a response carries.
func FromWire(msg, code string) error {
	e := &remoteError{msg: msg}
	for _, c := range codes {
		if c.code == code {
			e.kind = c.err
		}
	}
	return e
}

// CheckKey refuses a key or prefix that is too long or not text.
func CheckKey(what, key string, prefix bool) error {
	switch {
	case key == "" && !prefix:
		return fmt.Errorf("%w: empty %s", ErrInvalid, what)
	case len(key) > MaxKey:
		return fmt.Errorf("%w: %s of %d bytes: at most %d", ErrInvalid, what, len(key), MaxKey)
	}
	return checkText(what, key)
}

// CheckTopic refuses a topic that is empty, too long or not text.
func CheckTopic(topic string) error {
	switch {
	case topic == "":
		return fmt.Errorf("%w: empty topic", ErrInvalid)
	case len(topic) > MaxTopic:
		return fmt.Errorf("%w: topic of %d bytes: at most %d", ErrInvalid, len(topic), MaxTopic)
	}
	return checkText("topic", topic)
}

// CheckValue refuses a value or payload over MaxValue.
func CheckValue(what string, v []byte) error {
	if len(v) > MaxValue {
		return fmt.Errorf("%w: %s of %d bytes: at most %d", ErrLimit, what, len(v), MaxValue)
	}
	return nil
}

func checkText(what, s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: %s %q is not UTF-8", ErrInvalid, what, s)
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] == 0x7f {
			return fmt.Errorf("%w: %s %q holds a control character", ErrInvalid, what, s)
		}
	}
	return nil
}
