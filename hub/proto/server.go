package proto

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
)

// Serve answers the requests of one connection with api until the peer
// closes it or ctx ends. The peer is untrusted: a line over MaxLine or
// that is not a request ends the connection with an error reply; a
// request the API refuses gets its error and the connection goes on.
func Serve(ctx context.Context, conn net.Conn, api API, log *slog.Logger) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	defer conn.Close()
	w := &replyWriter{enc: json.NewEncoder(conn)}
	r := bufio.NewReaderSize(conn, 64<<10)
	for {
		line, err := readLine(r)
		if err != nil {
			if errors.Is(err, ErrLimit) {
				w.write(&Response{Error: err.Error(), Code: Code(err)})
			}
			return
		}
		var req Request
		if err := json.Unmarshal(line, &req); err != nil {
			w.write(&Response{Error: fmt.Sprintf("not a request: %v", err), Code: Code(ErrInvalid)})
			return
		}
		op, ok := LookupOp(req.Op)
		if !ok {
			w.write(&Response{ID: req.ID, Error: fmt.Sprintf("unknown operation %q", req.Op), Code: Code(ErrInvalid)})
			continue
		}
		if op.Stream {
			// The stream has the connection to itself: anything more
			// the peer sends, or its closing, ends it.
			sctx, scancel := context.WithCancel(ctx)
			go func() {
				io.Copy(io.Discard, r)
				scancel()
			}()
			err := stream(sctx, api, &req, w)
			scancel()
			if err != nil && sctx.Err() == nil {
				w.write(&Response{ID: req.ID, Error: err.Error(), Code: Code(err)})
			}
			log.Debug("hub: stream ended", "op", req.Op, "err", err)
			return
		}
		resp, err := answer(ctx, api, &req)
		if err != nil {
			resp = &Response{Error: err.Error(), Code: Code(err)}
		}
		resp.ID = req.ID
		if w.write(resp) != nil {
			return
		}
	}
}

// replyWriter writes whole lines, one at a time.
type replyWriter struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func (w *replyWriter) write(r *Response) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.enc.Encode(r)
}

func from(req *Request) int64 {
	if req.From == nil {
		return New
	}
	return *req.From
}

// answer runs a request that answers once.
func answer(ctx context.Context, api API, req *Request) (*Response, error) {
	switch req.Op {
	case "kv.get":
		e, err := api.Get(ctx, req.Key)
		return &Response{Key: e.Key, Value: e.Value, Version: e.Version}, err
	case "kv.set":
		v, err := api.Set(ctx, req.Key, req.Value)
		return &Response{Version: v}, err
	case "kv.cas":
		v, err := api.CAS(ctx, req.Key, req.Version, req.Value)
		return &Response{Version: v}, err
	case "kv.delete":
		return &Response{}, api.Delete(ctx, req.Key)
	case "kv.list":
		es, trunc, err := api.List(ctx, req.Prefix)
		return &Response{Entries: es, Truncated: trunc}, err
	case "mailbox.publish":
		m, err := api.Publish(ctx, req.Topic, req.Payload)
		return &Response{Message: &m}, err
	case "mailbox.read":
		ms, err := api.Read(ctx, req.Topic, from(req), req.Max)
		return &Response{Messages: ms}, err
	}
	return nil, fmt.Errorf("%w: operation %q does not answer once", ErrInvalid, req.Op)
}

// stream runs a streaming request, writing each event.
func stream(ctx context.Context, api API, req *Request, w *replyWriter) error {
	switch req.Op {
	case "kv.watch":
		return api.Watch(ctx, req.Prefix, func(e Event) error {
			return w.write(&Response{ID: req.ID, Event: &e})
		})
	case "mailbox.subscribe":
		return api.Subscribe(ctx, req.Topic, from(req), func(m Message) error {
			return w.write(&Response{ID: req.ID, Delivery: &m})
		})
	}
	return fmt.Errorf("%w: operation %q is not a stream", ErrInvalid, req.Op)
}
