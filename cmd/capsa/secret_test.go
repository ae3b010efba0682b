package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
)

func TestSecretFlags(t *testing.T) {
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte("from-a-file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CAPSA_TEST_TOKEN", "from-the-env")
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	f := addSecretFlags(fs)
	err := fs.Parse([]string{
		"--secret", "A=p@ss@api.example.com,*.example.org",
		"--secret-env", "B=CAPSA_TEST_TOKEN@b.example.com",
		"--secret-file", "C=" + file + "@c.example.com",
		"--secret-body", "A", "--tls-intercept", "x.example.net",
	})
	if err != nil {
		t.Fatal(err)
	}
	b := sandbox.New().Network(netstack.PublicOnly())
	if err := f.apply(b); err != nil {
		t.Fatalf("apply = %v", err)
	}
	w := b.Run("true")
	spec, err := w.Spec()
	if err != nil {
		t.Fatalf("Spec() = %v", err)
	}
	want := map[string]string{"A": "p@ss", "B": "from-the-env", "C": "from-a-file"}
	got := w.SecretValues()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("secret %s = %q, want %q", k, got[k], v)
		}
	}
	n := spec.Network
	if len(n.Secrets) != 3 || strings.Join(n.Secrets[0].Hosts, " ") != "api.example.com *.example.org" || !n.Secrets[0].Body ||
		len(n.Intercept) != 1 {
		t.Errorf("spec network = %+v", n)
	}
}

func TestSecretFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--secret", "A=value-without-hosts"},
		{"--secret", "A=value@"},
		{"--secret", "=value@h.example.com"},
		{"--secret-env", "A=CAPSA_TEST_UNSET_VARIABLE@h.example.com"},
		{"--secret-file", "A=/does/not/exist@h.example.com"},
	} {
		fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
		f := addSecretFlags(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		err := f.apply(sandbox.New().Network(nil))
		if err == nil {
			t.Errorf("%q: apply = nil error", args)
			continue
		}
		if args[0] == "--secret" && strings.Contains(err.Error(), "value") {
			t.Errorf("%q: the error %q shows the value", args, err)
		}
	}
	if got := redact("A=s3cret@x.example.com"); got != "A=***@x.example.com" {
		t.Errorf("redact = %q", got)
	}
}
