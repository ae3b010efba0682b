package agent

import (
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"
)

// dialPort serves OpDial: it connects to port on the guest's loopback and
// carries the bytes between that connection and c as Data frames, each
// way's end as an End frame, until both ways ended or either failed.
func dialPort(ctx context.Context, c *Conn, port int) error {
	if port <= 0 || port > 65535 {
		return fmt.Errorf("dial: port %d: want 1 to 65535", port)
	}
	d := net.Dialer{Timeout: 10 * time.Second}
	tc, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return fmt.Errorf("dial port %d: %w", port, err)
	}
	defer tc.Close()
	if err := reply(c, Empty{}); err != nil {
		return nil
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		buf := make([]byte, chunk)
		for {
			n, err := tc.Read(buf)
			if n > 0 {
				if c.WriteFrame(FrameData, buf[:n]) != nil {
					tc.Close()
					return
				}
			}
			if err != nil {
				c.WriteFrame(FrameEnd, nil)
				return
			}
		}
	}()
	for {
		t, b, err := c.ReadFrame()
		if err != nil {
			tc.Close() // the host went: so does the guest's side
			break
		}
		if t == FrameEnd {
			if cw, ok := tc.(interface{ CloseWrite() error }); ok {
				cw.CloseWrite()
			}
			continue
		}
		if t != FrameData {
			tc.Close()
			break
		}
		if _, err := tc.Write(b); err != nil {
			tc.Close()
			break
		}
	}
	wg.Wait()
	return nil
}

// PortConn is a connection to a guest port (Client.DialPort), as a
// net.Conn.
type PortConn struct {
	net.Conn // the agent connection, for its addresses and deadlines
	c        *Conn
	done     func()
	rmu      sync.Mutex
	rest     []byte
	eof      bool
}

// DialPort connects to the guest's TCP port on its loopback, through the
// agent.
func (cl *Client) DialPort(ctx context.Context, port int) (*PortConn, error) {
	c, nc, done, err := cl.openStream(ctx, Request{Op: OpDial, Port: port})
	if err != nil {
		return nil, err
	}
	return &PortConn{Conn: nc, c: c, done: done}, nil
}

// Read reads what the guest's side sent; io.EOF once it is done writing.
func (p *PortConn) Read(b []byte) (int, error) {
	p.rmu.Lock()
	defer p.rmu.Unlock()
	for len(p.rest) == 0 {
		if p.eof {
			return 0, io.EOF
		}
		t, data, err := p.c.ReadFrame()
		if err != nil {
			return 0, err
		}
		switch t {
		case FrameData:
			p.rest = data
		case FrameEnd:
			p.eof = true
		case FrameError:
			return 0, expectJSON(t, data, FrameData, nil)
		default:
			return 0, fmt.Errorf("agent: dial: unexpected %v frame", t)
		}
	}
	n := copy(b, p.rest)
	p.rest = p.rest[n:]
	return n, nil
}

// Write sends b to the guest's side.
func (p *PortConn) Write(b []byte) (int, error) {
	n := 0
	for len(b) > 0 {
		k := min(len(b), chunk)
		if err := p.c.WriteFrame(FrameData, b[:k]); err != nil {
			return n, err
		}
		n += k
		b = b[k:]
	}
	return n, nil
}

// CloseWrite tells the guest's side this side is done writing.
func (p *PortConn) CloseWrite() error { return p.c.WriteFrame(FrameEnd, nil) }

// Close ends the connection.
func (p *PortConn) Close() error { p.done(); return nil }

var _ net.Conn = (*PortConn)(nil)
