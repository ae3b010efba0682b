package supervisor

// The client side: what the CLI, the MCP server and programs use to reach
// a running detached sandbox by name, over its supervisor's sockets (the
// control protocol, control.go, and the guest agent's). The server side,
// the supervisor process, is supervisor.go.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/ratelimit"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/store"
	"github.com/capsa-sandbox/capsa/virtio/vsock"
)

// pauseSandbox pauses the running detached sandbox name
// (sandbox.Sandbox.Pause) through its supervisor; its record says paused
// until resumeSandbox (Manager.Pause, Manager.Resume).
func pauseSandbox(ctx context.Context, st *store.Store, name string) error {
	return callLive(ctx, st, name, opPause, noBody{})
}

// setLimits changes the running detached sandbox name's I/O limits
// (sandbox.Sandbox.SetLimits), through its supervisor; its record is the
// caller's to change (Manager.UpdateLimits does both).
func setLimits(ctx context.Context, st *store.Store, name string, l ratelimit.Limits) error {
	return callLive(ctx, st, name, opLimits, l)
}

// sendNetworkPolicy puts p in force on the running detached sandbox
// name's NAT (sandbox.Sandbox.SetNetworkPolicy).
func sendNetworkPolicy(ctx context.Context, st *store.Store, name string, p *netstack.Policy) error {
	return callLive(ctx, st, name, opNetwork, networkBody{Policy: p})
}

// resumeSandbox runs the paused detached sandbox name again
// (sandbox.Sandbox.Resume).
func resumeSandbox(ctx context.Context, st *store.Store, name string) error {
	return callLive(ctx, st, name, opResume, noBody{})
}

// snapshotLive writes the running detached sandbox name to the snapshot
// directory dir (sandbox.Sandbox.SnapshotWith), through its supervisor,
// which reports the snapshot's steps to o.Progress as it goes.
func snapshotLive(ctx context.Context, st *store.Store, name, dir string, o sandbox.SnapshotOptions) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	body := snapshotBody{Dir: abs, Inventory: o.Inventory, Fork: o.Fork}
	var lent []*os.File
	if o.Parent != "" {
		if body.Parent, err = filepath.Abs(o.Parent); err != nil {
			return err
		}
		// Opened and checked here, and lent to the supervisor, which
		// may not open it (see lend.go).
		p, err := snapshot.Open(body.Parent)
		if err != nil {
			return fmt.Errorf("supervisor: snapshot %s: the parent: %w", name, err)
		}
		defer p.Close()
		if lent, err = p.Lend(); err != nil {
			return fmt.Errorf("supervisor: snapshot %s: the parent: %w", name, err)
		}
		defer snapshot.CloseLent(lent)
	}
	hc, err := liveClient(st, name, opSnapshot.name, lent)
	if err != nil {
		return err
	}
	return liveError(st, name, opSnapshot.name, opSnapshot.call(ctx, hc, body, snapshotSteps, o.Progress))
}

// snapshotSteps are the steps a supervisor reports of a snapshot.
var snapshotSteps = []string{sandbox.StepInventory, sandbox.StepCopyRunning, sandbox.StepMemory, sandbox.StepRootDisk}

// stopSandbox ends the detached sandbox name as `capsa stop` does: SIGTERM to the
// main process, SIGKILL after timeout (at once with kill), then the VM
// stops; a paused one is resumed first. It returns once the supervisor has
// recorded the end, or ctx ends.
func stopSandbox(ctx context.Context, st *store.Store, name string, timeout time.Duration, kill bool) error {
	if err := callLive(ctx, st, name, opStop, stopBody{Timeout: timeout, Kill: kill}); err != nil {
		return err
	}
	return waitEnded(ctx, st, name)
}

// callLive makes the control operation op with req on the live sandbox
// name and says what failed: the operation, the sandbox, and its end if
// it has ended.
func callLive[Req, Resp any](ctx context.Context, st *store.Store, name string, op controlOp[Req, Resp], req Req) error {
	hc, err := liveClient(st, name, op.name, nil)
	if err != nil {
		return err
	}
	_, err = op.call(ctx, hc, req)
	return liveError(st, name, op.name, err)
}

// liveClient is a client of the live sandbox name's supervisor for the
// operation op, lending it the files lend (none: nil).
func liveClient(st *store.Store, name, op string, lend []*os.File) (*http.Client, error) {
	rec, err := st.Get(name)
	if err != nil {
		return nil, err
	}
	if !rec.Alive() {
		return nil, fmt.Errorf("supervisor: %s %s: %w (%s)", op, name, ErrNotRunning, describeEnd(rec))
	}
	path := filepath.Join(st.SandboxDir(name), ControlSocket)
	if len(lend) > 0 {
		return lendingClient(path, lend), nil
	}
	return controlClient(path), nil
}

