package hub

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/hub/proto"
)

func TestCLI(t *testing.T) {
	h := openHub(t, t.TempDir())
	guest := serve(t, h.As(Grants{Identity: "sb1", Topics: []string{"t"}, Prefixes: []string{"k"}}))
	run := func(api proto.API, stdin string, args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := proto.RunCLI(context.Background(), api, args, strings.NewReader(stdin), &out, &errb)
		return code, out.String(), errb.String()
	}
	hostAPI := h.As(Grants{Identity: "host", Host: true})
	for _, tc := range []struct {
		api         proto.API
		stdin       string
		args        []string
		code        int
		out, errsub string
	}{
		{guest, "", []string{"kv", "cas", "k", "0", "1"}, 0, "1\n", ""},
		{guest, "", []string{"kv", "get", "--with-version", "k"}, 0, "1\t1\n", ""},
		{guest, "", []string{"kv", "cas", "k", "0", "2"}, proto.ExitFailed, "", "version mismatch"},
		{guest, "from stdin", []string{"kv", "set", "k2", "-"}, 0, "2\n", ""},
		{hostAPI, "", []string{"kv", "get", "k2"}, 0, "from stdin\n", ""},
		{guest, "", []string{"kv", "get", "other"}, proto.ExitFailed, "", "permission denied"},
		{guest, "", []string{"kv", "get", "nope-but-k"}, proto.ExitFailed, "", ""},
		{guest, "", []string{"kv", "ls", "k"}, 0, "1\tk\n2\tk2\n", ""},
		{guest, "", []string{"kv", "cas", "k", "x", "1"}, proto.ExitUsage, "", "VERSION \"x\""},
		{guest, "", []string{"kv", "frob"}, proto.ExitUsage, "", "unknown verb"},
		{guest, "", []string{"kv", "get"}, proto.ExitUsage, "", "want [--with-version] KEY"},
		{guest, "", []string{"mailbox", "publish", "t", "hi"}, 0, "0\n", ""},
		{guest, "", []string{"mailbox", "read", "t"}, 0, "0\tsb1\thi\n", ""},
		{guest, "", []string{"mailbox", "subscribe", "--from", "0", "--count", "1", "t"}, 0, "0\tsb1\thi\n", ""},
		{guest, "", []string{"mailbox", "subscribe", "--count", "1", "--timeout", "300ms", "t"}, proto.ExitTimeout, "", "0 of 1 within"},
		{guest, "", []string{"mailbox", "publish", "u", "hi"}, proto.ExitFailed, "", "capsa run --mailbox"},
	} {
		code, out, errs := run(tc.api, tc.stdin, tc.args...)
		if code != tc.code || (tc.out != "" && out != tc.out) || !strings.Contains(errs, tc.errsub) {
			t.Errorf("RunCLI(%q) = %d, %q, %q; want %d, %q, stderr with %q", tc.args, code, out, errs, tc.code, tc.out, tc.errsub)
		}
	}
}
