package supervisor

import (
	"context"
	"net"
	"net/http"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/snapshot"
)

// Files lent with a control request. A confined supervisor may be unable
// to open a file the request names (a layer's parent, which another
// user's jailed supervisor wrote: the supervisor holds no capability to
// read past its mode). The client, which can, opens it and sends the
// descriptors with the request's first bytes (SCM_RIGHTS over the control
// socket); the supervisor's handler takes them from its connection. No
// library: net/http has no place for ancillary data, and the two ends
// here are a connection wrapper each.

// maxLentFiles bounds the descriptors one control connection may lend: a
// snapshot chain's manifest and memory file for each of its snapshots.
// Any beyond it are closed as they arrive.
const maxLentFiles = 2 * snapshot.MaxChain

// lendingListener accepts control connections that keep what they are
// lent (lendingConn).
type lendingListener struct{ *net.UnixListener }

func (l lendingListener) Accept() (net.Conn, error) {
	c, err := l.AcceptUnix()
	if err != nil {
		return nil, err
	}
	return &lendingConn{UnixConn: c}, nil
}

// lendingConn is a control connection of the supervisor's that keeps the
// descriptors its client sent with its bytes, at most maxLentFiles, until
// a handler takes them (lentFiles) or it closes.
type lendingConn struct {
	*net.UnixConn
	mu    sync.Mutex
	files []*os.File
}

func (c *lendingConn) Read(b []byte) (int, error) {
	oob := make([]byte, unix.CmsgSpace(4*maxLentFiles))
	n, oobn, _, _, err := c.ReadMsgUnix(b, oob)
	if oobn > 0 {
		// Truncated (MSG_CTRUNC): the kernel closed what did not fit.
		c.keep(oob[:oobn])
	}
	return n, err
}

// keep keeps the descriptors of the control messages in oob.
func (c *lendingConn) keep(oob []byte) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			unix.CloseOnExec(fd)
			if len(c.files) >= maxLentFiles {
				unix.Close(fd)
				continue
			}
			c.files = append(c.files, os.NewFile(uintptr(fd), "lent"))
		}
	}
}

// take returns the files lent so far, which become the caller's.
func (c *lendingConn) take() []*os.File {
	c.mu.Lock()
	defer c.mu.Unlock()
	f := c.files
	c.files = nil
	return f
}

func (c *lendingConn) Close() error {
	closeFiles(c.take())
	return c.UnixConn.Close()
}

// closeFiles closes files.
func closeFiles(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

type lentKey struct{}

// withLendingConn is the control server's ConnContext: a handler's context
// reaches its connection's lent files (lentFiles).
func withLendingConn(ctx context.Context, c net.Conn) context.Context {
	if lc, ok := c.(*lendingConn); ok {
		return context.WithValue(ctx, lentKey{}, lc)
	}
	return ctx
}

// lentFiles takes the files lent on the connection of the request whose
// context ctx is; they become the caller's.
func lentFiles(ctx context.Context) []*os.File {
	if lc, ok := ctx.Value(lentKey{}).(*lendingConn); ok {
		return lc.take()
	}
	return nil
}

// lendingClient is controlClient for one request that lends files: its
// own connection, which sends them with its first bytes. The files stay
// the caller's.
func lendingClient(path string, files []*os.File) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "unix", path)
			if err != nil {
				return nil, err
			}
			return &lenderConn{UnixConn: c.(*net.UnixConn), files: files}, nil
		}}}
}

// lenderConn sends its files with the first bytes written to it.
type lenderConn struct {
	*net.UnixConn
	files []*os.File
	sent  bool
}

func (c *lenderConn) Write(b []byte) (int, error) {
	if c.sent || len(c.files) == 0 || len(b) == 0 {
		return c.UnixConn.Write(b)
	}
	c.sent = true
	fds := make([]int, len(c.files))
	for i, f := range c.files {
		fds[i] = int(f.Fd())
	}
	n, _, err := c.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
	if err != nil || n == len(b) {
		return n, err
	}
	m, err := c.UnixConn.Write(b[n:])
	return n + m, err
}
