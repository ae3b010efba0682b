package shim

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/BurntSushi/toml"
	"go.yaml.in/yaml/v3"
)

// containerdConfig is what the tests read of a containerd configuration:
// its version and its CRI plugins' runtimes.
type containerdConfig struct {
	Version int `toml:"version"`
	Plugins map[string]struct {
		Containerd struct {
			Runtimes map[string]struct {
				RuntimeType string `toml:"runtime_type"`
			} `toml:"runtimes"`
		} `toml:"containerd"`
	} `toml:"plugins"`
}

// readDeploy reads a file of the repository's deploy/ directory.
func readDeploy(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "deploy", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestDeployFilesAgree checks what can be checked of deploy/ without a
// cluster: each manifest parses; the RuntimeClass's handler is the runtime
// the containerd snippet adds, whose runtime_type is this shim's; the
// DaemonSet and the SandboxTemplate name what the others define; and the
// installer links the binary name containerd looks for.
func TestDeployFilesAgree(t *testing.T) {
	var conf containerdConfig
	if _, err := toml.Decode(string(readDeploy(t, "containerd-config.toml")), &conf); err != nil {
		t.Fatalf("containerd-config.toml: %v", err)
	}
	rt, ok := conf.Plugins["io.containerd.grpc.v1.cri"].Containerd.Runtimes["capsa"]
	if conf.Version != 2 || !ok || rt.RuntimeType != RuntimeName {
		t.Fatalf("containerd-config.toml: version %d, runtime capsa %+v; want version 2 and runtime_type %s", conf.Version, rt, RuntimeName)
	}
	conf.Plugins = nil
	if _, err := toml.Decode(string(readDeploy(t, "containerd2-config.toml")), &conf); err != nil {
		t.Fatalf("containerd2-config.toml: %v", err)
	}
	rt, ok = conf.Plugins["io.containerd.cri.v1.runtime"].Containerd.Runtimes["capsa"]
	if conf.Version != 3 || !ok || rt.RuntimeType != RuntimeName {
		t.Fatalf("containerd2-config.toml: version %d, runtime capsa %+v; want version 3 and runtime_type %s", conf.Version, rt, RuntimeName)
	}

	var rc struct {
		Kind     string `yaml:"kind"`
		Metadata struct {
			Name string `yaml:"name"`
		} `yaml:"metadata"`
		Handler    string `yaml:"handler"`
		Scheduling struct {
			NodeSelector map[string]string `yaml:"nodeSelector"`
		} `yaml:"scheduling"`
	}
	if err := yaml.Unmarshal(readDeploy(t, "runtimeclass.yaml"), &rc); err != nil {
		t.Fatalf("runtimeclass.yaml: %v", err)
	}
	if rc.Kind != "RuntimeClass" || rc.Handler != "capsa" {
		t.Errorf("runtimeclass.yaml: kind %q handler %q; want a RuntimeClass with handler capsa (the containerd runtime's name)", rc.Kind, rc.Handler)
	}

	var ds struct {
		Kind string `yaml:"kind"`
		Spec struct {
			Template struct {
				Spec struct {
					NodeSelector   map[string]string `yaml:"nodeSelector"`
					InitContainers []struct {
						Image   string   `yaml:"image"`
						Command []string `yaml:"command"`
					} `yaml:"initContainers"`
				} `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
	}
	if err := yaml.Unmarshal(readDeploy(t, "daemonset.yaml"), &ds); err != nil {
		t.Fatalf("daemonset.yaml: %v", err)
	}
	if ds.Kind != "DaemonSet" || len(ds.Spec.Template.Spec.InitContainers) != 1 || ds.Spec.Template.Spec.InitContainers[0].Command[0] != "/install.sh" {
		t.Errorf("daemonset.yaml: %+v; want a DaemonSet whose init container runs /install.sh", ds)
	}
	for k, v := range rc.Scheduling.NodeSelector {
		if ds.Spec.Template.Spec.NodeSelector[k] != v {
			t.Errorf("the RuntimeClass schedules pods on %s=%s, where the DaemonSet does not install capsa", k, v)
		}
	}
	dockerfile := string(readDeploy(t, "installer/Dockerfile"))
	for _, want := range []string{"/install.sh", "/containerd-config.toml", "/containerd2-config.toml", "/capsa"} {
		if !strings.Contains(dockerfile, want) {
			t.Errorf("installer/Dockerfile does not provide %s", want)
		}
	}
	if install := string(readDeploy(t, "installer/install.sh")); !strings.Contains(install, "ln -sf capsa \"$root/usr/local/bin/"+BinaryName+"\"") {
		t.Errorf("installer/install.sh does not link %s to capsa", BinaryName)
	}

	var st struct {
		Kind string `yaml:"kind"`
		Spec struct {
			PodTemplate struct {
				Spec struct {
					RuntimeClassName string `yaml:"runtimeClassName"`
				} `yaml:"spec"`
			} `yaml:"podTemplate"`
		} `yaml:"spec"`
	}
	if err := yaml.Unmarshal(readDeploy(t, "sandbox-template.yaml"), &st); err != nil {
		t.Fatalf("sandbox-template.yaml: %v", err)
	}
	if st.Kind != "SandboxTemplate" || st.Spec.PodTemplate.Spec.RuntimeClassName != rc.Metadata.Name {
		t.Errorf("sandbox-template.yaml: kind %q, runtimeClassName %q; want a SandboxTemplate naming the RuntimeClass %q", st.Kind, st.Spec.PodTemplate.Spec.RuntimeClassName, rc.Metadata.Name)
	}
}

// TestInstallerScript runs deploy/installer/install.sh against a host root
// of the test's own (with nsenter stubbed: it only records the restart):
// it refuses a node without /dev/kvm, installs capsa with the shim's link,
// adds the runtime to an existing containerd configuration once, and
// restarts containerd.
func TestInstallerScript(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("making the host root's /dev/kvm needs root")
	}
	dir := t.TempDir()
	root := filepath.Join(dir, "host")
	for _, d := range []string{"usr/local/bin", "etc/containerd", "dev"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// What the image holds beside the script: capsa and the snippet.
	img := filepath.Join(dir, "img")
	os.MkdirAll(img, 0o755)
	script := strings.NewReplacer("/capsa ", img+"/capsa ", "=/containerd", "="+img+"/containerd").Replace(string(readDeploy(t, "installer/install.sh")))
	os.WriteFile(filepath.Join(img, "install.sh"), []byte(script), 0o755)
	os.WriteFile(filepath.Join(img, "capsa"), []byte("#!/bin/sh\necho v-test\n"), 0o755)
	os.WriteFile(filepath.Join(img, "containerd-config.toml"), readDeploy(t, "containerd-config.toml"), 0o644)
	os.WriteFile(filepath.Join(img, "containerd2-config.toml"), readDeploy(t, "containerd2-config.toml"), 0o644)
	stubs := filepath.Join(dir, "stubs")
	os.MkdirAll(stubs, 0o755)
	os.WriteFile(filepath.Join(stubs, "nsenter"), []byte("#!/bin/sh\necho \"$@\" >> "+dir+"/nsenter.log\n"), 0o755)
	run := func() (string, error) {
		cmd := exec.Command("/bin/sh", filepath.Join(img, "install.sh"))
		cmd.Env = append(os.Environ(), "HOST_ROOT="+root, "PATH="+stubs+":"+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run(); err == nil || !strings.Contains(out, "no /dev/kvm") {
		t.Fatalf("install.sh without /dev/kvm: %v %q; want it refused", err, out)
	}
	if err := syscall.Mknod(filepath.Join(root, "dev/kvm"), syscall.S_IFCHR|0o660, 10<<8|232); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(root, "etc/containerd/config.toml")
	for _, c := range []struct{ before, plugin string }{
		{"version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"pause:3.9\"\n", "io.containerd.grpc.v1.cri"},
		{"version = 3\n[plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = 'pause:3.10'\n", "io.containerd.cri.v1.runtime"},
	} {
		os.WriteFile(conf, []byte(c.before), 0o644)
		for range 2 {
			if out, err := run(); err != nil {
				t.Fatalf("install.sh: %v\n%s", err, out)
			}
		}
		if l, err := os.Readlink(filepath.Join(root, "usr/local/bin", BinaryName)); err != nil || l != "capsa" {
			t.Errorf("the shim's link = %q, %v; want capsa", l, err)
		}
		b, _ := os.ReadFile(conf)
		var parsed containerdConfig
		if _, err := toml.Decode(string(b), &parsed); err != nil {
			t.Fatalf("containerd's configuration after the installer does not parse: %v\n%s", err, b)
		}
		if parsed.Plugins[c.plugin].Containerd.Runtimes["capsa"].RuntimeType != RuntimeName || !strings.HasPrefix(string(b), c.before) {
			t.Errorf("containerd's configuration after two installs:\n%s\nwant what was there, then the runtime under %s", b, c.plugin)
		}
		if n := strings.Count(string(b), "\n[plugins"); n != 2 {
			t.Errorf("containerd's configuration after two installs has %d tables:\n%s\nwant the runtime's added once", n, b)
		}
	}
	if log, _ := os.ReadFile(filepath.Join(dir, "nsenter.log")); strings.Count(string(log), "systemctl restart containerd") != 4 {
		t.Errorf("nsenter calls = %q, want containerd restarted by each install", log)
	}
}