// liveError is err, the operation op's on the sandbox name, saying what
// failed: the operation, the sandbox, and its end if it has ended.
func liveError(st *store.Store, name, op string, err error) error {
	if err == nil {
		return nil
	}
	err = fmt.Errorf("supervisor: %s %s: %w", op, name, err)
	var te *transportError
	if errors.As(err, &te) {
		if rec, gerr := st.Get(name); gerr == nil && !rec.Alive() {
			err = fmt.Errorf("sandbox %s ended (%s): %w", name, describeEnd(rec), err)
		}
	}
	return err
}

// Handle is a running detached sandbox, reached by name: its guest
// operations (Exec, Stream, files, Info) are sandbox.Guest's, the same as
// an in-process Sandbox's.
type Handle struct {
	*sandbox.Guest
	Name  string
	store *store.Store
	http  *http.Client
}

// ErrNotRunning is wrapped when a sandbox exists but does not run.
var ErrNotRunning = errors.New("the sandbox is not running")

// ErrPaused is wrapped when a sandbox's guest is paused.
var ErrPaused = errors.New("the sandbox is paused")

// openHandle returns a handle to the running sandbox name.
func openHandle(ctx context.Context, st *store.Store, name string) (*Handle, error) {
	rec, err := st.Get(name)
	if err != nil {
		return nil, err
	}
	if rec.State == store.Paused {
		return nil, fmt.Errorf("supervisor: %s: %w (capsa resume %s runs it again)", name, ErrPaused, name)
	}
	if rec.State == store.Suspended {
		return nil, fmt.Errorf("supervisor: %s: %w, suspended to disk (capsa resume %s restores it)", name, ErrNotRunning, name)
	}
	if rec.State != store.Running {
		return nil, fmt.Errorf("supervisor: %s: %w (%s)", name, ErrNotRunning, describeEnd(rec))
	}
	dir := st.SandboxDir(name)
	agentPath := filepath.Join(dir, AgentSocket)
	h := &Handle{Name: name, store: st, http: controlClient(filepath.Join(dir, ControlSocket))}
	client := &agent.Client{Name: "capsa", Dial: func(ctx context.Context) (net.Conn, error) {
		return dialAgent(ctx, agentPath)
	}}
	h.Guest = sandbox.NewGuest(client, rec.Env, rec.Dir, rec.Spec.OutputLimit, h.explain)
	return h, nil
}

// explain adds the sandbox's end to an error, if it has ended.
func (h *Handle) explain(err error) error {
	if err == nil {
		return nil
	}
	if rec, gerr := h.store.Get(h.Name); gerr == nil && !rec.Alive() {
		return fmt.Errorf("sandbox %s ended (%s): %w", h.Name, describeEnd(rec), err)
	}
	return err
}

// describeEnd says how a sandbox that is not running got there.
func describeEnd(r *store.Record) string {
	var b strings.Builder
	b.WriteString(string(r.State))
	if r.ExitCode != nil {
		fmt.Fprintf(&b, ", exit code %d", *r.ExitCode)
	}
	if r.Reason != "" {
		b.WriteString(": " + r.Reason)
	}
	return b.String()
}

// Stop ends the sandbox: see Manager.Stop.
func (h *Handle) Stop(ctx context.Context, timeout time.Duration, kill bool) error {
	return stopSandbox(ctx, h.store, h.Name, timeout, kill)
}

// Stats reports what the sandbox has used so far (sandbox.Stats), asked
// of its supervisor.
func (h *Handle) Stats(ctx context.Context) (*sandbox.Stats, error) {
	st, err := opStats.call(ctx, h.http, noBody{})
	if err != nil {
		err = fmt.Errorf("supervisor: stats of %s: %w", h.Name, err)
		var te *transportError
		if errors.As(err, &te) {
			err = h.explain(err)
		}
		return nil, err
	}
	return st, nil
}

// WaitEnded waits until the sandbox's record says it no longer runs.
func (h *Handle) WaitEnded(ctx context.Context) error { return waitEnded(ctx, h.store, h.Name) }

// Close lets go of the handle's idle connections to the supervisor; the
// sandbox runs on.
func (h *Handle) Close() { h.http.CloseIdleConnections() }

func waitEnded(ctx context.Context, st *store.Store, name string) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		rec, err := st.Get(name)
		if err != nil {
			return err
		}
		if !rec.Alive() {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("supervisor: %s still runs: %w", name, ctx.Err())
		case <-tick.C:
		}
	}
}

// dialAgent reaches the guest agent through the supervisor's hybrid-vsock
// socket.
func dialAgent(ctx context.Context, path string) (net.Conn, error) {
	return vsock.DialHybrid(ctx, path, agent.Port)
}
