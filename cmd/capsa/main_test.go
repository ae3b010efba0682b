package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func TestParseSize(t *testing.T) {
	for in, want := range map[string]uint64{"512M": 512 << 20, "2G": 2 << 30, "1GiB": 1 << 30, "64m": 64 << 20, "4096": 4096, "16K": 16 << 10, "3MB": 3 << 20} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1M", "12X", "M", "1.5G", "99999999999G"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) succeeded", in)
		}
	}
}

func TestCLIErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		err  string
	}{
		{[]string{}, 2, "usage: capsa COMMAND"},
		{[]string{"bogus"}, 2, `unknown command "bogus"`},
		{[]string{"vm", "--bogus"}, 2, "unknown flag: --bogus"},
		{[]string{"vm", "--cpus", "0"}, 2, "0 CPUs: must be between"},
		{[]string{"vm", "--memory", "lots"}, 2, `--memory: invalid size "lots"`},
		{[]string{"vm", "--kernel", "/nonexistent"}, 2, "kernel: stat /nonexistent"},
		{[]string{"vm", "--disk", ":ro"}, 2, `disk ":ro": want PATH[:ro]`},
		{[]string{"vm", "--disk", "/nonexistent:ro"}, 2, "disk: stat /nonexistent"},
		{[]string{"vm", "--disk", "/dev/null"}, 2, "disk /dev/null: not a regular file"},
		{[]string{"vm", "extra"}, 2, `unexpected argument "extra"`},
		{[]string{"version", "--nope"}, 2, "unknown flag"},
		{[]string{"run"}, 2, "no command given"},
		{[]string{"run", "--cpus", "0", "--", "true"}, 2, "0 CPUs: must be between"},
		{[]string{"run", "--memory", "100K", "--", "true"}, 2, "whole number of MiB"},
		{[]string{"run", "-e", "NOEQ", "--", "true"}, 2, `environment entry "NOEQ": want KEY=VALUE`},
		{[]string{"run", "--timeout", "-1s", "--", "true"}, 2, "timeout -1s: must not be negative"},
		{[]string{"run", "--watchdog", "-1s", "--", "true"}, 2, "watchdog -1s: must not be negative"},
		{[]string{"run", "--net=bogus", "--", "true"}, 2, `--net: netstack: policy mode "bogus"`},
		{[]string{"run", "--net", "--allow", "10.0.0.0/33", "--", "true"}, 2, "10.0.0.0/33"},
		{[]string{"run", "-p", "8080:80", "--", "true"}, 2, "need a network: add --net"},
		{[]string{"run", "--egress-proxy", "203.0.113.1:1080", "--", "true"}, 2, "need a network: add --net"},
		{[]string{"run", "--net", "--egress-proxy", "203.0.113.1", "--", "true"}, 2, "--egress-proxy: egress proxy address \"203.0.113.1\": want HOST:PORT"},
		{[]string{"run", "--net", "--egress-proxy", "@203.0.113.1:1080", "--", "true"}, 2, "--egress-proxy"},
		{[]string{"update", "--egress-proxy", "203.0.113.1", "x"}, 2, "--egress-proxy: egress proxy address"},
		{[]string{"run", "--net", "-p", "8080", "--", "true"}, 2, "publish"},
		{[]string{"run", "--net", "-p", "70000:80", "--", "true"}, 2, "70000"},
		{[]string{"run", "--net", "--dns-server", "localhost", "--", "true"}, 2, `DNS server "localhost": want IP:PORT`},
		{[]string{"run", "-v", "relative", "--", "true"}, 2, `volume "relative": want HOST:GUEST[:ro]`},
		{[]string{"run", "-v", "/nonexistent/dir:/data", "--", "true"}, 2, "share /nonexistent/dir: stat /nonexistent/dir: no such file or directory"},
		{[]string{"run", "-v", "/etc/hostname:/data", "--", "true"}, 2, "share /etc/hostname: not a directory"},
		{[]string{"run", "-v", "/tmp:/proc/x", "--", "true"}, 2, "inside /proc"},
		{[]string{"run", "-v", "/tmp:/a", "-v", "/:/a/", "--", "true"}, 2, "guest path /a is already shared"},
		{[]string{"run", "--timeout", "soon", "--", "true"}, 2, "invalid argument"},
		{[]string{"run", "--cpu-quota", "0", "--", "true"}, 2, "--cpu-quota 0: must be between 0.01"},
		{[]string{"run", "--limit", "net=fast", "--", "true"}, 2, `limit net=fast: "fast" is not an amount`},
		{[]string{"run", "--limit", "disk=1KB", "--", "true"}, 2, "disk: 1000 bytes a second: want 0 (no limit) or 65536"},
		{[]string{"run", "--limit", "cpu=1", "--", "true"}, 2, `limit "cpu=1": want KEY=RATE[:BURST]`},
		{[]string{"update", "x"}, 2, "nothing to change: give --limit, --net or --egress-proxy"},
		{[]string{"update", "--allow", "1.2.3.4", "x"}, 2, "--allow and --deny need --net MODE"},
		{[]string{"update", "--net", "wide-open", "x"}, 2, "--net: "},
		{[]string{"update", "--limit", "net=1MB"}, 2, "want at least one NAME"},
		{[]string{"serve", "--listen", "0.0.0.0:3000"}, 2, "not a loopback address"},
		{[]string{"serve", "--listen", "nope"}, 2, "--listen nope"},
		{[]string{"serve", "--tls-cert", "c.pem"}, 2, "--tls-cert and --tls-key go together"},
		{[]string{"serve", "--max-sandboxes-per-key", "0"}, 2, "--max-sandboxes-per-key 0"},
		{[]string{"serve", "--volume-size", "1K"}, 2, "--volume-size 1K"},
		{[]string{"serve", "--volume-size", "lots"}, 2, "--volume-size lots"},
		{[]string{"serve", "extra"}, 2, "takes no arguments"},
		{[]string{"serve", "key"}, 2, "usage: capsa serve key"},
		{[]string{"serve", "key", "bogus"}, 2, `unknown subcommand "bogus"`},
		{[]string{"template", "create", "base", "--image", "x"}, 2, `template name "base"`},
		{[]string{"template", "create", "t"}, 2, "template t: no image"},
		{[]string{"template", "create", "t", "--image", "x", "--ready-cmd", "true"}, 2, "--ready-cmd is for --preboot"},
		{[]string{"template", "create", "t", "--image", "x", "--memory", "lots"}, 2, `--memory: invalid size "lots"`},
		{[]string{"template", "bogus"}, 2, `unknown subcommand "bogus"`},
	} {
		var out, errb bytes.Buffer
		code := dispatch(context.Background(), tc.args, &out, &errb)
		if code != tc.code || !strings.Contains(errb.String(), tc.err) {
			t.Errorf("capsa %v: code %d, stderr %q; want %d and %q", tc.args, code, errb.String(), tc.code, tc.err)
		}
		if n := strings.Count(strings.TrimSpace(errb.String()), "\n"); n > 0 && len(tc.args) > 0 {
			t.Errorf("capsa %v: error is %d lines, want one", tc.args, n+1)
		}
	}
}

func TestHelp(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"vm", "--help"}, {"run", "--help"}, {"version", "-h"}, {"image", "pull", "--help"}, {"serve", "--help"}, {"template", "create", "--help"}} {
		var out, errb bytes.Buffer
		if code := dispatch(context.Background(), args, &out, &errb); code != 0 || strings.Count(out.String(), "usage:") != 1 {
			t.Errorf("capsa %v: code %d, stdout %q; want the usage once", args, code, out.String())
		}
	}
}

func TestParseEgressProxy(t *testing.T) {
	t.Setenv(egressProxyPasswordEnv, "pw")
	p, err := parseEgressProxy("me@corp.example@203.0.113.1:1080")
	if err != nil || p.Username != "me@corp.example" || p.Address != "203.0.113.1:1080" || p.Password != "pw" {
		t.Errorf("parseEgressProxy = %+v, %v; want the username up to the last @, the password from $%s", p, err, egressProxyPasswordEnv)
	}
	if p, err := parseEgressProxy("203.0.113.1:1080"); err != nil || p.Username != "" || p.Password != "" {
		t.Errorf("without a user: %+v, %v; want no credentials", p, err)
	}
}
