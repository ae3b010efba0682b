// Package shim is capsa's containerd runtime shim v2
// (io.containerd.capsa.v2, the binary containerd-shim-capsa-v2, which is
// capsa itself under that name): containerd, and Kubernetes through its
// CRI plugin and a RuntimeClass, run a pod's containers in one capsa
// microVM.
//
// Its starting point is containerd's own shim library (containerd 1.7's
// runtime/v2/shim, on ttrpc), chosen because its `start` prints a bare
// address, which containerd 1.6 requires and 1.7 and 2.x still accept:
// one binary serves all three with the task API v2. containerd 2.x's
// library prints a protobuf that 1.6 cannot read.
//
// A pod is one detached capsa sandbox, owned by the state directory's
// supervisor.Manager like any other (capsa ps lists it, capsa stats
// measures it). The shim is an adapter: containerd's Task service over
// the manager's sandbox and its agent. Each container's root (the
// snapshotter's mounts, mounted by the shim on the host) lies in a
// directory shared into the VM over 9P, and the agent runs the
// container's processes in mount namespaces of their own pivoted into it
// (agent.Container).
package shim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/containerd/mount"
	"github.com/containerd/containerd/namespaces"
	"github.com/containerd/containerd/pkg/shutdown"
	"github.com/containerd/containerd/plugin"
	cdshim "github.com/containerd/containerd/runtime/v2/shim"
	"github.com/sirupsen/logrus"

	"github.com/capsa-sandbox/capsa/supervisor"
)

// BinaryName is the name containerd runs for runtime io.containerd.capsa.v2.
const BinaryName = "containerd-shim-capsa-v2"

// RuntimeName is the runtime's name in containerd.
const RuntimeName = "io.containerd.capsa.v2"

// podFile, in a container's bundle, names the pod VM and its directory,
// so that `delete` can clean up after a shim that died.
const podFile = "capsa-pod.json"

// Main runs the shim binary (its argv as containerd gives it) and exits.
func Main() {
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(logOut{}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	plugin.Register(&plugin.Registration{
		Type:     plugin.TTRPCPlugin,
		ID:       "task",
		Requires: []plugin.Type{plugin.EventPlugin, plugin.InternalPlugin},
		InitFn: func(ic *plugin.InitContext) (interface{}, error) {
			pp, err := ic.GetByID(plugin.EventPlugin, "publisher")
			if err != nil {
				return nil, err
			}
			ss, err := ic.GetByID(plugin.InternalPlugin, "shutdown")
			if err != nil {
				return nil, err
			}
			return newService(ic.Context, log, pp.(cdshim.Publisher), ss.(shutdown.Service))
		},
	})
	cdshim.RunManager(ctx, binary{log: log}, func(c *cdshim.Config) {
		// The shim reaps no children for a runc: its only children are
		// pod supervisors, which live in sessions of their own.
		c.NoSubreaper = true
	})
}

// logOut writes to where containerd's shim library sends its log: the
// bundle's log fifo, which containerd copies into its own log, once the
// library has opened it (stderr before).
type logOut struct{}

func (logOut) Write(b []byte) (int, error) { return logrus.StandardLogger().Out.Write(b) }

// binary is the shim's start and delete actions (cdshim.Manager).
type binary struct{ log *slog.Logger }

func (binary) Name() string { return RuntimeName }

// Start spawns the shim's server for the container's pod, or finds the
// one that serves it already, and returns its address.
func (b binary) Start(ctx context.Context, id string, opts cdshim.StartOpts) (_ string, retErr error) {
	bundle, err := os.Getwd()
	if err != nil {
		return "", err
	}
	spec, err := readSpec(bundle)
	if err != nil {
		return "", err
	}
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return "", err
	}
	address, err := cdshim.SocketAddress(ctx, opts.Address, groupID(spec, id))
	if err != nil {
		return "", err
	}
	socket, err := cdshim.NewSocket(address)
	if err != nil {
		if !cdshim.SocketEaddrinuse(err) {
			return "", fmt.Errorf("shim: make the socket: %w", err)
		}
		if cdshim.CanConnect(address) { // the pod's shim serves already
			return address, cdshim.WriteAddress("address", address)
		}
		if err := cdshim.RemoveSocket(address); err != nil {
			return "", fmt.Errorf("shim: remove a dead shim's socket: %w", err)
		}
		if socket, err = cdshim.NewSocket(address); err != nil {
			return "", fmt.Errorf("shim: make the socket: %w", err)
		}
	}
	defer func() {
		if retErr != nil {
			socket.Close()
			cdshim.RemoveSocket(address)
		}
	}()
	if err := cdshim.WriteAddress("address", address); err != nil {
		return "", err
	}
	f, err := socket.File()
	if err != nil {
		return "", err
	}
	defer f.Close()
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	args := []string{BinaryName, "-namespace", ns, "-id", id, "-address", opts.Address}
	if opts.Debug {
		args = append(args, "-debug")
	}
	cmd := &exec.Cmd{Path: self, Args: args, Dir: bundle, Env: os.Environ(),
		ExtraFiles: []*os.File{f}, SysProcAttr: &syscall.SysProcAttr{Setpgid: true}}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("shim: start its server: %w", err)
	}
	go cmd.Wait()
	return address, nil
}

// Stop is `delete`: it cleans up after a container whose shim died. The
// container's root is unmounted and, if it was its pod's sandbox
// container, the pod VM is stopped and removed.
func (b binary) Stop(ctx context.Context, id string) (cdshim.StopStatus, error) {
	bundle, err := os.Getwd()
	if err != nil {
		return cdshim.StopStatus{}, err
	}
	dir := filepath.Join(filepath.Dir(bundle), id)
	if pod, err := readPodFile(dir); err == nil {
		if err := mount.UnmountAll(filepath.Join(pod.Dir, id, "rootfs"), 0); err != nil {
			b.log.Warn("shim: delete: unmount the container's root", "id", id, "err", err)
		}
		if pod.Sandbox {
			if m, err := supervisor.OpenManager(pod.State); err == nil {
				m.Stop(ctx, pod.Name, 0, true)
				m.Remove(ctx, pod.Name)
			}
			if err := removePodDir(pod.Dir); err != nil {
				b.log.Warn("shim: delete", "id", id, "err", err)
			}
		}
	}
	return cdshim.StopStatus{ExitedAt: time.Now(), ExitStatus: 128 + int(syscall.SIGKILL)}, nil
}

var nameUnsafe = regexp.MustCompile(`[^a-zA-Z0-9_.-]`)

// podName is the capsa sandbox name of a pod: the namespace and the
// group's id, shortened with a hash when too long for a name.
func podName(ns, group string) string {
	name := nameUnsafe.ReplaceAllString(ns+"-"+group, "_")
	name = strings.TrimLeft(name, "_.-")
	if len(name) > 40 || name == "" {
		sum := sha256.Sum256([]byte(ns + "\x00" + group))
		short := nameUnsafe.ReplaceAllString(ns, "_")
		if len(short) > 16 {
			short = short[:16]
		}
		name = strings.TrimLeft(short+"-"+hex.EncodeToString(sum[:8]), "_.-")
	}
	return name
}
