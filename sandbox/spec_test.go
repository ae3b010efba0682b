package sandbox

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/netstack"
)

// roundTrip writes s as JSON and makes a workload of what it reads back.
func roundTrip(t *testing.T, s Spec) (Spec, error) {
	t.Helper()
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatalf("json.Marshal(spec) = %v", err)
	}
	var back Spec
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatalf("json.Unmarshal(%s) = %v", b, err)
	}
	return FromSpec(back).Spec()
}

func TestSpecRoundTrip(t *testing.T) {
	dir := t.TempDir()
	diskPath := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(diskPath, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	policy, err := netstack.ParsePolicy("deny-all", []string{"example.com:443", "10.0.0.0/8"}, []string{"bad.example.com"})
	if err != nil {
		t.Fatal(err)
	}
	b := New().CPUs(2).Memory(256).Balloon(true).Env("A=1", "B=two words").Kernel("/k").Initrd("/i").
		Watchdog(time.Minute).ReadyTimeout(30*time.Second).OutputLimit(1<<20).
		Share(dir, "/data", ReadOnly).Disk(diskPath, ReadWrite).
		Network(policy).Publish("8080:80").DNSServer("1.1.1.1:53").
		Patch(Patch{Op: PatchWrite, Path: "/etc/x", Data: []byte("hi\x00"), Mode: 0o600, Owner: &agent.Owner{UID: 1, GID: 2}},
			Patch{Op: PatchSymlink, Path: "/l", Target: "/etc/x"})
	run, err := b.Run("sh", "-c", "echo hi").Dir("/tmp").User("nobody").Timeout(time.Second).Spec()
	if err != nil {
		t.Fatalf("Spec() = %v", err)
	}
	if run.CPUs != 2 || !run.Balloon || run.Shares[0].Host != dir || run.Network.Publish[0] != "8080:80" || run.Main.Argv[2] != "echo hi" {
		t.Fatalf("Spec() = %+v, missing what the builder set", run)
	}
	got, err := roundTrip(t, run)
	if err != nil || !reflect.DeepEqual(got, run) {
		t.Fatalf("FromSpec(JSON(spec)).Spec() = %+v, %v; want %+v", got, err, run)
	}
	if got.Network.Policy.String() != policy.String() {
		t.Errorf("policy after the round trip = %s, want %s", got.Network.Policy, policy)
	}

	img, err := New().Entrypoint().RootfsSize(1<<30).Pull(PullNever).InsecureRegistry("reg:5000").
		OCI("python:3.12", "-c", "print(1)").Spec()
	if err != nil {
		t.Fatalf("OCI Spec() = %v", err)
	}
	if img.Image.Entrypoint == nil || len(img.Image.Entrypoint) != 0 {
		t.Fatalf("a cleared entrypoint became %#v, want an empty, non-nil slice", img.Image.Entrypoint)
	}
	got, err = roundTrip(t, img)
	if err != nil || !reflect.DeepEqual(got, img) {
		t.Fatalf("image spec round trip = %+v, %v; want %+v", got, err, img)
	}
	kept, err := New().OCI("alpine").Spec()
	if err != nil || kept.Image.Entrypoint != nil {
		t.Fatalf("an untouched entrypoint = %#v, %v; want nil (the image's)", kept.Image.Entrypoint, err)
	}
	if got, _ := roundTrip(t, kept); got.Image.Entrypoint != nil {
		t.Fatalf("an untouched entrypoint after the round trip = %#v, want nil", got.Image.Entrypoint)
	}
}

// A spec is checked like the builder's input, with the same errors.
func TestSpecErrors(t *testing.T) {
	for name, tc := range map[string]struct {
		json string
		want string
	}{
		"cpus":           {`{"cpus":999,"main":{"argv":["true"]}}`, "999 CPUs"},
		"no command":     {`{"main":{}}`, "Run needs a command"},
		"share mode":     {`{"shares":[{"host":"/","guest":"/x","mode":"rx"}],"main":{"argv":["true"]}}`, `share mode "rx"`},
		"missing share":  {`{"shares":[{"host":"/does/not/exist","guest":"/x","mode":"ro"}],"main":{"argv":["true"]}}`, "/does/not/exist"},
		"policy rule":    {`{"network":{"policy":{"mode":"deny-all","allow":["exa mple"]}},"main":{"argv":["true"]}}`, "exa mple"},
		"policy mode":    {`{"network":{"policy":{"mode":"open"}},"main":{"argv":["true"]}}`, `"open"`},
		"publish":        {`{"network":{"policy":{"mode":"allow-all"},"publish":["x:80"]},"main":{"argv":["true"]}}`, "publish"},
		"patch op":       {`{"patches":[{"Op":"chmod","Path":"/x"}],"main":{"argv":["true"]}}`, `"chmod"`},
		"image and argv": {`{"image":{"ref":"alpine","entrypoint":null},"main":{"argv":["true"]}}`, "comes from the image"},
		"tap name":       {`{"network":{"tap":{"name":"a-name-far-too-long","mac":"52:54:00:00:00:01","address":"10.0.0.2/24"}},"main":{"argv":["true"]}}`, "interface name"},
		"tap mac":        {`{"network":{"tap":{"name":"tap0","mac":"01:00:5e:00:00:01","address":"10.0.0.2/24"}},"main":{"argv":["true"]}}`, "unicast"},
		"tap address":    {`{"network":{"tap":{"name":"tap0","mac":"52:54:00:00:00:01","address":"10.0.0.2"}},"main":{"argv":["true"]}}`, "with its prefix"},
		"tap gateway":    {`{"network":{"tap":{"name":"tap0","mac":"52:54:00:00:00:01","address":"10.0.0.2/24","gateway":"fe80::1"}},"main":{"argv":["true"]}}`, "gateway"},
		"tap mtu":        {`{"network":{"tap":{"name":"tap0","mac":"52:54:00:00:00:01","address":"10.0.0.2/24","mtu":20}},"main":{"argv":["true"]}}`, "MTU 20"},
		"tap and nat":    {`{"network":{"policy":{"mode":"allow-all"},"tap":{"name":"tap0","mac":"52:54:00:00:00:01","address":"10.0.0.2/24"}},"main":{"argv":["true"]}}`, "no NAT"},
	} {
		t.Run(name, func(t *testing.T) {
			var s Spec
			err := json.Unmarshal([]byte(tc.json), &s)
			if err == nil {
				_, err = FromSpec(s).Spec()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("spec %s: error = %v, want one naming %q", tc.json, err, tc.want)
			}
		})
	}
}

func TestSpecTapRoundTrip(t *testing.T) {
	sp, err := New().Tap(TapSpec{Name: "tap0", MAC: "52:54:00:00:00:01", Address: "10.0.0.2/24", Gateway: "10.0.0.1"}).Run("true").Spec()
	if err != nil {
		t.Fatal(err)
	}
	if sp.Network == nil || sp.Network.Tap == nil || sp.Network.Tap.MTU != 1500 || sp.Network.Policy != nil {
		t.Fatalf("Spec = %+v, want the tap with the default MTU and no NAT policy", sp.Network)
	}
	again, err := FromSpec(sp).Spec()
	if err != nil || *again.Network.Tap != *sp.Network.Tap || again.Network.Policy != nil {
		t.Errorf("FromSpec(Spec) = %+v, %v; want the same tap", again.Network, err)
	}
}

func TestEgressProxySpec(t *testing.T) {
	p := EgressProxy{Address: "proxy.example.com:1080", Username: "agent", Password: "pw-secret", PublicOnly: true}
	w := New().Network(nil).EgressProxy(p).Run("true")
	spec, err := w.Spec()
	if err != nil {
		t.Fatal(err)
	}
	if got := spec.Network.EgressProxy; got == nil || *got != (EgressProxySpec{Address: p.Address, Username: "agent", PublicOnly: true}) {
		t.Errorf("the spec's proxy: %+v", got)
	}
	b, _ := json.Marshal(spec)
	if strings.Contains(string(b), "pw-secret") {
		t.Errorf("the spec holds the password: %s", b)
	}
	values := w.SecretValues()
	if values[egressProxyKey] != "pw-secret" {
		t.Errorf("the secret values: %v; want the password", values)
	}
	if got := spec.Network.EgressProxy.proxy(values); got != p {
		t.Errorf("the proxy again: %+v; want %+v", got, p)
	}
	again, err := FromSpec(spec).Spec()
	if err != nil || !reflect.DeepEqual(again.Network.EgressProxy, spec.Network.EgressProxy) {
		t.Errorf("FromSpec: %v, %+v", err, again.Network)
	}
	for what, w := range map[string]*Workload{
		"no network":   New().EgressProxy(p).Run("true"),
		"a bad proxy":  New().Network(nil).EgressProxy(EgressProxy{Address: "x"}).Run("true"),
		"a tap":        FromSpec(Spec{Network: &NetworkSpec{Tap: &TapSpec{Name: "tap0", MAC: "52:54:00:00:00:01", Address: "10.0.0.2/24"}, EgressProxy: &EgressProxySpec{Address: "192.0.2.1:1080"}}}),
		"a bad record": FromSpec(Spec{Network: &NetworkSpec{Policy: nil, EgressProxy: &EgressProxySpec{Address: "192.0.2.1"}}}),
	} {
		if _, err := w.Spec(); err == nil || !strings.Contains(err.Error(), "proxy") {
			t.Errorf("%s: %v; want an error naming the proxy", what, err)
		}
	}
}
