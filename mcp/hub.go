package mcp

import (
	"context"
	"errors"
	"fmt"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/hub"
	"github.com/capsa-sandbox/capsa/hub/proto"
)

// mcpIdentity is the sender of what the MCP client publishes: it acts
// for the person on the host, with every key and topic.
const mcpIdentity = "mcp"

// maxReceiveWait bounds mailbox_receive's wait (clients give up on a
// request after about a minute).
const maxReceiveWait = 50

type publishArgs struct {
	Topic    string `json:"topic" jsonschema:"the topic, e.g. workers/results"`
	Payload  string `json:"payload" jsonschema:"the message, encoded as encoding says"`
	Encoding string `json:"encoding,omitempty" jsonschema:"utf-8 (the default) or base64"`
}

type message struct {
	Topic    string `json:"topic"`
	Offset   uint64 `json:"offset" jsonschema:"its place in the topic's log"`
	Sender   string `json:"sender" jsonschema:"the publishing sandbox's name (stamped by the host), host, or mcp"`
	Time     string `json:"time" jsonschema:"RFC 3339"`
	Payload  string `json:"payload"`
	Encoding string `json:"encoding" jsonschema:"utf-8 or base64"`
}

type receiveArgs struct {
	Topic       string `json:"topic" jsonschema:"the topic"`
	From        *int64 `json:"from,omitempty" jsonschema:"the first offset to return from the topic's history (0: its oldest kept message); default: only messages published from now on"`
	Max         int    `json:"max,omitempty" jsonschema:"return at most this many messages (default 100)"`
	WaitSeconds int    `json:"wait_seconds,omitempty" jsonschema:"when there is no message yet, wait this long for one (default 0, at most 50)"`
}

type receiveResult struct {
	Messages   []message `json:"messages"`
	NextOffset *uint64   `json:"next_offset,omitempty" jsonschema:"pass as from to get the messages after these"`
}

type kvArgs struct {
	Key string `json:"key" jsonschema:"the key"`
}

type kvEntry struct {
	Key      string `json:"key"`
	Value    string `json:"value"`
	Encoding string `json:"encoding" jsonschema:"utf-8 or base64"`
	Version  uint64 `json:"version" jsonschema:"the key's version, for kv_cas"`
}

type kvSetArgs struct {
	Key      string `json:"key" jsonschema:"the key"`
	Value    string `json:"value" jsonschema:"the value, encoded as encoding says"`
	Encoding string `json:"encoding,omitempty" jsonschema:"utf-8 (the default) or base64"`
}

type kvCASArgs struct {
	Key      string `json:"key" jsonschema:"the key"`
	Version  uint64 `json:"version" jsonschema:"the version the key must be at, from kv_get (0: the key must be absent)"`
	Value    string `json:"value" jsonschema:"the new value, encoded as encoding says"`
	Encoding string `json:"encoding,omitempty" jsonschema:"utf-8 (the default) or base64"`
}

type kvVersion struct {
	Key     string `json:"key"`
	Version uint64 `json:"version" jsonschema:"the key's new version"`
}

type kvListArgs struct {
	Prefix string `json:"prefix,omitempty" jsonschema:"list the keys starting with this (default: all)"`
}

type kvListResult struct {
	Entries   []kvEntry `json:"entries"`
	Truncated bool      `json:"truncated,omitempty" jsonschema:"there are more than the 1000 listed"`
}

// registerHubTools adds the mailbox and the key-value store: what the
// sandboxes share (they reach it with capsa kv and capsa mailbox inside,
// as granted by sandbox_create's mailbox and kv).
func registerHubTools(s *sdk.Server, t *tools) {
	addTool(s, t, &sdk.Tool{Name: "mailbox_publish", Title: "Publish a message",
		Description: "Publish a message on a mailbox topic, which sandboxes granted the topic read with `capsa mailbox subscribe TOPIC` inside. The sender is mcp.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false)},
	}, t.publish)
	addTool(s, t, &sdk.Tool{Name: "mailbox_receive", Title: "Receive messages",
		Description: "Read a mailbox topic: its history from an offset, or (without from) messages published from now on, waiting up to wait_seconds for the first. Each message carries its sender, the name of the sandbox that published it.",
		Annotations: &sdk.ToolAnnotations{ReadOnlyHint: true},
	}, t.receive)
	addTool(s, t, &sdk.Tool{Name: "kv_get", Title: "Get a key",
		Description: "Read a key of the key-value store the sandboxes share (inside: capsa kv get KEY), with its version.",
		Annotations: &sdk.ToolAnnotations{ReadOnlyHint: true},
	}, t.kvGet)
	addTool(s, t, &sdk.Tool{Name: "kv_set", Title: "Set a key",
		Description: "Set a key of the shared key-value store; returns its new version.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(true), IdempotentHint: true},
	}, t.kvSet)
	addTool(s, t, &sdk.Tool{Name: "kv_cas", Title: "Compare and swap a key",
		Description: "Set a key only if it is at version (0: only if it is absent); returns the new version, or fails with version mismatch when someone changed it first.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(true)},
	}, t.kvCAS)
	addTool(s, t, &sdk.Tool{Name: "kv_list", Title: "List keys",
		Description: "List the keys of the shared key-value store with a prefix, with their values and versions.",
		Annotations: &sdk.ToolAnnotations{ReadOnlyHint: true},
	}, t.kvList)
}

