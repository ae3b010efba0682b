package sandbox

import (
	"bytes"
	"encoding/json"
	"errors"
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

// TestHeaderRulesNeverInSpec: a header rule's value, like a secret's,
// stays out of the Spec and goes with the secrets' values; its host is
// intercepted (the CA names it), the guest's environment points at the
// CA; through JSON the rule comes back, and needs its values to start.
func TestHeaderRulesNeverInSpec(t *testing.T) {
	const value = "Bearer header-rule-value"
	w := New().Network(netstack.PublicOnly()).Header("API.example.com.", "authorization", value).
		Header("api.example.com", "X-Team", "blue").Header("*.example.net", "X-Trace", "1").Run("true")
	spec, err := w.Spec()
	if err != nil {
		t.Fatalf("Spec() = %v", err)
	}
	b, _ := json.Marshal(spec)
	if bytes.Contains(b, []byte(value)) {
		t.Fatalf("the spec holds a header rule's value: %s", b)
	}
	want := []HeaderSpec{{Host: "api.example.com", Names: []string{"Authorization", "X-Team"}}, {Host: "*.example.net", Names: []string{"X-Trace"}}}
	if !reflect.DeepEqual(spec.Network.Headers, want) {
		t.Errorf("Spec().Network.Headers = %+v, want %+v", spec.Network.Headers, want)
	}
	for _, e := range caEnv {
		if !slices.Contains(spec.Env, e) {
			t.Errorf("Spec().Env = %q, want %q in it", spec.Env, e)
		}
	}
	back, err := roundTrip(t, spec)
	if err != nil || !reflect.DeepEqual(back, spec) {
		t.Fatalf("FromSpec(JSON(spec)).Spec() = %+v, %v; want %+v", back, err, spec)
	}
	if _, err := startInterception(FromSpec(back).c, nil, nil); err == nil || !strings.Contains(err.Error(), "Authorization has no value") {
		t.Errorf("starting without the values: %v, want an error naming the header", err)
	}
	in, err := startInterception(FromSpec(back).Secrets(w.SecretValues()).c, nil, nil)
	if err != nil {
		t.Fatalf("startInterception with the values = %v", err)
	}
	defer in.close()
	if got := in.ca.Certificate().PermittedDNSDomains; !slices.Equal(got, []string{"api.example.com", "example.net"}) {
		t.Errorf("the CA's name constraints = %q, want the rules' domains", got)
	}
	// A snapshot's CA made for other hosts is refused, naming the host.
	ca, _ := tlsproxy.NewCA([]string{"other.example.com"})
	c := FromSpec(back).Secrets(w.SecretValues()).c
	c.ca = ca
	if _, err := startInterception(c, nil, nil); !errors.Is(err, tlsproxy.ErrOutsideCA) || !strings.Contains(err.Error(), "api.example.com") {
		t.Errorf("starting with a CA for other hosts: %v, want ErrOutsideCA naming api.example.com", err)
	}
	// Bad rules, before anything boots.
	for _, b := range []*Builder{
		New().Network(netstack.PublicOnly()).Header("*", "A", "b"),
		New().Network(netstack.PublicOnly()).Header("a.test", "Host", "b"),
		New().Network(netstack.PublicOnly()).Header("a.test", "A", "1").Header("a.test", "a", "2"),
		New().Header("a.test", "A", "1"),
	} {
		if _, err := b.Run("true").Spec(); err == nil {
			t.Errorf("a bad rule was taken: %+v", b.c.Network)
		}
	}
}
