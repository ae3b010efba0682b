package e2e

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// TestHostileWorkloads: a guest that fills its /tmp, exhausts its memory
// and fork-bombs stays the guest's problem. Each abuse ends with a clear
// result for that sandbox (ENOSPC, the OOM killer's SIGKILL, the exec's
// timeout, or the sandbox's own end with its reason); a second sandbox
// keeps answering throughout; and once the abused sandbox is closed the
// host process is back to its descriptors, goroutines and memory.
func TestHostileWorkloads(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 7*time.Minute)
	defer cancel()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := func(name string) *sandbox.Sandbox {
		t.Helper()
		sb, err := sandbox.New().Memory(256).Kernel(artifact(t, "vmlinux")).Initrd(artifact(t, "initramfs.cpio")).
			Share(filepath.Dir(self), "/mnt/probe", sandbox.ReadOnly).Run("sleep", "100000").Start(ctx)
		if err != nil {
			t.Fatalf("start %s: %v", name, err)
		}
		return sb
	}
	// The baseline is taken after one sandbox has come and gone, as in
	// TestSoak: what the first one loads once (artifacts, runtime threads)
	// is not the abuse's doing.
	start("warm-up").Close()
	before, fdsBefore := measure(t), fdTargets()
	bystander, abused := start("bystander"), start("abused")
	defer func() {
		if abused != nil {
			abused.Close()
		}
		if bystander != nil {
			bystander.Close()
		}
	}()
	probeCmd := func(action string, timeout time.Duration) sandbox.ExecOptions {
		o := sandbox.Command("/mnt/probe/"+filepath.Base(self), action)
		o.Env = []string{probeEnv + "=1"}
		o.Timeout = timeout
		o.MaxOutput = 1 << 20
		return o
	}
	alive := func(sb *sandbox.Sandbox, who string) bool {
		t.Helper()
		o := sandbox.Shell("echo alive")
		o.Timeout = time.Minute
		ectx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		r, err := sb.Exec(ectx, o)
		if err != nil || r.Code != 0 || string(r.Stdout) != "alive\n" {
			t.Logf("%s: echo alive = %+v, %v", who, r, err)
			return false
		}
		return true
	}

	// gone waits, for at most a minute, until no process of sb has arg
	// as an argument.
	gone := func(sb *sandbox.Sandbox, arg, what string) bool {
		t.Helper()
		o := probeCmd("gone", 90*time.Second)
		o.Argv = append(o.Argv, arg, "60")
		r, err := sb.Exec(ctx, o)
		if err != nil || r.Code != 0 {
			t.Logf("%s still running: %+v, %v", what, r, err)
			return false
		}
		return true
	}

	// An exec's timeout ends everything the command started, a daemon in
	// a session of its own too (the command's cgroup, not its process
	// group); and the command's cgroup is the guest's, under capsa-exec.
	if r, err := abused.Exec(ctx, sandbox.Command("cat", "/proc/self/cgroup")); err != nil || !regexp.MustCompile(`^0::/capsa-exec/e[0-9]+\n$`).Match(r.Stdout) {
		t.Errorf("a command's cgroup: %+v, %v; want 0::/capsa-exec/e<N>", r, err)
	}
	if r, err := abused.Exec(ctx, probeCmd("daemon", 3*time.Second)); err != nil || !r.TimedOut {
		t.Errorf("a command that outlives its 3 s timeout: %+v, %v; want it timed out", r, err)
	}
	if !gone(abused, "daemon-7777", "the daemon of a timed-out command") {
		t.Error("a daemon a command started in its own session outlived the command's timeout")
	}

	// /tmp (tmpfs, half the guest's memory) filled: ENOSPC, then usable again.
	o := sandbox.Shell("dd if=/dev/zero of=/tmp/fill bs=1048576; echo dd=$?; rm /tmp/fill")
	o.Timeout = 2 * time.Minute
	r, err := abused.Exec(ctx, o)
	if err != nil || !strings.Contains(strings.ToLower(string(r.Stdout)+string(r.Stderr)), "no space left") {
		t.Errorf("filling /tmp: %+v, %v; want dd to fail with ENOSPC", r, err)
	}
	if !alive(abused, "abused, after filling /tmp") || !alive(bystander, "bystander") {
		t.Fatal("a sandbox stopped answering after one filled its /tmp")
	}

	// The agent server is exempt from the guest's OOM killer; what it runs
	// is not.
	if r, err := abused.Exec(ctx, sandbox.Command("cat", "/proc/self/oom_score_adj")); err != nil || string(r.Stdout) != "0\n" {
		t.Errorf("Exec(cat /proc/self/oom_score_adj) = %+v, %v; want 0", r, err)
	}

	// Memory exhausted: the guest's OOM killer ends the process. The
	// eater runs from the guest's tmpfs, not the share: a program whose
	// text is on a share can have it reclaimed and read back over 9P
	// again and again as memory runs out, and the kernel, seeing that
	// progress, may hold off the OOM killer for minutes (seen once, at
	// 192 MiB of 256, past a 3-minute timeout).
	copySelf(t, ctx, abused, "/tmp/eater")
	eat := probeCmd("eat", 3*time.Minute)
	eat.Argv[0] = "/tmp/eater"
	r, err = abused.Exec(ctx, eat)
	if err != nil || r.TimedOut || r.Signal != "SIGKILL" {
		t.Errorf("eating the guest's memory: %+v, %v; want the process killed by SIGKILL (the OOM killer)", r, err)
	}
	if !alive(abused, "abused, after exhausting memory") || !alive(bystander, "bystander") {
		t.Fatal("a sandbox stopped answering after one exhausted its memory")
	}

	// A fork bomb: the exec's timeout ends it; the guest survives it or
	// the sandbox ends with a reason, and the bystander never notices.
	bombEnd := time.Now().Add(20 * time.Second)
	r, err = abused.Exec(ctx, probeCmd("forkbomb", 20*time.Second))
	t.Logf("fork bomb: %+v, %v", r, err)
	if err == nil && !r.TimedOut && r.Signal == "" {
		t.Errorf("a fork bomb ended by itself: %+v", r)
	}
	if !alive(bystander, "bystander, after a fork bomb next door") {
		t.Fatal("the bystander stopped answering during another sandbox's fork bomb")
	}
	if !alive(abused, "abused, after a fork bomb") {
		if e := abused.Exit(); e == nil {
			t.Errorf("the fork-bombed sandbox neither answers nor reports an end; its state:\n%s", abused.Debug(ctx))
		} else {
			t.Logf("the fork-bombed sandbox ended: %v", e)
		}
	} else if time.Sleep(time.Until(bombEnd)); !gone(abused, "forkbomb", "the fork bomb's copies") {
		// (After the exec's deadline: the bomb's first copy may have
		// ended before it, OOM-killed, and the exec with it.)
		t.Error("copies of the fork bomb outlived the exec's timeout")
	}

	// The host: Close is bounded and gives everything back.
	done := make(chan error, 1)
	go func() { done <- abused.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("abused.Close() = %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Close of the abused sandbox did not return in 30 s")
	}
	if !alive(bystander, "bystander, after the other closed") {
		t.Fatal("the bystander stopped answering")
	}
	t.Logf("bystander.Close() = %v", bystander.Close())
	// Descriptors go at Close, even while the closed sandboxes are kept.
	if got := measure(t); got.fds > before.fds+1 {
		t.Errorf("host descriptors with both sandboxes closed (still referenced) = %d, before = %d\nbefore: %v\nnow: %v", got.fds, before.fds, fdsBefore, fdTargets())
	}
	// Memory goes once they are no longer referenced.
	abused, bystander = nil, nil
	after := settle(t, func(u usage) bool {
		return u.fds <= before.fds+2 && u.goroutines <= before.goroutines+2 && u.rssKiB <= before.rssKiB+64<<10
	})
	t.Logf("host process before: %v; after: %v", before, after)
	if after.fds > before.fds+2 || after.goroutines > before.goroutines+2 || after.rssKiB > before.rssKiB+64<<10 {
		t.Errorf("host process after = %v, before = %v: want descriptors and goroutines back and RSS within 64 MiB\nmemory after:\n%s",
			after, before, bigMappings())
	}
}

// fdTargets lists what the process's descriptors point at.
func fdTargets() []string {
	ents, _ := os.ReadDir("/proc/self/fd")
	var out []string
	for _, e := range ents {
		l, _ := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		out = append(out, e.Name()+"->"+l)
	}
	return out
}

// bigMappings is the process's mappings holding over 4 MiB resident.
func bigMappings() string {
	b, _ := os.ReadFile("/proc/self/smaps")
	var out []string
	var head string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) > 0 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":"):
			head = line
		case len(f) >= 2 && f[0] == "Rss:":
			if kb, _ := strconv.Atoi(f[1]); kb > 4<<10 {
				out = append(out, head+" rss "+f[1]+" kB")
			}
		}
	}
	return strings.Join(out, "\n")
}
