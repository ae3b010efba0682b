package main

// capsa run's flags for secrets and TLS interception (package tlsproxy).

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/tlsproxy"
)

type secretFlags struct {
	literal, fromEnv, fromFile, body, intercept, upstreamCAs *[]string
	netLog                                                   *string
}

func addSecretFlags(fs *pflag.FlagSet) *secretFlags {
	return &secretFlags{
		literal:     fs.StringArray("secret", nil, "give the guest NAME=<placeholder> and have the NAT put VALUE in its place on HTTPS to HOSTs (intercepted; HOST or *.DOMAIN): NAME=VALUE@HOST[,HOST...] (repeatable; see --secret-env and --secret-file to keep VALUE off the command line)"),
		fromEnv:     fs.StringArray("secret-env", nil, "a secret whose value is this host's environment variable VAR (default NAME): NAME[=VAR]@HOST[,HOST...] (repeatable)"),
		fromFile:    fs.StringArray("secret-file", nil, "a secret whose value is in a host file (one trailing newline dropped): NAME=PATH@HOST[,HOST...] (repeatable)"),
		body:        fs.StringArray("secret-body", nil, "substitute secret NAME in request bodies too, not only in URLs and headers (repeatable)"),
		intercept:   fs.StringArray("tls-intercept", nil, "intercept HTTPS to DOMAIN or *.DOMAIN (beside every secret's hosts): the guest trusts a CA of the sandbox's own, requests are audited (repeatable)"),
		upstreamCAs: fs.StringArray("tls-upstream-ca", nil, "with interception, trust this PEM file's CAs for the real servers too, beside the host's (repeatable)"),
		netLog:      fs.String("net-log", "", "write the network's audit log to this file, a JSON line each: DNS queries, connections and flows opened, refused and closed, intercepted requests (detached sandboxes: capsa logs --net)"),
	}
}

// used reports whether any of the flags was given.
func (f *secretFlags) used() bool {
	return len(*f.literal)+len(*f.fromEnv)+len(*f.fromFile)+len(*f.body)+len(*f.intercept)+len(*f.upstreamCAs) > 0 || *f.netLog != ""
}

// apply gives b the secrets and interception; the errors name the flag.
func (f *secretFlags) apply(b *sandbox.Builder) error {
	for _, src := range []struct {
		flag string
		list []string
	}{{"--secret", *f.literal}, {"--secret-env", *f.fromEnv}, {"--secret-file", *f.fromFile}} {
		for _, s := range src.list {
			spec, hosts, err := splitHosts(src.flag, s)
			if err != nil {
				return err
			}
			name, value, err := readValue(src.flag, spec)
			if err != nil {
				return err
			}
			b.Secret(name, value, hosts...)
		}
	}
	b.SecretInBody(*f.body...).TLSIntercept(*f.intercept...).UpstreamCA(*f.upstreamCAs...)
	return nil
}

// readValue reads a secret's name and value as flag gives them:
// --secret NAME=VALUE, --secret-env NAME[=VAR] (VAR defaults to NAME),
// --secret-file NAME=PATH.
func readValue(flag, spec string) (name, value string, err error) {
	name, arg, ok := strings.Cut(spec, "=")
	switch {
	case flag == "--secret-env":
		if !ok {
			arg = name
		}
		v, set := os.LookupEnv(arg)
		if name == "" || arg == "" || !set || v == "" {
			return "", "", fmt.Errorf("--secret-env %s: the environment variable %q is not set or empty", spec, arg)
		}
		return name, v, nil
	case !ok || name == "" || arg == "":
		return "", "", fmt.Errorf("%s %s: want NAME=%s", flag, redact(spec), map[bool]string{true: "PATH", false: "VALUE"}[flag == "--secret-file"])
	case flag == "--secret-file":
		v, err := readSecretFile(arg)
		if err != nil {
			return "", "", fmt.Errorf("--secret-file %s: %v", spec, err)
		}
		return name, v, nil
	}
	return name, arg, nil
}

// splitHosts splits SPEC@HOST[,HOST...] at the last @ (a value may hold
// one; a host does not).
func splitHosts(flag, s string) (string, []string, error) {
	i := strings.LastIndexByte(s, '@')
	if i < 0 || i == len(s)-1 {
		return "", nil, fmt.Errorf("%s %s: no @HOST[,HOST...]: say where the secret may go", flag, redact(s))
	}
	return s[:i], strings.Split(s[i+1:], ","), nil
}

// redact shows a --secret without its value.
func redact(s string) string {
	name, rest, ok := strings.Cut(s, "=")
	if !ok {
		return s
	}
	if i := strings.LastIndexByte(rest, '@'); i >= 0 {
		return name + "=***" + rest[i:]
	}
	return name + "=***"
}

// readSecretFile reads a secret's value, bounded, without its trailing
// newline.
func readSecretFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, tlsproxy.MaxSecretLen+3))
	if err != nil {
		return "", err
	}
	v := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if v == "" {
		return "", fmt.Errorf("%s is empty", path)
	}
	return v, nil
}
