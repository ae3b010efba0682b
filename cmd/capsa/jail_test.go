package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
)

// TestJailUserFlag: a bad --jail-user is refused before anything starts.
func TestJailUserFlag(t *testing.T) {
	cases := []struct{ args []string }{
		{[]string{"run", "--jail-user", "1", "--no-confine", "--", "true"}},
		{[]string{"run", "-d", "--jail-user", "1:x", "--", "true"}},
	}
	want := []string{"--jail-user and --no-confine do not go together", `--jail-user: confine: user "1:x": want UID[:GID], numbers`}
	if os.Geteuid() != 0 {
		want[1] = "--jail-user 1:x: capsa must run as root"
	}
	for i, tc := range cases {
		var out, errb bytes.Buffer
		code := dispatch(context.Background(), tc.args, &out, &errb)
		if code != 2 || !strings.Contains(errb.String(), want[i]) {
			t.Errorf("capsa %v: code %d, stderr %q; want 2 and %q", tc.args, code, errb.String(), want[i])
		}
	}
}
