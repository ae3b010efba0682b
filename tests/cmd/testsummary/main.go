// Command testsummary reads `go test -json` on standard input, prints each
// failed test's output and each package's result as `go test` would, and
// ends with how many tests (subtests too) passed, failed and skipped. A
// skip that the expected-skips file does not list fails it, as does a
// failed test or package (a build failure, a panic, a timeout).
//
// The expected-skips file has one "PACKAGE TEST: why, and where" line per
// skip (PACKAGE the import path, TEST a test or subtest, or * for every
// test of the package); # starts a comment. "PACKAGE TEST without-kvm:
// why" expects the skip only on a machine with no /dev/kvm at all (where
// the package's KVM tests cannot run; with one, even one that cannot boot
// Linux, they run and must pass).
//
// It starts from cmd/test2json's event format (encoding/json's
// TestEvent: Action, Package, Test, Output); nothing else of it is used.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is one line of `go test -json`.
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

func main() {
	expected := flag.String("expected", "", "the file of expected skips")
	flag.Parse()
	_, err := os.Stat("/dev/kvm")
	allowed, err := readExpected(*expected, err == nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsummary:", err)
		os.Exit(2)
	}
	s, err := summarize(os.Stdin, os.Stdout, allowed)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testsummary:", err)
		os.Exit(2)
	}
	fmt.Println(s.line())
	if !s.ok() {
		os.Exit(1)
	}
}

// readExpected reads the expected skips: "PACKAGE TEST" keys; those
// marked without-kvm only if haveKVM is false.
func readExpected(path string, haveKVM bool) (map[string]bool, error) {
	out := map[string]bool{}
	if path == "" {
		return out, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		key, why, ok := strings.Cut(line, ":")
		f := strings.Fields(key)
		withoutKVM := len(f) == 3 && f[2] == "without-kvm"
		if !ok || (len(f) != 2 && !withoutKVM) || strings.TrimSpace(why) == "" {
			return nil, fmt.Errorf("%s:%d: want \"PACKAGE TEST: why\" or \"PACKAGE TEST without-kvm: why\"", path, i+1)
		}
		if withoutKVM && haveKVM {
			continue
		}
		out[f[0]+" "+f[1]] = true
	}
	return out, nil
}

// summary is what a run gave.
type summary struct {
	passed, failed, skipped int
	unexpected              []string // skips not expected
	failedTests             []string
	failedPkgs              []string
}

func (s *summary) ok() bool {
	return len(s.unexpected) == 0 && len(s.failedTests) == 0 && len(s.failedPkgs) == 0
}

func (s *summary) line() string {
	l := fmt.Sprintf("tests: %d passed, %d failed, %d skipped", s.passed, s.failed, s.skipped)
	if len(s.failedPkgs) > 0 {
		l += "\nFAILED packages: " + strings.Join(s.failedPkgs, " ")
	}
	if len(s.failedTests) > 0 {
		l += "\nFAILED tests: " + strings.Join(s.failedTests, " ")
	}
	if len(s.unexpected) > 0 {
		l += "\nFAILED: skipped, and not in the expected skips: " + strings.Join(s.unexpected, " ")
	}
	return l
}

// summarize reads the events from r and writes what go test would show
// of them to w: failed tests' output, and each package's last lines.
func summarize(r io.Reader, w io.Writer, allowed map[string]bool) (*summary, error) {
	s := &summary{}
	outputs := map[string]*strings.Builder{} // "pkg test" -> its output so far
	pkgOut := map[string]*strings.Builder{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if err := json.Unmarshal(line, &e); err != nil {
			// go test writes build errors as plain text.
			fmt.Fprintln(w, string(line))
			continue
		}
		key := e.Package + " " + e.Test
		switch e.Action {
		case "build-output": // a package that does not build: go build's words
			io.WriteString(w, e.Output)
		case "output":
			m := outputs
			k := key
			if e.Test == "" {
				m, k = pkgOut, e.Package
			}
			b := m[k]
			if b == nil {
				b = &strings.Builder{}
				m[k] = b
			}
			if b.Len() < 1<<20 {
				b.WriteString(e.Output)
			}
		case "pass":
			if e.Test != "" {
				s.passed++
			}
			delete(outputs, key)
		case "skip":
			if e.Test == "" {
				break // a package without tests
			}
			s.skipped++
			if !allowed[key] && !allowed[e.Package+" *"] {
				s.unexpected = append(s.unexpected, key)
				if b := outputs[key]; b != nil {
					io.WriteString(w, b.String())
				}
			}
			delete(outputs, key)
		case "fail":
			if e.Test != "" {
				s.failed++
				s.failedTests = append(s.failedTests, key)
				if b := outputs[key]; b != nil {
					io.WriteString(w, b.String())
				}
				delete(outputs, key)
				break
			}
			s.failedPkgs = append(s.failedPkgs, e.Package)
			if b := pkgOut[e.Package]; b != nil {
				io.WriteString(w, b.String())
			}
		}
		if e.Test == "" && (e.Action == "pass" || e.Action == "skip") {
			if b := pkgOut[e.Package]; b != nil {
				// The package's closing line: "ok  pkg  0.1s" and the like.
				lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
				fmt.Fprintln(w, lines[len(lines)-1])
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.Strings(s.unexpected)
	return s, nil
}
