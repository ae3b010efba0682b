package sandbox

import (
	"bytes"
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/tlsproxy"
)

const testSecretValue = "s3cr3t-value-never-in-a-spec"

func TestSecretNeverInSpec(t *testing.T) {
	w := New().Network(netstack.PublicOnly()).Env("A=1").
		Secret("API_KEY", testSecretValue, "api.example.com", "*.example.org").SecretInBody("API_KEY").
		TLSIntercept("other.example.com").Run("true")
	spec, err := w.Spec()
	if err != nil {
		t.Fatalf("Spec() = %v", err)
	}
	b, _ := json.Marshal(spec)
	if bytes.Contains(b, []byte(testSecretValue)) {
		t.Fatalf("the spec holds the secret's value: %s", b)
	}
	secrets := spec.Network.Secrets
	if len(secrets) != 1 || !strings.HasPrefix(secrets[0].Placeholder, tlsproxy.PlaceholderPrefix) || !secrets[0].Body ||
		!slices.Equal(secrets[0].Hosts, []string{"api.example.com", "*.example.org"}) {
		t.Fatalf("Spec().Network.Secrets = %+v, want API_KEY with a placeholder, its hosts, in bodies", secrets)
	}
	for _, want := range append([]string{"A=1", "API_KEY=" + secrets[0].Placeholder}, caEnv...) {
		if !slices.Contains(spec.Env, want) {
			t.Errorf("Spec().Env = %q, want %q in it", spec.Env, want)
		}
	}
	if got := w.SecretValues(); !reflect.DeepEqual(got, map[string]string{"API_KEY": testSecretValue}) {
		t.Errorf("SecretValues() = %v", got)
	}

	// Through JSON and back: the same spec, the placeholder stable, and no
	// value until one is given.
	back, err := roundTrip(t, spec)
	if err != nil || !reflect.DeepEqual(back, spec) {
		t.Fatalf("FromSpec(JSON(spec)).Spec() = %+v, %v; want %+v", back, err, spec)
	}
	again := FromSpec(back)
	if _, err := startInterception(again.c, nil, nil); err == nil || !strings.Contains(err.Error(), "API_KEY has no value") {
		t.Errorf("starting the interception of a spec without values: %v, want an error naming API_KEY", err)
	}
	in, err := startInterception(again.Secrets(w.SecretValues()).c, nil, nil)
	if err != nil {
		t.Fatalf("startInterception with the values = %v", err)
	}
	defer in.close()
	leaf := in.ca.Certificate()
	if !slices.Equal(leaf.PermittedDNSDomains, []string{"other.example.com", "api.example.com", "example.org"}) {
		t.Errorf("the CA's name constraints = %q, want the intercepted domains", leaf.PermittedDNSDomains)
	}
}

func TestSecretErrors(t *testing.T) {
	for what, b := range map[string]*Builder{
		"bad name":        New().Network(nil).Secret("API-KEY", "v4lue", "api.example.com"),
		"no hosts":        New().Network(nil).Secret("K", "v4lue"),
		"IP host":         New().Network(nil).Secret("K", "v4lue", "10.0.0.1"),
		"control":         New().Network(nil).Secret("K", "v\nX: y", "api.example.com"),
		"twice":           New().Network(nil).Secret("K", "v4lue", "a.example.com").Secret("K", "other", "b.example.com"),
		"body of unknown": New().Network(nil).SecretInBody("K"),
		"no network":      New().Secret("K", "v4lue", "api.example.com"),
		"bad intercept":   New().Network(nil).TLSIntercept("*"),
		"missing CA file": New().Network(nil).UpstreamCA("/does/not/exist.pem"),
	} {
		err := b.Err()
		if err == nil {
			t.Errorf("%s: Err() = nil", what)
			continue
		}
		if strings.Contains(err.Error(), "v4lue") || strings.Contains(err.Error(), "v\nX") {
			t.Errorf("%s: the error %q shows the value", what, err)
		}
	}
}