// hub opens the state directory's hub for one call, as the host.
func (t *tools) hub(fn func(api proto.API) error) error {
	h, err := hub.Open(t.m.Dir())
	if err != nil {
		return err
	}
	defer h.Close()
	return fn(h.As(hub.Grants{Identity: mcpIdentity, Host: true}))
}

func toMessage(m proto.Message) message {
	content, enc := encode(m.Payload, false)
	return message{Topic: m.Topic, Offset: m.Offset, Sender: m.Sender, Time: m.Time.Format(time.RFC3339Nano), Payload: content, Encoding: enc}
}

func toEntry(e proto.Entry) kvEntry {
	content, enc := encode(e.Value, false)
	return kvEntry{Key: e.Key, Value: content, Encoding: enc, Version: e.Version}
}

func (t *tools) publish(ctx context.Context, a publishArgs) (message, error) {
	payload, err := decode("payload", a.Payload, a.Encoding)
	if err != nil {
		return message{}, err
	}
	var m proto.Message
	err = t.hub(func(api proto.API) error {
		m, err = api.Publish(ctx, a.Topic, payload)
		return err
	})
	return toMessage(m), err
}

func (t *tools) receive(ctx context.Context, a receiveArgs) (receiveResult, error) {
	if a.WaitSeconds < 0 || a.WaitSeconds > maxReceiveWait {
		return receiveResult{}, fmt.Errorf("wait_seconds %d: want 0 to %d", a.WaitSeconds, maxReceiveWait)
	}
	if a.Max <= 0 {
		a.Max = 100
	}
	a.Max = min(a.Max, proto.MaxReadLen)
	from := proto.New
	if a.From != nil {
		if *a.From < 0 {
			return receiveResult{}, fmt.Errorf("from %d: want an offset, 0 or more", *a.From)
		}
		from = *a.From
	}
	var got []proto.Message
	err := t.hub(func(api proto.API) error {
		var err error
		if from != proto.New {
			if got, err = api.Read(ctx, a.Topic, from, a.Max); err != nil || len(got) > 0 || a.WaitSeconds == 0 {
				return err
			}
		} else if a.WaitSeconds == 0 {
			return nil
		}
		// Wait for the first message, then take what came with it.
		wctx, cancel := context.WithTimeout(ctx, time.Duration(a.WaitSeconds)*time.Second)
		defer cancel()
		errEnough := errors.New("enough")
		err = api.Subscribe(wctx, a.Topic, from, func(m proto.Message) error {
			got = append(got, m)
			return errEnough
		})
		switch {
		case errors.Is(err, errEnough) && a.Max == 1:
			return nil
		case errors.Is(err, errEnough):
			more, err := api.Read(ctx, a.Topic, int64(got[0].Offset+1), a.Max-1)
			got = append(got, more...)
			return err
		case wctx.Err() != nil && ctx.Err() == nil:
			return nil
		}
		return err
	})
	res := receiveResult{Messages: []message{}}
	for _, m := range got {
		res.Messages = append(res.Messages, toMessage(m))
	}
	if len(got) > 0 {
		next := got[len(got)-1].Offset + 1
		res.NextOffset = &next
	}
	return res, err
}

func (t *tools) kvGet(ctx context.Context, a kvArgs) (kvEntry, error) {
	var e proto.Entry
	err := t.hub(func(api proto.API) (err error) {
		e, err = api.Get(ctx, a.Key)
		return err
	})
	return toEntry(e), err
}

func (t *tools) kvSet(ctx context.Context, a kvSetArgs) (kvVersion, error) {
	return t.put(ctx, a.Key, a.Value, a.Encoding, nil)
}

func (t *tools) kvCAS(ctx context.Context, a kvCASArgs) (kvVersion, error) {
	return t.put(ctx, a.Key, a.Value, a.Encoding, &a.Version)
}

// put is kv_set, or kv_cas with a version.
func (t *tools) put(ctx context.Context, key, content, encoding string, version *uint64) (kvVersion, error) {
	value, err := decode("value", content, encoding)
	if err != nil {
		return kvVersion{}, err
	}
	var v uint64
	err = t.hub(func(api proto.API) (err error) {
		if version != nil {
			v, err = api.CAS(ctx, key, *version, value)
		} else {
			v, err = api.Set(ctx, key, value)
		}
		return err
	})
	return kvVersion{Key: key, Version: v}, err
}

func (t *tools) kvList(ctx context.Context, a kvListArgs) (kvListResult, error) {
	var es []proto.Entry
	var truncated bool
	err := t.hub(func(api proto.API) (err error) {
		es, truncated, err = api.List(ctx, a.Prefix)
		return err
	})
	res := kvListResult{Entries: []kvEntry{}, Truncated: truncated}
	for _, e := range es {
		res.Entries = append(res.Entries, toEntry(e))
	}
	return res, err
}
