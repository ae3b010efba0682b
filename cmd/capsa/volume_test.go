package main

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor/supervisortest"
	"github.com/capsa-sandbox/capsa/volume"
)

// capsaCLI runs the CLI in-process and returns its exit code and output.
func capsaCLI(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := dispatch(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

// TestVolumeCLI: capsa volume create, ls, inspect and rm, with the state
// directory of the test; rm refuses a volume in use and names who uses it.
func TestVolumeCLI(t *testing.T) {
	state := t.TempDir()
	t.Setenv("CAPSA_STATE", state)

	for _, tc := range []struct {
		args       []string
		code       int
		out, errIn string
	}{
		{[]string{"volume", "create", "shared"}, 0, "shared\n", ""},
		{[]string{"volume", "create", "small", "--size", "10M"}, 0, "small\n", ""},
		{[]string{"volume", "create", "shared"}, 1, "", "a volume with that name exists"},
		{[]string{"volume", "create", "a/b"}, 2, "", "want 1 to 63 letters"},
		{[]string{"volume", "create", "x", "--size", "lots"}, 2, "", `--size: invalid size "lots"`},
		{[]string{"volume", "create", "x", "--size", "0"}, 2, "", "--size: invalid size"},
		{[]string{"volume", "create"}, 2, "", "want NAME"},
		{[]string{"volume", "create", "a", "b"}, 2, "", "want NAME"},
		{[]string{"volume"}, 2, "", "usage: capsa volume create|inspect|ls|rm"},
		{[]string{"volume", "bogus"}, 2, "", `unknown command "bogus"`},
		{[]string{"volume", "inspect"}, 2, "", "want NAME..."},
		{[]string{"volume", "rm"}, 2, "", "want NAME..."},
		{[]string{"volume", "rm", "nosuch"}, 1, "", "no such volume"},
		{[]string{"volume", "ls", "extra"}, 2, "", `unexpected argument "extra"`},
		// -v NAME:GUEST mounts a volume, checked before anything boots.
		{[]string{"run", "-v", "nosuch:/data", "--", "true"}, 2, "", "volume nosuch: no such volume (make it with: capsa volume create nosuch)"},
		{[]string{"run", "-v", ".:/data", "--", "true"}, 2, "", "a host directory to share needs a slash"},
		{[]string{"run", "-v", "shared:/proc/x", "--", "true"}, 2, "", "volume shared: guest path /proc/x is inside /proc"},
		{[]string{"run", "-v", "shared:/a", "-v", "small:/a", "--", "true"}, 2, "", "guest path /a is already volume shared's"},
	} {
		code, out, errOut := capsaCLI(tc.args...)
		if code != tc.code || out != tc.out || !strings.Contains(errOut, tc.errIn) {
			t.Errorf("capsa %v = %d, stdout %q, stderr %q; want %d, %q, stderr with %q", tc.args, code, out, errOut, tc.code, tc.out, tc.errIn)
		}
	}

	// ls: both, by name, with their quotas; nobody uses them.
	code, out, errOut := capsaCLI("volume", "ls", "--format", "json")
	var rows []struct {
		Name   string   `json:"name"`
		Quota  int64    `json:"quota"`
		Used   int64    `json:"used"`
		InUse  bool     `json:"in_use"`
		UsedBy []string `json:"used_by"`
		Path   string   `json:"path"`
	}
	if err := json.Unmarshal([]byte(out), &rows); code != 0 || err != nil {
		t.Fatalf("capsa volume ls --format json = %d, %v; stdout %q, stderr %q", code, err, out, errOut)
	}
	if len(rows) != 2 || rows[0].Name != "shared" || rows[0].Quota != 0 || rows[1].Name != "small" || rows[1].Quota != 10<<20 ||
		rows[1].Used <= 0 || rows[1].InUse || rows[1].UsedBy == nil || rows[1].Path != filepath.Join(state, "volumes", "small", "data") {
		t.Errorf("capsa volume ls --format json = %+v, want shared (no quota) and small (10 MiB), not in use, under %s", rows, state)
	}
	code, out, _ = capsaCLI("volume", "ls")
	if code != 0 || !strings.Contains(out, "IN USE BY") || !strings.Contains(out, "10.0MiB") {
		t.Errorf("capsa volume ls = %d, %q; want a table with small's 10.0MiB", code, out)
	}
	code, out, errOut = capsaCLI("volume", "inspect", "small", "nosuch")
	if code != 1 || !strings.Contains(out, `"name": "small"`) || !strings.Contains(errOut, "nosuch: no such volume") {
		t.Errorf("capsa volume inspect small nosuch = %d, %q, %q; want small's JSON and an error for nosuch", code, out, errOut)
	}

	// In use: by a detached sandbox that the store lists (its lock held,
	// as its supervisor holds it), and mounted.
	r, err := volume.Open(filepath.Join(state, "volumes"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := r.Mount("shared", nil)
	if err != nil {
		t.Fatal(err)
	}
	code, _, errOut = capsaCLI("volume", "rm", "shared")
	if code != 1 || !strings.Contains(errOut, "volume shared is in use by a sandbox that capsa ps does not list") {
		t.Errorf("capsa volume rm shared (mounted) = %d, %q; want it refused", code, errOut)
	}
	spec, err := sandbox.New().Volume("shared", "/shared", sandbox.ReadWrite).Run("true").Spec()
	if err != nil {
		t.Fatal(err)
	}
	supervisortest.Creating(t, state, "worker", spec)
	code, _, errOut = capsaCLI("volume", "rm", "shared")
	if code != 1 || !strings.Contains(errOut, "volume shared is in use by worker: stop them first, or volume rm --force") {
		t.Errorf("capsa volume rm shared (used by worker) = %d, %q; want it refused naming worker", code, errOut)
	}
	code, out, _ = capsaCLI("volume", "ls", "--format", "json")
	if code != 0 || !strings.Contains(out, `"used_by": [`+"\n"+`      "worker"`) {
		t.Errorf("capsa volume ls --format json = %d, %s; want shared used by worker", code, out)
	}
	code, out, errOut = capsaCLI("volume", "rm", "--force", "shared")
	if code != 0 || out != "shared\n" {
		t.Errorf("capsa volume rm --force shared = %d, %q, %q; want it removed", code, out, errOut)
	}
	m.Close()
	code, out, errOut = capsaCLI("volume", "rm", "small")
	if code != 0 || out != "small\n" {
		t.Errorf("capsa volume rm small = %d, %q, %q", code, out, errOut)
	}
}
