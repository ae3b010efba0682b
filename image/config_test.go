package image

import (
	"errors"
	"os"
	"os/exec"
	"reflect"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

func TestResolve(t *testing.T) {
	img := &Image{Config: v1.ConfigFile{Config: v1.Config{
		Entrypoint: []string{"/entry"}, Cmd: []string{"default", "args"},
		Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, WorkingDir: "/app", User: "app",
	}}}
	for _, tc := range []struct {
		name string
		o    Overrides
		want Process
	}{
		{"image defaults", Overrides{}, Process{
			Argv: []string{"/entry", "default", "args"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"args replace CMD", Overrides{Args: []string{"x"}}, Process{
			Argv: []string{"/entry", "x"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"--entrypoint drops CMD", Overrides{Entrypoint: []string{"/bin/sh"}}, Process{
			Argv: []string{"/bin/sh"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"empty --entrypoint with args", Overrides{Entrypoint: []string{}, Args: []string{"ls", "-l"}}, Process{
			Argv: []string{"ls", "-l"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=1"}, Dir: "/app", User: "app"}},
		{"env, dir and user override", Overrides{Env: []string{"A=2", "B=3"}, Dir: "/tmp", User: "1000:1000"}, Process{
			Argv: []string{"/entry", "default", "args"}, Env: []string{"PATH=/opt/bin:/bin", "LANG=C.UTF-8", "A=2", "B=3"}, Dir: "/tmp", User: "1000:1000"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := img.Resolve(tc.o)
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Resolve(%+v) = %+v, %v; want %+v", tc.o, got, err, tc.want)
			}
		})
	}
	bare := &Image{}
	if _, err := bare.Resolve(Overrides{}); !errors.Is(err, ErrNoCommand) {
		t.Errorf("Resolve of an image without a command = %v, want ErrNoCommand", err)
	}
	got, err := bare.Resolve(Overrides{Args: []string{"/hello"}})
	if err != nil || got.Dir != "/" || got.User != "" || !reflect.DeepEqual(got.Env, []string{"PATH=" + DefaultPath}) {
		t.Errorf("Resolve of a bare image = %+v, %v; want dir /, root, the default PATH", got, err)
	}
}

func TestCreateUpper(t *testing.T) {
	p := t.TempDir() + "/upper.ext4"
	if err := CreateUpper(p, 256<<20); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil || fi.Size() != 256<<20 {
		t.Fatalf("Stat = %v, %v; want a 256 MiB file", fi, err)
	}
	sb := make([]byte, 2)
	f, _ := os.Open(p)
	defer f.Close()
	f.ReadAt(sb, 1024+0x38) // s_magic
	if sb[0] != 0x53 || sb[1] != 0xef {
		t.Errorf("superblock magic % x, want 53 ef", sb)
	}
	if err := CreateUpper(p, 256<<20); err == nil {
		t.Error("CreateUpper over an existing file succeeded")
	}
	if err := CreateUpper(p+"2", 1<<20); err == nil {
		t.Error("CreateUpper of 1 MiB succeeded")
	}
	if e2fsck, err := exec.LookPath("e2fsck"); err == nil {
		if out, err := exec.Command(e2fsck, "-fn", p).CombinedOutput(); err != nil {
			t.Errorf("e2fsck -fn: %v\n%s", err, out)
		}
	}
}
