package shim

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/containerd/namespaces"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
)

// TestMain lets the test binary be the shim, as capsa is under that name.
func TestMain(m *testing.M) {
	if filepath.Base(os.Args[0]) == BinaryName {
		Main()
		return
	}
	os.Exit(m.Run())
}

// TestStartPrintsAnAddressEveryContainerdReads runs the shim's start as
// containerd does, in a bundle, and checks what it prints against how
// each containerd generation reads it: 1.6 takes the whole output as the
// address; 1.7 to 2.2 try JSON first and 2.3 on a protobuf
// BootstrapResult first, and both take output that is neither as a bare
// address (task API v2 over ttrpc). Then the shim's server answers the
// Task API on that address, and shuts down when asked with no container.
func TestStartPrintsAnAddressEveryContainerdReads(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the shim's sockets are in /run/containerd/s, which only root may make")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bundle := t.TempDir()
	spec, _ := json.Marshal(goodSpec())
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o644); err != nil {
		t.Fatal(err)
	}
	// The server writes its log to the bundle's fifo, which containerd
	// reads.
	if err := syscall.Mkfifo(filepath.Join(bundle, "log"), 0o600); err != nil {
		t.Fatal(err)
	}
	logr, err := os.OpenFile(filepath.Join(bundle, "log"), os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer logr.Close()
	id := "unit-" + filepath.Base(bundle)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := &exec.Cmd{Path: self, Args: []string{BinaryName, "-namespace", "capsa-unit", "-id", id,
		"-address", "/run/containerd/capsa-unit-test.sock", "start"}, Dir: bundle,
		Env: append(os.Environ(), "TTRPC_ADDRESS=/run/containerd/capsa-unit-test.sock.ttrpc")}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("start: %v; stderr: %s", err, exitStderr(err))
	}
	addr := string(out)
	if !strings.HasPrefix(addr, "unix:///run/containerd/s/") || strings.ContainsAny(addr, " \n\t") {
		t.Fatalf("start printed %q, want a bare unix:// address (containerd 1.6 reads nothing else)", addr)
	}
	var js map[string]any
	if json.Unmarshal(out, &js) == nil {
		t.Errorf("start's output %q is JSON; containerd 1.6 cannot read it", addr)
	}
	if proto.Unmarshal(out, &emptypb.Empty{}) == nil {
		t.Errorf("start's output %q parses as a protobuf message: containerd 2.3 would not fall back to a bare address", addr)
	}
	if b, err := os.ReadFile(filepath.Join(bundle, "address")); err != nil || string(b) != addr {
		t.Errorf("the bundle's address file = %q, %v; want %q", b, err, addr)
	}
	path := strings.TrimPrefix(addr, "unix://")
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("dial the shim: %v", err)
	}
	client := ttrpc.NewClient(conn)
	defer client.Close()
	tasks := taskAPI.NewTaskClient(client)
	nctx := namespaces.WithNamespace(ctx, "capsa-unit")
	resp, err := tasks.Connect(nctx, &taskAPI.ConnectRequest{ID: id})
	if err != nil {
		t.Fatalf("Connect: %v", err)
	}
	if resp.ShimPid == 0 || resp.TaskPid != 0 {
		t.Errorf("Connect = shim %d, task %d; want the shim's PID and no task yet", resp.ShimPid, resp.TaskPid)
	}
	if _, err := tasks.State(nctx, &taskAPI.StateRequest{ID: "nope"}); err == nil || !strings.Contains(err.Error(), "not found") {
		t.Errorf("State of an unknown container = %v, want not found", err)
	}
	if _, err := tasks.Create(nctx, &taskAPI.CreateTaskRequest{ID: id, Bundle: "/etc"}); err == nil || !strings.Contains(err.Error(), "not containerd's bundle") {
		t.Errorf("Create with a bundle outside containerd's = %v, want it refused", err)
	}
	if _, err := tasks.Create(nctx, &taskAPI.CreateTaskRequest{ID: "../" + id, Bundle: bundle}); err == nil || !strings.Contains(err.Error(), "the task's id") {
		t.Errorf("Create with the id ../%s = %v, want it refused", id, err)
	}
	tasks.Shutdown(nctx, &taskAPI.ShutdownRequest{ID: id})
	deadline := time.Now().Add(20 * time.Second)
	for syscall.Kill(int(resp.ShimPid), 0) == nil {
		if time.Now().After(deadline) {
			syscall.Kill(int(resp.ShimPid), syscall.SIGKILL)
			t.Fatal("the shim still runs 20s after Shutdown with no container")
		}
		time.Sleep(50 * time.Millisecond)
	}
	os.Remove(path)
}

func exitStderr(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}
