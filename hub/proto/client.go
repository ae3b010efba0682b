package proto

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
)

// Client speaks the protocol to a server: a guest's to its host. Calls
// that answer once share one connection, one at a time; each stream
// (Watch, Subscribe) has its own. The zero Client is not usable: set Dial.
type Client struct {
	Dial func(ctx context.Context) (net.Conn, error)

	mu   sync.Mutex // one call at a time on conn
	conn *clientConn
	id   uint64
}

var _ API = (*Client)(nil)

type clientConn struct {
	c   net.Conn
	r   *bufio.Reader
	enc *json.Encoder
}

func (c *Client) dial(ctx context.Context) (*clientConn, error) {
	conn, err := c.Dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return &clientConn{c: conn, r: bufio.NewReaderSize(conn, 64<<10), enc: json.NewEncoder(conn)}, nil
}

// Close closes the shared connection.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		return nil
	}
	err := c.conn.c.Close()
	c.conn = nil
	return err
}

// send writes req on cc and reads one response, honoring ctx.
func send(ctx context.Context, cc *clientConn, req *Request) (*Response, error) {
	stop := context.AfterFunc(ctx, func() { cc.c.Close() })
	defer stop()
	if err := cc.enc.Encode(req); err != nil {
		return nil, ctxErr(ctx, err)
	}
	return readResponse(ctx, cc, req.ID)
}

func readResponse(ctx context.Context, cc *clientConn, id uint64) (*Response, error) {
	line, err := readLine(cc.r)
	if err != nil {
		return nil, ctxErr(ctx, err)
	}
	var resp Response
	if err := json.Unmarshal(line, &resp); err != nil {
		return nil, fmt.Errorf("%w: a bad reply: %v", ErrUnavailable, err)
	}
	if resp.ID != id {
		return nil, fmt.Errorf("%w: a reply to request %d, not %d", ErrUnavailable, resp.ID, id)
	}
	if resp.Error != "" || resp.Code != "" {
		return nil, FromWire(resp.Error, resp.Code)
	}
	return &resp, nil
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("%w: %v", ErrUnavailable, err)
}

// readLine reads one line of at most MaxLine bytes.
func readLine(r *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		part, err := r.ReadSlice('\n')
		line = append(line, part...)
		if len(line) > MaxLine {
			return nil, fmt.Errorf("%w: a line over %d bytes", ErrLimit, MaxLine)
		}
		if err == bufio.ErrBufferFull {
			continue
		}
		return line, err
	}
}

// call sends req on the shared connection (dialing it if needed) and
// returns the reply; a connection that failed is dropped.
func (c *Client) call(ctx context.Context, req Request) (*Response, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		cc, err := c.dial(ctx)
		if err != nil {
			return nil, err
		}
		c.conn = cc
	}
	c.id++
	req.ID = c.id
	resp, err := send(ctx, c.conn, &req)
	if err != nil && errors.Is(err, ErrUnavailable) || ctx.Err() != nil {
		c.conn.c.Close()
		c.conn = nil
	}
	return resp, err
}

// stream sends req on a connection of its own and hands each event's
// response to fn until ctx ends or fn fails.
func (c *Client) stream(ctx context.Context, req Request, fn func(*Response) error) error {
	cc, err := c.dial(ctx)
	if err != nil {
		return err
	}
	defer cc.c.Close()
	stop := context.AfterFunc(ctx, func() { cc.c.Close() })
	defer stop()
	req.ID = 1
	if err := cc.enc.Encode(&req); err != nil {
		return ctxErr(ctx, err)
	}
	for {
		resp, err := readResponse(ctx, cc, 1)
		if err != nil {
			return err
		}
		if err := fn(resp); err != nil {
			return err
		}
	}
}

func (c *Client) Get(ctx context.Context, key string) (Entry, error) {
	resp, err := c.call(ctx, Request{Op: "kv.get", Key: key})
	if err != nil {
		return Entry{}, err
	}
	return Entry{Key: resp.Key, Value: resp.Value, Version: resp.Version}, nil
}

func (c *Client) Set(ctx context.Context, key string, value []byte) (uint64, error) {
	resp, err := c.call(ctx, Request{Op: "kv.set", Key: key, Value: value})
	if err != nil {
		return 0, err
	}
	return resp.Version, nil
}

func (c *Client) CAS(ctx context.Context, key string, expected uint64, value []byte) (uint64, error) {
	resp, err := c.call(ctx, Request{Op: "kv.cas", Key: key, Version: expected, Value: value})
	if err != nil {
		return 0, err
	}
	return resp.Version, nil
}

func (c *Client) Delete(ctx context.Context, key string) error {
	_, err := c.call(ctx, Request{Op: "kv.delete", Key: key})
	return err
}

func (c *Client) List(ctx context.Context, prefix string) ([]Entry, bool, error) {
	resp, err := c.call(ctx, Request{Op: "kv.list", Prefix: prefix})
	if err != nil {
		return nil, false, err
	}
	return resp.Entries, resp.Truncated, nil
}

func (c *Client) Watch(ctx context.Context, prefix string, fn func(Event) error) error {
	return c.stream(ctx, Request{Op: "kv.watch", Prefix: prefix}, func(r *Response) error {
		if r.Event == nil {
			return fmt.Errorf("%w: a watch reply without an event", ErrUnavailable)
		}
		return fn(*r.Event)
	})
}

func (c *Client) Publish(ctx context.Context, topic string, payload []byte) (Message, error) {
	resp, err := c.call(ctx, Request{Op: "mailbox.publish", Topic: topic, Payload: payload})
	if err != nil {
		return Message{}, err
	}
	if resp.Message == nil {
		return Message{}, fmt.Errorf("%w: a publish reply without its message", ErrUnavailable)
	}
	return *resp.Message, nil
}

func (c *Client) Read(ctx context.Context, topic string, from int64, max int) ([]Message, error) {
	resp, err := c.call(ctx, Request{Op: "mailbox.read", Topic: topic, From: &from, Max: max})
	if err != nil {
		return nil, err
	}
	return resp.Messages, nil
}

func (c *Client) Subscribe(ctx context.Context, topic string, from int64, fn func(Message) error) error {
	return c.stream(ctx, Request{Op: "mailbox.subscribe", Topic: topic, From: &from}, func(r *Response) error {
		if r.Delivery == nil {
			return fmt.Errorf("%w: a subscription reply without a message", ErrUnavailable)
		}
		return fn(*r.Delivery)
	})
}
