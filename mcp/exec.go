package mcp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/sandbox"
)

// Exec's bounds: what the agent may ask for, and what it gets unless it
// asks.
const (
	defaultExecTimeout = 60 * time.Second
	maxExecTimeout     = time.Hour
	defaultExecOutput  = 64 << 10 // per stream
	maxExecOutput      = 1 << 20
	maxStdin           = 4 << 20
)

type execArgs struct {
	Name           string   `json:"name" jsonschema:"the sandbox's name"`
	Command        []string `json:"command,omitempty" jsonschema:"the process's argv, e.g. [\"ls\", \"-l\", \"/\"] (give this or shell)"`
	Shell          string   `json:"shell,omitempty" jsonschema:"a command line for /bin/sh -c, e.g. \"cd /src && make\" (give this or command)"`
	Stdin          string   `json:"stdin,omitempty" jsonschema:"text given to the process's standard input (default: none)"`
	Env            []string `json:"env,omitempty" jsonschema:"environment entries (KEY=VALUE) added to the sandbox's"`
	Workdir        string   `json:"workdir,omitempty" jsonschema:"the working directory (default: the image's, or /)"`
	User           string   `json:"user,omitempty" jsonschema:"run as USER, UID, USER:GROUP or UID:GID (default: root, or the image's user)"`
	TimeoutSeconds float64  `json:"timeout_seconds,omitempty" jsonschema:"kill the process after this long (default 60, at most 3600)"`
	MaxOutputBytes int      `json:"max_output_bytes,omitempty" jsonschema:"keep at most this many bytes of stdout, and of stderr (default 65536, at most 1048576); past it the rest is dropped and the stream marked truncated while the process runs on"`
}

type execResult struct {
	ExitCode        int    `json:"exit_code" jsonschema:"the process's exit code, or 128+N if signal N ended it"`
	Signal          string `json:"signal,omitempty" jsonschema:"the signal that ended it, if any"`
	TimedOut        bool   `json:"timed_out" jsonschema:"the timeout killed it"`
	Stdout          string `json:"stdout"`
	Stderr          string `json:"stderr"`
	StdoutTruncated bool   `json:"stdout_truncated,omitempty"`
	StderrTruncated bool   `json:"stderr_truncated,omitempty"`
}

// registerExecTools adds sandbox_exec.
func registerExecTools(s *sdk.Server, t *tools) {
	addTool(s, t, &sdk.Tool{Name: "sandbox_exec", Title: "Run a command in a sandbox",
		Description: "Run a process in a sandbox to its end and return its exit code and output (each stream capped). A non-zero exit is a result, not an error. Invalid UTF-8 in the output is replaced.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(true), OpenWorldHint: boolPtr(true)},
	}, t.exec)
}

func (t *tools) exec(ctx context.Context, a execArgs) (execResult, error) {
	if (len(a.Command) == 0) == (a.Shell == "") {
		return execResult{}, errors.New("give command (an argv) or shell (a command line), one of them")
	}
	timeout := defaultExecTimeout
	if a.TimeoutSeconds != 0 {
		if a.TimeoutSeconds < 0 || a.TimeoutSeconds > maxExecTimeout.Seconds() {
			return execResult{}, fmt.Errorf("timeout_seconds %v: want more than 0, at most %v", a.TimeoutSeconds, maxExecTimeout.Seconds())
		}
		timeout = time.Duration(a.TimeoutSeconds * float64(time.Second))
	}
	limit := defaultExecOutput
	if a.MaxOutputBytes != 0 {
		if a.MaxOutputBytes < 0 || a.MaxOutputBytes > maxExecOutput {
			return execResult{}, fmt.Errorf("max_output_bytes %d: want 1 to %d", a.MaxOutputBytes, maxExecOutput)
		}
		limit = a.MaxOutputBytes
	}
	if len(a.Stdin) > maxStdin {
		return execResult{}, fmt.Errorf("stdin: %d bytes: at most %d", len(a.Stdin), maxStdin)
	}
	for _, e := range a.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" {
			return execResult{}, fmt.Errorf("env %q: want KEY=VALUE", e)
		}
	}
	h, err := t.m.Open(ctx, a.Name)
	if err != nil {
		return execResult{}, err
	}
	stdout, stderr := &capped{max: limit}, &capped{max: limit}
	o := sandbox.ExecOptions{Argv: a.Command, Shell: a.Shell, Env: a.Env, Dir: a.Workdir, User: a.User,
		Timeout: timeout, Stdout: stdout, Stderr: stderr}
	if a.Stdin != "" {
		o.Stdin = strings.NewReader(a.Stdin)
	}
	p, err := h.Stream(ctx, o)
	if err != nil {
		return execResult{}, err
	}
	st, err := p.Wait()
	if err != nil {
		return execResult{}, err
	}
	return execResult{ExitCode: st.Code, Signal: st.Signal, TimedOut: st.TimedOut,
		Stdout: strings.ToValidUTF8(string(stdout.buf), "\uFFFD"), Stderr: strings.ToValidUTF8(string(stderr.buf), "\uFFFD"),
		StdoutTruncated: stdout.truncated, StderrTruncated: stderr.truncated}, nil
}

// capped keeps the first max bytes written to it and drops the rest,
// noting that it did; it never fails a write, so the process runs on.
type capped struct {
	buf       []byte
	max       int
	truncated bool
}

func (c *capped) Write(p []byte) (int, error) {
	n := min(len(p), c.max-len(c.buf))
	c.buf = append(c.buf, p[:n]...)
	if n < len(p) {
		c.truncated = true
	}
	return len(p), nil
}
