package layering

import (
	"fmt"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
)

const module = "github.com/capsa-sandbox/capsa"

// imports maps each non-test Go file of the module, by its path from the
// module's root, to the packages it imports. The tree is parsed once for
// all the tests.
func imports(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for file, ims := range importsWithTests(t) {
		if !strings.HasSuffix(file, "_test.go") {
			out[file] = ims
		}
	}
	return out
}

// importsWithTests is imports with the test files too.
func importsWithTests(t *testing.T) map[string][]string {
	t.Helper()
	out, err := parsed()
	if err != nil {
		t.Fatal(err)
	}
	return out
}

var parsed = sync.OnceValues(parseImports)

func parseImports() (map[string][]string, error) {
	root, err := filepath.Abs("../..")
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		return nil, fmt.Errorf("the module's root: %w", err)
	}
	out := map[string][]string{}
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch {
			case rel == ".":
			case strings.HasPrefix(d.Name(), "."), d.Name() == "testdata", d.Name() == "node_modules", rel == "build":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		for _, im := range f.Imports {
			p, err := strconv.Unquote(im.Path.Value)
			if err != nil {
				return err
			}
			out[filepath.ToSlash(rel)] = append(out[filepath.ToSlash(rel)], p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(out) < 100 {
		return nil, fmt.Errorf("found imports in only %d files: not the module's tree", len(out))
	}
	return out, nil
}

// under reports whether the file lies in the package dir or below it.
func under(file, dir string) bool { return strings.HasPrefix(file, dir+"/") }

// in reports whether the file lies in the package dir itself.
func in(file, dir string) bool { return filepath.ToSlash(filepath.Dir(file)) == dir }

// pkg is the module's package at dir, as imported.
func pkg(dir string) string { return module + "/" + dir }

// isPkg reports whether the import path p is the module's package dir or
// one below it.
func isPkg(p, dir string) bool { return p == pkg(dir) || strings.HasPrefix(p, pkg(dir)+"/") }

// TestFrontEndsUseTheManager: the front ends, their tests included (a
// test makes the records it needs through supervisortest), reach
// sandboxes through the manager only.
func TestFrontEndsUseTheManager(t *testing.T) {
	frontEnds := []string{"cmd/capsa", "mcp", "e2b", "shim"}
	engine := []string{"kvm", "vmm", "virtio", "confine", "snapshot", "store", "guestmem"}
	var bad []string
	for file, ims := range importsWithTests(t) {
		for _, fe := range frontEnds {
			if !under(file, fe) {
				continue
			}
			for _, p := range ims {
				for _, e := range engine {
					if isPkg(p, e) {
						bad = append(bad, file+" imports "+p)
					}
				}
			}
		}
	}
	report(t, bad, "a front end reaches past the manager into the engine")
}

func TestOnlyKVMHoldsUnsafe(t *testing.T) {
	// Where else unsafe is needed, and why.
	allowed := map[string]string{
		"guestmem/atomic.go": "atomic access to the guest's memory, which the guest shares (virtqueue indices), and mincore on its pages",
		"agent/seccomp.go":   "the guest agent installs a seccomp filter in the guest: a pointer to the BPF program for the syscall",
	}
	var bad []string
	for file, ims := range imports(t) {
		for _, p := range ims {
			if p != "unsafe" || in(file, "kvm") || allowed[file] != "" || strings.HasSuffix(file, ".pb.go") {
				continue
			}
			bad = append(bad, file+" imports unsafe")
		}
	}
	report(t, bad, "unsafe outside package kvm and the files allowed it")
}

func TestOnlyVMMWiresKVM(t *testing.T) {
	allowed := map[string]string{
		"confine":      "the seccomp allowlist names the VMM's KVM ioctls by their numbers",
		"tests/nested": "the nested host checks that its L1 gives a working /dev/kvm",
	}
	var bad []string
	for file, ims := range imports(t) {
		for _, p := range ims {
			if !isPkg(p, "kvm") || under(file, "kvm") || in(file, "vmm") {
				continue
			}
			ok := false
			for dir := range allowed {
				ok = ok || under(file, dir)
			}
			if !ok {
				bad = append(bad, file+" imports "+p)
			}
		}
	}
	report(t, bad, "only vmm wires KVM to the devices")
	var devices []string
	for file, ims := range imports(t) {
		if !under(file, "virtio") && !under(file, "devices") {
			continue
		}
		for _, p := range ims {
			if isPkg(p, "kvm") || isPkg(p, "vmm") {
				devices = append(devices, file+" imports "+p)
			}
		}
	}
	report(t, devices, "a device knows of KVM or the VMM")
}

func TestEngineImportsNoFrontEnd(t *testing.T) {
	frontEnds := []string{"cmd", "mcp", "e2b", "shim"}
	var bad []string
	for file, ims := range imports(t) {
		fe := false
		for _, d := range append(frontEnds, "tests", "examples") {
			fe = fe || under(file, d)
		}
		if fe {
			continue
		}
		for _, p := range ims {
			for _, d := range frontEnds {
				if isPkg(p, d) {
					bad = append(bad, file+" imports "+p)
				}
			}
		}
	}
	report(t, bad, "the engine imports a front end")
}

func report(t *testing.T, bad []string, what string) {
	t.Helper()
	if len(bad) == 0 {
		return
	}
	sort.Strings(bad)
	t.Errorf("%s:\n\t%s", what, strings.Join(bad, "\n\t"))
}
