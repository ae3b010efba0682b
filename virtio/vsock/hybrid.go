package vsock

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Hybrid vsock, as Firecracker defines it, lets tools that know nothing of
// capsa reach the guest through a Unix socket:
//
//   - host to guest: connect to the socket at path, send "CONNECT <port>\n",
//     read "OK <hostport>\n", then the stream is the guest connection;
//   - guest to host: a guest connection to port P, where no Go listener
//     is registered, is forwarded to a Unix socket at "<path>_<P>" if one
//     exists.

const handshakeTimeout = 10 * time.Second

// HybridSocket serves a device's hybrid-vsock Unix socket.
type HybridSocket struct {
	dev  *Device
	path string
	l    net.Listener
	log  *slog.Logger
	wg   sync.WaitGroup // accept, and every serve and forward goroutine

	mu     sync.Mutex
	closed bool
	conns  map[io.Closer]struct{} // live client and guest connections
	// Clients on the Unix socket: how many are connected, and when one
	// last came or went (Activity).
	clients    int
	lastClient time.Time
}

// ServeUnix listens on path and serves the hybrid-vsock handshake until
// Close. It also forwards guest connections to "<path>_<port>" sockets.
func (d *Device) ServeUnix(path string) (*HybridSocket, error) {
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("vsock: hybrid socket: %w", err)
	}
	h := &HybridSocket{dev: d, path: path, l: l, log: d.log, conns: map[io.Closer]struct{}{}}
	d.mu.Lock()
	d.fallback = h.forward
	d.mu.Unlock()
	h.wg.Add(1)
	go h.accept()
	return h, nil
}

// Close stops serving, ends every connection it joined and waits for
// their goroutines, and removes the socket.
func (h *HybridSocket) Close() error {
	h.dev.mu.Lock()
	h.dev.fallback = nil
	h.dev.mu.Unlock()
	err := h.l.Close()
	h.mu.Lock()
	h.closed = true
	conns := make([]io.Closer, 0, len(h.conns))
	for c := range h.conns {
		conns = append(conns, c)
	}
	h.mu.Unlock()
	// Closed outside h.mu: closing a guest connection takes the device
	// lock, under which forward takes h.mu.
	for _, c := range conns {
		c.Close()
	}
	h.wg.Wait()
	return err
}

// start counts a goroutine about to serve conns, unless h is closed; the
// goroutine calls the returned func when it ends.
func (h *HybridSocket) start(conns ...io.Closer) (func(), bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, false
	}
	h.wg.Add(1)
	for _, c := range conns {
		h.conns[c] = struct{}{}
	}
	return func() {
		h.mu.Lock()
		for _, c := range conns {
			delete(h.conns, c)
		}
		h.mu.Unlock()
		h.wg.Done()
	}, true
}

// track adds a connection made by a started goroutine, closing it at once
// if h is closed meanwhile.
func (h *HybridSocket) track(c io.Closer) bool {
	h.mu.Lock()
	closed := h.closed
	if !closed {
		h.conns[c] = struct{}{}
	}
	h.mu.Unlock()
	if closed {
		c.Close()
	}
	return !closed
}

func (h *HybridSocket) untrack(c io.Closer) {
	h.mu.Lock()
	delete(h.conns, c)
	h.mu.Unlock()
}

func (h *HybridSocket) accept() {
	defer h.wg.Done()
	for {
		c, err := h.l.Accept()
		if err != nil {
			return
		}
		end, ok := h.start(c)
		if !ok {
			c.Close()
			return
		}
		h.client(+1)
		go func() {
			defer end()
			defer h.client(-1)
			h.serve(c)
		}()
	}
}

// client counts a client connection coming (+1) or going (-1).
func (h *HybridSocket) client(d int) {
	h.mu.Lock()
	h.clients += d
	h.lastClient = time.Now()
	h.mu.Unlock()
}

// Activity says how many clients are connected to the Unix socket now and
// when one last connected or left (zero if none ever did): a sandbox is
// idle while nobody is connected.
func (h *HybridSocket) Activity() (clients int, last time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.clients, h.lastClient
}

