package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestEgressAudit: a detached sandbox's egress audit log has every DNS
// query, connection and flow it made or was refused, with the rule that
// decided it, and its intercepted requests; `capsa logs --net -f` shows
// each as it happens, and `capsa stats` sums the flows by rule.
func TestEgressAudit(t *testing.T) {
	w := setupNetWorld(t)
	dir, cli := detachedState(t)
	tmp := t.TempDir()

	// An HTTPS server beside the public one, intercepted.
	pki := newTestPKI(t, tmp, "secure.example.test")
	srv := exec.Command("nsenter", "-t", strconv.Itoa(w.serverPID), "-n", os.Args[0])
	srv.Env = append(os.Environ(), serveTLSEnv+"=:443 "+pki.certFile+" "+pki.keyFile+" "+filepath.Join(tmp, "tls.log"))
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		t.Fatalf("start the HTTPS server: %v", err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	waitHTTPS(t, "https://secure.example.test/", pki.pool, func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, publicIP+":443")
	})
	dns := startDNS(t, map[string]string{
		"public.example.test.":  publicIP,
		"blocked.example.test.": publicIP,
		"secure.example.test.":  publicIP,
	})
	// A UDP echo server on the host's loopback, allowed by a rule.
	udpPort := udpServer(t, func(b []byte) []byte { return append([]byte("echo:"), b...) }).Port
	udpRule := fmt.Sprintf("udp/127.0.0.1:%d", udpPort)

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	r := cli(3*time.Minute, "run", "-d", "--name", "a", "--net", "--dns-server", dns,
		"--deny", "blocked.example.test", "--allow", udpRule,
		"--tls-intercept", "secure.example.test", "--tls-upstream-ca", pki.caFile,
		"-v", filepath.Dir(self)+":/probe:ro", "--", "sleep", "100000")
	if r.code != 0 {
		t.Fatalf("capsa run -d --name a --net ... = exit %d, stderr %q", r.code, r.stderr)
	}

	// The log as it happens.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	follow := exec.CommandContext(ctx, artifact(t, "capsa"), "logs", "--net", "-f", "a")
	follow.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	out, err := follow.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}
	defer follow.Wait()
	defer cancel()
	lines := make(chan map[string]any, 1000)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var m map[string]any
			if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
				t.Errorf("capsa logs --net -f a: a line that is not JSON: %q", sc.Text())
				continue
			}
			lines <- m
		}
	}()
	var seen []map[string]any
	// expect waits for the line match accepts, among those seen so far
	// and those to come.
	expect := func(what string, match func(map[string]any) bool) map[string]any {
		t.Helper()
		for _, m := range seen {
			if match(m) {
				return m
			}
		}
		timeout := time.After(time.Minute)
		for {
			select {
			case m, ok := <-lines:
				if !ok {
					t.Fatalf("capsa logs --net -f a ended before the line of %s; lines: %v", what, seen)
				}
				seen = append(seen, m)
				if match(m) {
					return m
				}
			case <-timeout:
				t.Fatalf("no line of %s within a minute; lines: %v", what, seen)
			}
		}
	}
	is := func(kv ...string) func(map[string]any) bool {
		return func(m map[string]any) bool {
			for i := 0; i < len(kv); i += 2 {
				if fmt.Sprint(m[kv[i]]) != kv[i+1] {
					return false
				}
			}
			return true
		}
	}
	probe := func(job, want string) {
		t.Helper()
		r := cli(2*time.Minute, "exec", "-e", netBenchEnv+"="+job, "a", "--", "/probe/"+filepath.Base(self))
		if r.code != 0 || !strings.Contains(r.stdout, want) {
			t.Errorf("in the guest, %s: exit %d, %q (stderr %q); want %q", job, r.code, r.stdout, r.stderr, want)
		}
	}

	probe("lookup public.example.test", "addresses: "+publicIP)
	a := expect("the DNS answer", is("kind", "dns", "event", "answer", "name", "public.example.test", "qtype", "A"))
	if fmt.Sprint(a["answers"]) != "["+publicIP+"]" || a["rule"] != "public-only" || a["dst"] != "10.0.2.3:53" {
		t.Errorf("the DNS answer's line: %v", a)
	}
	probe("dial public.example.test:80", "connected")
	o := expect("the connection's open", is("kind", "tcp", "event", "open", "dst", publicIP+":80"))
	if o["rule"] != "public-only" || fmt.Sprint(o["names"]) != "[public.example.test]" {
		t.Errorf("the connection's open line: %v", o)
	}
	expect("the connection's close", is("kind", "tcp", "event", "close", "dst", publicIP+":80", "src", fmt.Sprint(o["src"])))

	probe("lookup blocked.example.test", "lookup failed")
	expect("the refused name", is("kind", "dns", "event", "refused", "name", "blocked.example.test", "rule", `deny "blocked.example.test"`))
	probe(fmt.Sprintf("dial 10.0.2.2:%d", w.loopPort), "dial failed")
	ref := expect("the refused connection", is("kind", "tcp", "event", "refused", "dst", fmt.Sprintf("10.0.2.2:%d", w.loopPort)))
	if ref["rule"] != "public-only" || !strings.Contains(fmt.Sprint(ref["reason"]), "loopback") || ref["host"] != fmt.Sprintf("127.0.0.1:%d", w.loopPort) {
		t.Errorf("the refused connection's line: %v", ref)
	}
	probe(fmt.Sprintf("udp 10.0.2.2:%d hello", udpPort), "reply: echo:hello")
	expect("the UDP flow", is("kind", "udp", "event", "open", "dst", fmt.Sprintf("10.0.2.2:%d", udpPort), "rule", `allow "`+udpRule+`"`))

	probe("get https://secure.example.test/audited 1 1", "answered 1 of 1")
	h := expect("the intercepted request", is("kind", "http", "host", "secure.example.test", "path", "/audited"))
	if h["status"] != float64(200) || h["method"] != "GET" {
		t.Errorf("the intercepted request's line: %v", h)
	}
	expect("the intercepted connection", is("kind", "tcp", "event", "open", "dst", publicIP+":443", "rule", "public-only"))

	// The sums by rule.
	r = cli(time.Minute, "stats", "--no-stream", "--format", "json", "a")
	var rows []struct {
		NetFlows []struct {
			Kind    string `json:"kind"`
			Allowed bool   `json:"allowed"`
			Rule    string `json:"rule"`
			Count   uint64 `json:"count"`
		} `json:"net_flows"`
		VMMCPUTime int64 `json:"vmm_cpu_time_ns"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &rows); r.code != 0 || err != nil || len(rows) != 1 {
		t.Fatalf("capsa stats --no-stream --format json a = exit %d, %v: %q", r.code, err, r.stdout)
	}
	got := map[string]uint64{}
	for _, f := range rows[0].NetFlows {
		got[fmt.Sprintf("%s %v %s", f.Kind, f.Allowed, f.Rule)] = f.Count
	}
	for _, k := range []string{"dns true public-only", `dns false deny "blocked.example.test"`, "tcp true public-only",
		"tcp false public-only", `udp true allow "` + udpRule + `"`} {
		if got[k] < 1 {
			t.Errorf("capsa stats' net_flows has no %s: %v", k, got)
		}
	}
	if rows[0].VMMCPUTime <= 0 {
		t.Errorf("capsa stats: the VMM's own CPU time is %d", rows[0].VMMCPUTime)
	}
}

// TestCPUQuota: a sandbox's VMM process is held to its CPU quota, its
// vCPUs and its own threads together: two busy loops on two vCPUs with
// --cpu-quota 1 get one host CPU's time, not two.
func TestCPUQuota(t *testing.T) {
	artifact(t, "capsa")
	ctl, err := os.ReadFile("/sys/fs/cgroup/cgroup.subtree_control")
	if err != nil || !strings.Contains(string(ctl), "cpu") {
		t.Fatalf("this host delegates no cgroup v2 cpu controller (%q, %v): the nested host does", ctl, err)
	}
	dir, cli := detachedState(t)
	r := cli(3*time.Minute, "run", "-d", "--name", "q", "--cpus", "2", "--cpu-quota", "1", "--", "sleep", "100000")
	if r.code != 0 {
		t.Fatalf("capsa run -d --cpus 2 --cpu-quota 1 = exit %d, stderr %q", r.code, r.stderr)
	}
	rec := inspectConfined(t, cli, "q")
	if !strings.Contains(rec.Confinement.Cgroup, "cpu.max 100000 100000") {
		t.Fatalf("the cgroup layer: %s; want cpu.max 100000 100000", rec.Confinement.Cgroup)
	}
	// Two busy loops, until the sandbox goes at cleanup; 10 s of them are
	// measured.
	ctx, cancel := context.WithCancel(context.Background())
	loops := exec.CommandContext(ctx, artifact(t, "capsa"), "exec", "q", "--", "sh", "-c", "(while :; do :; done) & while :; do :; done")
	loops.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	if err := loops.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); loops.Wait() }()
	time.Sleep(5 * time.Second)
	t0, c0 := time.Now(), processCPU(t, rec.PID)
	time.Sleep(10 * time.Second)
	t1, c1 := time.Now(), processCPU(t, rec.PID)
	used := float64(c1-c0) / float64(t1.Sub(t0))
	t.Logf("the VMM process used %.2f CPUs over %v", used, t1.Sub(t0).Round(time.Millisecond))
	// Busy (two vCPUs spinning would take two CPUs unthrottled), and
	// within its quota with the kernel's scheduling slack.
	if used < 0.6 || used > 1.1 {
		t.Errorf("the VMM process used %.2f CPUs; want about one (its quota), between 0.6 and 1.1", used)
	}
}

// processCPU is process pid's CPU time, user and system, from /proc.
func processCPU(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command's closing parenthesis: state is field 3,
	// utime 14 and stime 15, in clock ticks (100 a second on Linux).
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("/proc/%d/stat: %q", pid, b)
	}
	return time.Duration(ut+st) * 10 * time.Millisecond
}
