package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// criEnv drives containerd's CRI plugin with crictl (sigs.k8s.io/cri-tools,
// scripts/cri-tools-build.sh) as a kubelet would, without one.
type criEnv struct {
	*containerdEnv
	crictl string
}

// startCRI starts containerd (bundle: Debian 12's 1.6, or 2.x) with its
// CRI plugin: capsa's
// shim as the runtime handler "capsa" (a RuntimeClass's), runc as "runc",
// the overlayfs
// snapshotter, a CNI bridge network from the CNI plugins' own binaries,
// and the test's python image as the sandbox image, imported beforehand.
func startCRI(t testing.TB, bundle string) *criEnv {
	t.Helper()
	tools := artifact(t, "cri-tools")
	// The CRI plugin copies a node's /etc/hosts and /etc/resolv.conf into
	// each pod; the nested host's L1 (busybox) has neither.
	for name, text := range map[string]string{"/etc/hosts": "127.0.0.1 localhost\n", "/etc/resolv.conf": "nameserver 10.77.0.1\n"} {
		if _, err := os.Stat(name); errors.Is(err, os.ErrNotExist) {
			if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(name, []byte(text), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	conf := func(tmp string) string {
		cniConf := filepath.Join(tmp, "cni.d")
		if err := os.MkdirAll(cniConf, 0o755); err != nil {
			t.Fatal(err)
		}
		network := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "capsa-test", "plugins": [{
  "type": "bridge", "bridge": "capsa-cni0", "isGateway": true, "ipMasq": false,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.77.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}
}]}`, filepath.Join(tmp, "cni-ipam"))
		if err := os.WriteFile(filepath.Join(cniConf, "10-capsa-test.conflist"), []byte(network), 0o644); err != nil {
			t.Fatal(err)
		}
		if bundle == "containerd2" {
			// containerd 2's configuration (version 3) splits CRI into
			// its images and runtime plugins; its transfer service
			// unpacks for the snapshotters it names.
			return fmt.Sprintf(`version = 3
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = 'capsa.test/python:1'
[plugins.'io.containerd.cri.v1.runtime']
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'capsa'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.capsa]
      runtime_type = 'io.containerd.capsa.v2'
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [%q]
    conf_dir = %q
[[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
  platform = 'linux/amd64'
  snapshotter = 'overlayfs'
`, filepath.Join(tools, "cni"), cniConf)
		}
		return fmt.Sprintf(`version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "capsa.test/python:1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "capsa"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.capsa]
      runtime_type = "io.containerd.capsa.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, filepath.Join(tools, "cni"), cniConf)
	}
	// runc and containerd's runc shim, the benchmark's anchor, on
	// containerd's PATH.
	e := &criEnv{containerdEnv: startContainerdWith(t, bundle, conf, filepath.Join(tools, "bin")), crictl: filepath.Join(tools, "bin", "crictl")}
	e.ns = "k8s.io"
	e.importImageWith("overlayfs")
	return e
}

// cri runs crictl and fails the test unless it exits 0; it returns stdout.
func (e *criEnv) cri(stdin string, args ...string) string {
	e.t.Helper()
	out, errs, code := e.criRun(stdin, args...)
	if code != 0 {
		e.t.Fatalf("crictl %s: exit %d; stderr: %s", strings.Join(args, " "), code, errs)
	}
	return out
}

func (e *criEnv) criRun(stdin string, args ...string) (string, string, int) {
	ep := "unix://" + e.address
	start := time.Now()
	out, errs, code := runTool(3*time.Minute, e.env, stdin, e.crictl, append([]string{"--runtime-endpoint", ep, "--image-endpoint", ep, "--timeout", "3m"}, args...)...)
	e.t.Logf("crictl %s: exit %d after %v\nstdout: %q\nstderr: %q", strings.Join(args, " "), code, time.Since(start).Round(time.Millisecond), tailLines(out, 10), tailLines(errs, 10))
	return out, errs, code
}

// writeJSON writes v as JSON to a file in dir and returns its path.
func writeJSON(t testing.TB, dir, name string, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestContainerdCRI runs a pod through containerd's CRI plugin (1.6's,
// then 2.x's) with crictl, as a kubelet with a RuntimeClass naming capsa
// would: the pod is
// one capsa microVM (capsa ps lists it) on a CNI bridge network, which is
// its guest's: the node reaches a container's server at the pod's IP, and
// the guest reaches a server on the node from the pod's IP; two containers
// in it share a file through an emptyDir and reach each other over
// localhost; exec -s, exec -i, logs, stats, stop and removal work.
func TestContainerdCRI(t *testing.T) {
	for _, c := range []struct{ name, bundle string }{
		{"containerd-1.6", "containerd"},
		{"containerd-2.x", "containerd2"},
	} {
		t.Run(c.name, func(t *testing.T) { testContainerdCRI(t, startCRI(t, c.bundle)) })
	}
}

func testContainerdCRI(t *testing.T, e *criEnv) {
	dir := t.TempDir()
	emptyDir := filepath.Join(dir, "emptydir")
	if err := os.MkdirAll(emptyDir, 0o777); err != nil {
		t.Fatal(err)
	}
	// A read-only volume of the client's: read-only in its container and
	// on the host too, where the shim binds it for the VM.
	configDir := filepath.Join(dir, "config")
	if err := os.MkdirAll(configDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(configDir, "setting"), []byte("v1"), 0o644); err != nil {
		t.Fatal(err)
	}
	logs := filepath.Join(dir, "logs")
	pod := writeJSON(t, dir, "pod.json", map[string]any{
		"metadata":      map[string]any{"name": "p1", "namespace": "default", "uid": "p1-uid", "attempt": 0},
		"log_directory": logs,
		"linux":         map[string]any{},
	})
	mounts := []map[string]any{{"container_path": "/data", "host_path": emptyDir}}
	server := writeJSON(t, dir, "server.json", map[string]any{
		"metadata": map[string]any{"name": "server"},
		"image":    map[string]any{"image": "capsa.test/python:1"},
		"command":  []string{"sh", "-c", "echo from-server > /data/shared; echo server-up; exec python3 -m http.server 8080 --directory /data"},
		"log_path": "server.log",
		"mounts":   mounts,
	})
	client := writeJSON(t, dir, "client.json", map[string]any{
		"metadata": map[string]any{"name": "client"},
		"image":    map[string]any{"image": "capsa.test/python:1"},
		"command": []string{"bash", "-c", `while ! test -e /data/shared; do sleep 0.2; done; echo "read $(cat /data/shared)"
for i in $(seq 1000); do # minutes: the server's Python starts slowly from a 9P root
  body=$(timeout 5 bash -c "` + httpGet("127.0.0.1:8080", "/shared") + `" 2>/dev/null) && [ -n "$body" ] && { echo "fetched $body"; break; }
  sleep 0.3
done
exec sleep 1000`},
		"log_path": "client.log",
		"mounts":   append(mounts, map[string]any{"container_path": "/config", "host_path": configDir, "readonly": true}),
		// Kubernetes' RuntimeDefault: containerd's default profile,
		// which the guest applies (the server runs Unconfined).
		"linux": map[string]any{"security_context": map[string]any{"seccomp": map[string]any{"profile_type": 0}},
			"resources": map[string]any{"memory_limit_in_bytes": 100 << 20}},
	})
	// hog outgrows its 64 MiB: its cgroup's OOM killer ends it, in a
	// VM of 512 MiB where the other containers go on.
	hog := writeJSON(t, dir, "hog.json", map[string]any{
		"metadata": map[string]any{"name": "hog"},
		"image":    map[string]any{"image": "capsa.test/python:1"},
		"command":  []string{"python3", "-c", "a = []\nwhile True: a.append(bytearray(8 << 20))"},
		"log_path": "hog.log",
		"linux":    map[string]any{"resources": map[string]any{"memory_limit_in_bytes": 64 << 20}},
	})

	podID := strings.TrimSpace(e.cri("", "runp", "--runtime", "capsa", pod))
	ps := capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, "ps")
	if !strings.Contains(ps.stdout, "k8s.io-") {
		t.Errorf("capsa ps = %q, want the pod's VM", ps.stdout)
	}
	inspect := e.cri("", "inspectp", podID)
	var pi struct {
		Status struct {
			State   string `json:"state"`
			Network struct {
				IP string `json:"ip"`
			} `json:"network"`
		} `json:"status"`
	}
	if err := json.Unmarshal([]byte(inspect), &pi); err != nil {
		t.Fatalf("crictl inspectp: %v", err)
	}
	if pi.Status.State != "SANDBOX_READY" || !strings.HasPrefix(pi.Status.Network.IP, "10.77.0.") {
		t.Errorf("the pod: state %q, IP %q; want ready, with an IP of the CNI network 10.77.0.0/24", pi.Status.State, pi.Status.Network.IP)
	}

	serverID := strings.TrimSpace(e.cri("", "create", podID, server, pod))
	e.cri("", "start", serverID)
	clientID := strings.TrimSpace(e.cri("", "create", podID, client, pod))
	e.cri("", "start", clientID)

	waitLog := func(id, want string) string {
		t.Helper()
		// A bound, not a speed: the server's Python, started from a
		// root shared over 9P, took over 2 minutes once on a slow machine.
		deadline := time.Now().Add(10 * time.Minute)
		for {
			out, errs, _ := e.criRun("", "logs", id)
			if strings.Contains(out+errs, want) {
				return out + errs
			}
			if time.Now().After(deadline) {
				t.Fatalf("crictl logs %s never showed %q: %q", id, want, out+errs)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	waitLog(serverID, "server-up")
	waitLog(clientID, "read from-server")
	waitLog(clientID, "fetched from-server")

	// The pod's network is the guest's: the pod's IP answers on the
	// server's port from the node, and the guest reaches a server on the
	// node from the pod's IP.
	podIP := pi.Status.Network.IP
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Get("http://" + podIP + ":8080/shared")
	if err != nil {
		t.Errorf("GET the pod's IP %s:8080 from the node: %v", podIP, err)
	} else {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.TrimSpace(string(body)) != "from-server" {
			t.Errorf("GET %s:8080/shared from the node = %q, want the server container's file", podIP, body)
		}
	}
	l, err := net.Listen("tcp", "10.77.0.1:0")
	if err != nil {
		t.Fatalf("listen on the CNI bridge's address: %v", err)
	}
	from := make(chan string, 1)
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case from <- r.RemoteAddr:
		default:
		}
		io.WriteString(w, "from-node")
	}))
	defer l.Close()
	if out := e.cri("", "exec", "-s", clientID, "timeout", "30", "bash", "-c", httpGet(l.Addr().String(), "/")); strings.TrimSpace(out) != "from-node" {
		t.Errorf("the guest fetching from the node's %s = %q, want from-node", l.Addr(), out)
	}
	select {
	case addr := <-from:
		if host, _, _ := net.SplitHostPort(addr); host != podIP {
			t.Errorf("the node saw the guest's request come from %s, want the pod's IP %s", addr, podIP)
		}
	default:
		t.Error("the node's server saw no request from the guest")
	}

	if out := e.cri("", "exec", "-s", clientID, "sh", "-c", "cat /data/shared; id -u; grep ^Seccomp: /proc/self/status"); !strings.Contains(out, "from-server\n0\nSeccomp:\t2") {
		t.Errorf("crictl exec -s = %q, want the shared file, uid 0 and the RuntimeDefault seccomp filter (Seccomp: 2)", out)
	}
	if out := e.cri("", "exec", "-s", serverID, "grep", "^Seccomp:", "/proc/self/status"); !strings.Contains(out, "Seccomp:\t0") {
		t.Errorf("crictl exec -s into the Unconfined server = %q, want no seccomp filter (Seccomp: 0)", out)
	}
	if out := e.cri("", "exec", "-s", clientID, "sh", "-c", "cat /config/setting; echo; echo x > /config/new; echo wrote=$?"); !strings.HasPrefix(out, "v1\n") || strings.Contains(out, "wrote=0") {
		t.Errorf("the client's read-only volume: %q; want its file read and a write refused", out)
	}
	checkReadOnlyHostBind(t, configDir)

	// Each container has its own cgroup in the guest, in a cgroup
	// namespace: its /sys/fs/cgroup is its own, with its memory limit,
	// which crictl update changes.
	if out := e.cri("", "exec", "-s", clientID, "sh", "-c", "cat /proc/self/cgroup /sys/fs/cgroup/memory.max"); !strings.Contains(out, "0::/\n104857600") {
		t.Errorf("the client's cgroup and memory.max = %q, want its own namespace's root (0::/) and its 100 MiB limit", out)
	}
	e.cri("", "update", "--memory", "209715200", clientID)
	if out := e.cri("", "exec", "-s", clientID, "cat", "/sys/fs/cgroup/memory.max"); strings.TrimSpace(out) != "209715200" {
		t.Errorf("the client's memory.max after crictl update --memory 209715200 = %q", out)
	}
	if out := e.cri("", "exec", "-s", serverID, "cat", "/sys/fs/cgroup/memory.max"); strings.TrimSpace(out) != "max" {
		t.Errorf("the server's memory.max = %q, want max (no limit)", out)
	}
	hogID := strings.TrimSpace(e.cri("", "create", podID, hog, pod))
	e.cri("", "start", hogID)
	var hs struct {
		Status struct {
			State    string `json:"state"`
			Reason   string `json:"reason"`
			ExitCode int    `json:"exitCode"`
		} `json:"status"`
	}
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		if err := json.Unmarshal([]byte(e.cri("", "inspect", hogID)), &hs); err != nil {
			t.Fatalf("crictl inspect hog: %v", err)
		}
		if hs.Status.State == "CONTAINER_EXITED" || time.Now().After(deadline) {
			break
		}
	}
	if hs.Status.State != "CONTAINER_EXITED" || hs.Status.Reason != "OOMKilled" || hs.Status.ExitCode != 137 {
		t.Errorf("hog after outgrowing its 64 MiB: %+v, want exited, OOMKilled, 137", hs.Status)
	}
	if out := e.cri("", "exec", "-s", clientID, "cat", "/data/shared"); strings.TrimSpace(out) != "from-server" {
		t.Errorf("the client after hog's OOM = %q, want it running on", out)
	}
	e.cri("", "rm", hogID)

	// Pause in a pod of several containers freezes that container's
	// cgroup in the guest: the server stops answering while the client
	// runs on, and answers again once resumed.
	e.ctrWant(0, "", "task", "pause", serverID)
	if out := e.ctrWant(0, "", "task", "ls"); !regexpMatch(serverID+`\s+\d+\s+PAUSED`, out) || !regexpMatch(clientID+`\s+\d+\s+RUNNING`, out) {
		t.Errorf("ctr task ls with the server paused = %q, want it PAUSED and the client RUNNING", out)
	}
	get := httpGet("127.0.0.1:8080", "/shared")
	// (crictl exits 1, saying how the command exited.)
	if out, errs, code := e.criRun("", "exec", "-s", clientID, "timeout", "3", "bash", "-c", get); code == 0 || !strings.Contains(errs, "exited with 124") {
		t.Errorf("the client fetching from the paused server: exit %d, %q %q; want timeout's 124", code, out, errs)
	}
	e.ctrWant(0, "", "task", "resume", serverID)
	if out := e.cri("", "exec", "-s", clientID, "timeout", "30", "bash", "-c", get); strings.TrimSpace(out) != "from-server" {
		t.Errorf("the client fetching from the resumed server = %q, want from-server", out)
	}
	if out := e.cri("two\nlines\n", "exec", "-i", clientID, "wc", "-l"); strings.TrimSpace(out) != "2" {
		t.Errorf("crictl exec -i wc -l = %q, want 2", out)
	}
	criTerminal(t, e, clientID)
	if out := e.cri("", "stats", "-o", "json"); !strings.Contains(out, clientID) || !strings.Contains(out, serverID) || !strings.Contains(out, "usageBytes") {
		t.Errorf("crictl stats = %q, want both containers with memory figures", out)
	}

	e.cri("", "stop", "--timeout", "10", clientID, serverID)
	e.cri("", "rm", clientID, serverID)
	e.cri("", "stopp", podID)
	e.cri("", "rmp", podID)
	ps = capsaWith(t, time.Minute, func(c *exec.Cmd) { c.Env = e.env }, "ps", "-a")
	if strings.Contains(ps.stdout, "k8s.io-") {
		t.Errorf("capsa ps -a after rmp = %q, want the pod's VM gone", ps.stdout)
	}
}

