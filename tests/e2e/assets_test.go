package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// e2ePrefix is the install prefix `make test-e2e` links example-assets
// with (-X .../internal/assets.Prefix).
const e2ePrefix = "/tmp/capsa-e2e-prefix"

// assetsEnv is the environment with every variable that steers the asset
// search replaced: HOME and $CAPSA_CACHE in dir, $CAPSA_ASSETS as given
// ("" for unset).
func assetsEnv(dir, assetsDir string) []string {
	var env []string
	for _, e := range os.Environ() {
		k, _, _ := strings.Cut(e, "=")
		switch k {
		case "HOME", "XDG_CACHE_HOME", "CAPSA_CACHE", "CAPSA_ASSETS", "CAPSA_KERNEL", "CAPSA_INITRD":
			continue
		}
		env = append(env, e)
	}
	env = append(env, "HOME="+filepath.Join(dir, "home"), "CAPSA_CACHE="+filepath.Join(dir, "cache"))
	if assetsDir != "" {
		env = append(env, "CAPSA_ASSETS="+assetsDir)
	}
	return env
}

// copyDir copies the files of src (no subdirectories) into dst.
func copyDir(t *testing.T, src, dst string) {
	t.Helper()
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestLibraryAssets: a program on the library built without the
// capsa_builtin tag (examples/sandbox, as a user builds it in their own
// module) boots the asset set it finds in $CAPSA_ASSETS, the build cache or
// PREFIX/share/capsa, decompresses it once into the cache and maps it after,
// refuses a corrupt set, and names every place it searched when it finds
// none.
func TestLibraryAssets(t *testing.T) {
	bin := artifact(t, "example-assets")
	set := artifact(t, "assets")
	type file struct {
		Name          string `json:"name"`
		Size          int64  `json:"size"`
		ContentSHA256 string `json:"content_sha256"`
	}
	var m struct{ Kernel, Initramfs file }
	if data, err := os.ReadFile(filepath.Join(set, "manifest.json")); err != nil || json.Unmarshal(data, &m) != nil {
		t.Fatalf("the set's manifest: %v", err)
	}
	if err := os.RemoveAll(e2ePrefix); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(e2ePrefix) })

	run := func(t *testing.T, env []string) (stdout, stderr string, took time.Duration, err error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin)
		cmd.Env = env
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		start := time.Now()
		err = cmd.Run()
		return out.String(), errb.String(), time.Since(start), err
	}
	works := func(t *testing.T, env []string) time.Duration {
		t.Helper()
		out, errs, took, err := run(t, env)
		if err != nil {
			t.Fatalf("example-assets: %v\n%s%s", err, out, errs)
		}
		for _, want := range []string{"exec: hello from capsa\n", "file: capsa was here\n", "info: kernel ", ", 2 CPUs"} {
			if !strings.Contains(out, want) {
				t.Errorf("example-assets's output lacks %q:\n%s", want, out)
			}
		}
		return took
	}

	t.Run("none", func(t *testing.T) {
		dir := t.TempDir()
		out, errs, _, err := run(t, assetsEnv(dir, ""))
		if err == nil {
			t.Fatalf("example-assets with no set anywhere succeeded:\n%s", out)
		}
		for _, want := range []string{
			"built in: none",
			"the build cache " + filepath.Join(dir, "cache", "assets") + ": no manifest.json",
			"PREFIX/share/capsa " + e2ePrefix + "/share/capsa: no manifest.json",
			"make install",
		} {
			if !strings.Contains(errs, want) {
				t.Errorf("example-assets's error lacks %q:\n%s", want, errs)
			}
		}
	})

	t.Run("CAPSA_ASSETS", func(t *testing.T) {
		dir := t.TempDir()
		first := works(t, assetsEnv(dir, set))
		for _, f := range []struct {
			sum  string
			size int64
		}{{m.Kernel.ContentSHA256, m.Kernel.Size}, {m.Initramfs.ContentSHA256, m.Initramfs.Size}} {
			st, err := os.Stat(filepath.Join(dir, "cache", "unpacked", f.sum))
			if err != nil || st.Size() != f.size {
				t.Errorf("the unpacked copy %s: %v (size %v), want %d bytes", f.sum, err, st, f.size)
			}
		}
		second := works(t, assetsEnv(dir, set))
		t.Logf("example-assets took %v decompressing the set, %v mapping its unpacked copies", first, second)
	})

	t.Run("build cache", func(t *testing.T) {
		dir := t.TempDir()
		copyDir(t, set, filepath.Join(dir, "cache", "assets"))
		works(t, assetsEnv(dir, ""))
	})

	t.Run("prefix", func(t *testing.T) {
		copyDir(t, set, filepath.Join(e2ePrefix, "share", "capsa"))
		defer os.RemoveAll(e2ePrefix)
		works(t, assetsEnv(t.TempDir(), ""))
	})

	t.Run("corrupt", func(t *testing.T) {
		dir := t.TempDir()
		bad := filepath.Join(dir, "bad")
		copyDir(t, set, bad)
		k := filepath.Join(bad, m.Kernel.Name)
		data, err := os.ReadFile(k)
		if err != nil {
			t.Fatal(err)
		}
		data[len(data)/2] ^= 0x55
		os.WriteFile(k, data, 0o644)
		out, errs, _, err := run(t, assetsEnv(dir, bad))
		if err == nil {
			t.Fatalf("example-assets with a corrupt kernel succeeded:\n%s", out)
		}
		if want := "assets: " + m.Kernel.Name + ": "; !strings.Contains(errs, want) {
			t.Errorf("example-assets's error lacks %q:\n%s", want, errs)
		}
		if ents, _ := os.ReadDir(filepath.Join(dir, "cache", "unpacked")); len(ents) != 0 {
			t.Errorf("a corrupt kernel left %d files in the unpacked cache", len(ents))
		}
	})
}