// serve runs one client's handshake, then joins it to the guest connection.
func (h *HybridSocket) serve(c net.Conn) {
	c.SetDeadline(time.Now().Add(handshakeTimeout))
	r := bufio.NewReader(io.LimitReader(c, 64))
	line, err := r.ReadString('\n')
	port, perr := parseConnect(line)
	if err != nil || perr != nil {
		fmt.Fprintf(c, "ERR %v\n", errors.Join(err, perr))
		c.Close()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	g, err := h.dev.Dial(ctx, port)
	cancel()
	if err != nil {
		fmt.Fprintf(c, "ERR %v\n", err)
		c.Close()
		return
	}
	if !h.track(g) {
		c.Close()
		return
	}
	defer h.untrack(g)
	c.SetDeadline(time.Time{})
	fmt.Fprintf(c, "OK %d\n", g.key.host)
	// Bytes the client sent right after its CONNECT line are buffered.
	splice(c, g, r.Buffered(), r)
}

// parseConnect reads "CONNECT <port>\n".
func parseConnect(line string) (uint32, error) {
	f := strings.Fields(line)
	if len(f) != 2 || f[0] != "CONNECT" || !strings.HasSuffix(line, "\n") {
		return 0, fmt.Errorf("expected \"CONNECT <port>\\n\", got %q", line)
	}
	p, err := strconv.ParseUint(f[1], 10, 32)
	if err != nil {
		return 0, fmt.Errorf("bad port %q", f[1])
	}
	return uint32(p), nil
}

// forward offers a guest connection to "<path>_<port>"; it runs under the
// device lock, so the dial happens on its own goroutine.
func (h *HybridSocket) forward(port uint32, g *Conn) bool {
	sock := fmt.Sprintf("%s_%d", h.path, port)
	if st, err := os.Stat(sock); err != nil || st.Mode().Type() != os.ModeSocket {
		return false
	}
	end, ok := h.start(g)
	if !ok {
		return false // closing: as if nobody listened
	}
	go func() {
		defer end()
		c, err := net.Dial("unix", sock)
		if err != nil {
			h.log.Debug("vsock: forward guest connection", "socket", sock, "err", err)
			g.Close()
			return
		}
		if !h.track(c) {
			g.Close()
			return
		}
		defer h.untrack(c)
		splice(c, g, 0, nil)
	}()
	return true
}

// splice copies both ways until both directions end, passing half-closes
// on. pending bytes already read from the client come first.
func splice(c net.Conn, g *Conn, pending int, r *bufio.Reader) {
	done := make(chan struct{}, 2)
	go func() {
		var src io.Reader = c
		if pending > 0 {
			head, _ := r.Peek(pending)
			src = io.MultiReader(strings.NewReader(string(head)), c)
		}
		io.Copy(g, src)
		g.CloseWrite()
		done <- struct{}{}
	}()
	go func() {
		io.Copy(c, g)
		if cw, ok := c.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		}
		done <- struct{}{}
	}()
	<-done
	<-done
	c.Close()
	g.Close()
}

// DialHybrid connects to a guest port through the hybrid-vsock socket at
// path: the client side of ServeUnix's handshake.
func DialHybrid(ctx context.Context, path string, port uint32) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("vsock: dial %s: %w", path, err)
	}
	deadline := time.Now().Add(handshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	c.SetDeadline(deadline)
	if _, err := fmt.Fprintf(c, "CONNECT %d\n", port); err != nil {
		c.Close()
		return nil, fmt.Errorf("vsock: dial %s port %d: %w", path, port, err)
	}
	// The answer is read a byte at a time: what follows its newline is
	// the guest's, and stays in the connection.
	var line []byte
	var b [1]byte
	for len(line) < 64 {
		if _, err := io.ReadFull(c, b[:]); err != nil {
			c.Close()
			return nil, fmt.Errorf("vsock: dial %s port %d: %w", path, port, err)
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
	}
	if !strings.HasPrefix(string(line), "OK ") {
		c.Close()
		return nil, fmt.Errorf("vsock: dial %s port %d: %q", path, port, line)
	}
	c.SetDeadline(time.Time{})
	return c, nil
}
