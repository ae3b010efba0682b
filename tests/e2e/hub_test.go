package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// casLoop is a guest shell script: 50 compare-and-swap increments of the
// key counter, each read with its version and written back only if
// nobody wrote in between.
const casLoop = `i=0; tries=0
while [ $i -lt 50 ]; do
  tries=$((tries+1))
  if [ $tries -gt 5000 ]; then echo "gave up after $i increments" >&2; exit 1; fi
  out=$(capsa kv get --with-version counter 2>/dev/null) || out="0 0"
  set -- $out
  if capsa kv cas counter $1 $(($2+1)) >/dev/null 2>/tmp/cas.err; then
    i=$((i+1))
  elif ! grep -q "version mismatch" /tmp/cas.err; then
    cat /tmp/cas.err >&2; exit 1
  fi
done
echo "$tries tries"`

// TestHubCounter: four sandboxes, each its own supervisor process, do 50
// compare-and-swap increments of one key from inside their guests; none is
// lost. A sandbox granted nothing is refused, with the flag that grants.
func TestHubCounter(t *testing.T) {
	_, cli := detachedState(t)
	names := []string{"c1", "c2", "c3", "c4"}
	var wg sync.WaitGroup
	for _, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r := cli(3*time.Minute, "run", "-d", "--name", n, "--kv", "counter", "--", "sleep", "3600"); r.code != 0 {
				t.Errorf("capsa run -d --name %s --kv counter: exit %d, stderr %q", n, r.code, r.stderr)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	for _, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r := cli(5*time.Minute, "exec", n, "--", "sh", "-c", casLoop); r.code != 0 {
				t.Errorf("the CAS loop in %s: exit %d, stderr %q", n, r.code, r.stderr)
			}
		}()
	}
	wg.Wait()
	if r := cli(time.Minute, "kv", "get", "--with-version", "counter"); r.code != 0 || !strings.HasSuffix(r.stdout, "\t200\n") {
		t.Fatalf("capsa kv get --with-version counter = exit %d, %q; want the value 200", r.code, r.stdout)
	}

	// Refusals: a key outside the grant, and a sandbox granted nothing.
	if r := cli(time.Minute, "exec", "c1", "--", "capsa", "kv", "set", "other", "x"); r.code != 1 || !strings.Contains(r.stderr, "permission denied") || !strings.Contains(r.stderr, "--kv") {
		t.Errorf("capsa kv set other (not granted) in c1: exit %d, stderr %q; want 1, permission denied naming --kv", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "run", "-d", "--name", "none", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --name none: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "none", "--", "capsa", "kv", "get", "counter"); r.code != 1 || !strings.Contains(r.stderr, "permission denied") {
		t.Errorf("capsa kv get counter in a sandbox granted nothing: exit %d, stderr %q; want 1, permission denied", r.code, r.stderr)
	}
	if r := cli(time.Minute, "exec", "none", "--", "capsa", "mailbox", "publish", "workers/results", "x"); r.code != 1 || !strings.Contains(r.stderr, "--mailbox") {
		t.Errorf("capsa mailbox publish in a sandbox granted nothing: exit %d, stderr %q; want 1 naming --mailbox", r.code, r.stderr)
	}
}

// TestHubMailbox: a coordinator on the host subscribes to a topic, two
// sandboxes (one of them an image with no shell, which still has capsa)
// publish from inside, and both messages arrive stamped with their
// senders' names; a subscriber that starts late reads both from the
// topic's history.
func TestHubMailbox(t *testing.T) {
	dir, cli := detachedState(t)
	t.Setenv("CAPSA_CACHE", t.TempDir())
	tarPath := filepath.Join(t.TempDir(), "probe.tar")
	probeImage(t, tarPath, "capsa.test/probe:1")
	if r := cli(2*time.Minute, "image", "import", tarPath); r.code != 0 {
		t.Fatalf("capsa image import: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "run", "-d", "--name", "wa", "--mailbox", "workers/*", "--", "sleep", "3600"); r.code != 0 {
		t.Fatalf("capsa run -d --name wa: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := cli(3*time.Minute, "run", "-d", "--name", "wb", "--mailbox", "workers/results", "--image", "capsa.test/probe:1", "--", "wait"); r.code != 0 {
		t.Fatalf("capsa run -d --name wb --image: exit %d, stderr %q", r.code, r.stderr)
	}

	// The coordinator: a host process subscribed before anything is
	// published, waiting for two messages.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	coord := exec.CommandContext(ctx, artifact(t, "capsa"), "mailbox", "subscribe", "--from", "0", "--count", "2", "--timeout", "2m", "workers/results")
	coord.Env = append(os.Environ(), "CAPSA_STATE="+dir)
	var out, errb bytes.Buffer
	coord.Stdout, coord.Stderr = &out, &errb
	if err := coord.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if r := cli(time.Minute, "exec", "wa", "--", "capsa", "mailbox", "publish", "workers/results", "done by a"); r.code != 0 || r.stdout != "0\n" {
		t.Errorf("capsa mailbox publish in wa: exit %d, stdout %q, stderr %q; want offset 0", r.code, r.stdout, r.stderr)
	}
	if r := cli(time.Minute, "exec", "wb", "--", "/usr/local/bin/capsa", "mailbox", "publish", "workers/results", "done by b"); r.code != 0 || r.stdout != "1\n" {
		t.Errorf("capsa mailbox publish in the image sandbox wb: exit %d, stdout %q, stderr %q; want offset 1", r.code, r.stdout, r.stderr)
	}
	err := coord.Wait()
	want := "0\twa\tdone by a\n1\twb\tdone by b\n"
	if err != nil || out.String() != want {
		t.Errorf("the coordinator's capsa mailbox subscribe = %v, %q (stderr %q); want %q", err, out.String(), errb.String(), want)
	}
	// A worker that starts late misses nothing.
	if r := cli(time.Minute, "exec", "wa", "--", "capsa", "mailbox", "subscribe", "--from", "0", "--count", "2", "--timeout", "30s", "workers/results"); r.code != 0 || r.stdout != want {
		t.Errorf("a late subscriber in wa: exit %d, %q (stderr %q); want %q", r.code, r.stdout, r.stderr, want)
	}
	// wb was granted workers/results alone.
	if r := cli(time.Minute, "exec", "wb", "--", "/usr/local/bin/capsa", "mailbox", "publish", "workers/other", "x"); r.code != 1 || !strings.Contains(r.stderr, "permission denied") {
		t.Errorf("publishing to an ungranted topic in wb: exit %d, stderr %q; want 1, permission denied", r.code, r.stderr)
	}
}