// httpGet is a bash script that fetches path from addr (host:port) over
// HTTP/1.0 through bash's /dev/tcp and prints the body. The test's execs
// fetched with Python's urllib, whose imports, read from a container root
// shared over 9P, took 15 to 50 s per exec in the nested host; bash takes
// 3 to 5 s there.
func httpGet(addr, path string) string {
	host, port, _ := net.SplitHostPort(addr)
	return fmt.Sprintf(`exec 3<>/dev/tcp/%s/%s || exit 1; printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' >&3; sed '1,/^\r$/d' <&3`, host, port, path, host)
}

// criTerminal: `crictl exec -it` into the running container id, in a tmux
// pane, typed at as a person does, through CRI's streaming server and the
// shim's terminal: a shell at the pane's size, a resize followed
// (ResizePty), and its exit code passed back to crictl, which prints it
// ("command terminated with exit code N") and itself exits 1.
func criTerminal(t *testing.T, e *criEnv, id string) {
	tm := tmuxServer(t)
	ep := "unix://" + e.address
	pane := fmt.Sprintf("%s --runtime-endpoint %s --image-endpoint %s --timeout 3m exec -it %s sh; echo cri-exit-$?; sleep 3600", e.crictl, ep, ep, id)
	seen, keys, _ := shellPane(t, tm, "cri", pane, 2*time.Minute)
	keys("exit 4", "Enter")
	seen("exit code 4") // the pane wraps crictl's long line
	seen("cri-exit-1")
}

// checkReadOnlyHostBind checks that the shim's bind of src into a pod's
// directory, on the host, is read-only: not even the VMM that serves it
// to the guest can write it.
func checkReadOnlyHostBind(t *testing.T, src string) {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		// f[3] is the bind's root within its file system: src, or its
		// tail where src's file system is mounted below /.
		if len(f) < 6 || f[3] == "/" || !strings.HasSuffix(src, f[3]) || !strings.Contains(f[4], "/pods/") || !strings.Contains(f[4], "/mounts/") {
			continue
		}
		found++
		if opts := strings.Split(f[5], ","); opts[0] != "ro" {
			t.Errorf("the shim's bind of %s at %s: options %s; want read-only", src, f[4], f[5])
		}
	}
	if found == 0 {
		t.Errorf("no bind of %s into a pod's directory in the host's mount table", src)
	}
}
