package proto

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/spf13/pflag"
)

// Exit codes of RunCLI besides 0.
const (
	ExitFailed  = 1   // the operation failed (not found, version mismatch, refused...)
	ExitUsage   = 2   // bad command line
	ExitTimeout = 124 // --timeout passed before --count was reached
)

// RunCLI is `capsa kv ...` and `capsa mailbox ...` (args starts with kv
// or mailbox), the same on the host and in a guest; stdin gives a value
// or payload written as "-".
func RunCLI(ctx context.Context, api API, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "kv" && args[0] != "mailbox") {
		fmt.Fprintln(stderr, "capsa: want kv or mailbox")
		return ExitUsage
	}
	group := args[0]
	verbs := kvVerbs
	if group == "mailbox" {
		verbs = mailboxVerbs
	}
	if len(args) < 2 || args[1] == "-h" || args[1] == "--help" {
		w := stderr
		if len(args) == 2 {
			w = stdout
		}
		fmt.Fprintf(w, "usage: capsa %s VERB ...\n\nverbs:\n", group)
		for _, v := range verbs {
			fmt.Fprintf(w, "  %s %s\n      %s\n", v.name, v.synopsis, v.summary)
		}
		if len(args) < 2 {
			return ExitUsage
		}
		return 0
	}
	for _, v := range verbs {
		if v.name != args[1] {
			continue
		}
		c := &cli{ctx: ctx, api: api, stdin: stdin, stdout: stdout, stderr: stderr, name: "capsa " + group + " " + v.name, synopsis: v.synopsis}
		c.fs = pflag.NewFlagSet(c.name, pflag.ContinueOnError)
		c.fs.SetOutput(io.Discard)
		c.fs.Usage = func() {
			fmt.Fprintf(stdout, "usage: %s %s\n%s\n\nflags:\n%s", c.name, v.synopsis, v.summary, c.fs.FlagUsages())
		}
		return v.run(c, args[2:])
	}
	fmt.Fprintf(stderr, "capsa %s: unknown verb %q (see `capsa %s --help`)\n", group, args[1], group)
	return ExitUsage
}

type verb struct {
	name, synopsis, summary string
	run                     func(c *cli, args []string) int
}

var kvVerbs = []verb{
	{"get", "[--with-version] KEY", "print a key's value (with --with-version: VERSION, a tab, the value)", kvGet},
	{"set", "KEY VALUE|-", "set a key (- reads the value from standard input); print its new version", kvSet},
	{"cas", "KEY VERSION VALUE|-", "set a key only if its version is VERSION (0: only if absent); print the new version, or fail with \"version mismatch\"", kvCAS},
	{"rm", "KEY", "delete a key", kvRm},
	{"ls", "[--format text|json] [PREFIX]", "list the keys with PREFIX: VERSION, a tab, KEY", kvLs},
	{"watch", "[--count N] [--timeout D] [PREFIX]", "print each change to a key with PREFIX as it happens: VERSION, KEY and the value (or \"deleted\"), tab-separated", kvWatch},
}

var mailboxVerbs = []verb{
	{"publish", "TOPIC MESSAGE|-", "publish a message (- reads it from standard input); print its offset", mbPublish},
	{"read", "[--from N] [--max N] [--format text|json] TOPIC", "print a topic's kept messages from offset N on, without waiting", mbRead},
	{"subscribe", "[--from N] [--count N] [--timeout D] [--format text|json] TOPIC", "print a topic's messages as they come (from offset N on with --from; else only new ones): OFFSET, SENDER, MESSAGE, tab-separated", mbSubscribe},
}

type cli struct {
	ctx            context.Context
	api            API
	stdin          io.Reader
	stdout, stderr io.Writer
	name, synopsis string
	fs             *pflag.FlagSet
}

// parse parses args and wants between min and max positional arguments;
// it returns -1 to go on, else the exit code.
func (c *cli) parse(args []string, min, max int) int {
	if err := c.fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(c.stderr, "%s: %v (see `%s --help`)\n", c.name, err, c.name)
		return ExitUsage
	}
	if n := c.fs.NArg(); n < min || n > max {
		fmt.Fprintf(c.stderr, "%s: want %s (see `%s --help`)\n", c.name, c.synopsis, c.name)
		return ExitUsage
	}
	return -1
}

func (c *cli) fail(err error) int {
	fmt.Fprintf(c.stderr, "%s: %v\n", c.name, err)
	return ExitFailed
}

func (c *cli) usage(format string, a ...any) int {
	fmt.Fprintf(c.stderr, c.name+": "+format+"\n", a...)
	return ExitUsage
}

// data is a value given on the command line, or "-" for standard input.
func (c *cli) data(arg string) ([]byte, error) {
	if arg != "-" {
		return []byte(arg), nil
	}
	b, err := io.ReadAll(io.LimitReader(c.stdin, MaxValue+1))
	if err != nil {
		return nil, fmt.Errorf("standard input: %w", err)
	}
	if len(b) > MaxValue {
		return nil, fmt.Errorf("%w: standard input holds more than %d bytes", ErrLimit, MaxValue)
	}
	return b, nil
}

func kvGet(c *cli, args []string) int {
	withVersion := c.fs.Bool("with-version", false, "print the version, a tab, then the value")
	if code := c.parse(args, 1, 1); code >= 0 {
		return code
	}
	e, err := c.api.Get(c.ctx, c.fs.Arg(0))
	if err != nil {
		return c.fail(err)
	}
	if *withVersion {
		fmt.Fprintf(c.stdout, "%d\t", e.Version)
	}
	fmt.Fprintf(c.stdout, "%s\n", e.Value)
	return 0
}

func kvSet(c *cli, args []string) int {
	if code := c.parse(args, 2, 2); code >= 0 {
		return code
	}
	v, err := c.data(c.fs.Arg(1))
	if err != nil {
		return c.fail(err)
	}
	ver, err := c.api.Set(c.ctx, c.fs.Arg(0), v)
	if err != nil {
		return c.fail(err)
	}
	fmt.Fprintln(c.stdout, ver)
	return 0
}

func kvCAS(c *cli, args []string) int {
	if code := c.parse(args, 3, 3); code >= 0 {
		return code
	}
	expected, err := strconv.ParseUint(c.fs.Arg(1), 10, 64)
	if err != nil {
		return c.usage("VERSION %q: want a number (0: the key must be absent)", c.fs.Arg(1))
	}
	v, err := c.data(c.fs.Arg(2))
	if err != nil {
		return c.fail(err)
	}
	ver, err := c.api.CAS(c.ctx, c.fs.Arg(0), expected, v)
	if err != nil {
		return c.fail(err)
	}
	fmt.Fprintln(c.stdout, ver)
	return 0
}

func kvRm(c *cli, args []string) int {
	if code := c.parse(args, 1, 1); code >= 0 {
		return code
	}
	if err := c.api.Delete(c.ctx, c.fs.Arg(0)); err != nil {
		return c.fail(err)
	}
	return 0
}

func (c *cli) formatFlag() *string {
	return c.fs.String("format", "text", "output format: text or json")
}

func (c *cli) checkFormat(f string) int {
	if f != "text" && f != "json" {
		return c.usage("--format %q: want text or json", f)
	}
	return -1
}

func kvLs(c *cli, args []string) int {
	format := c.formatFlag()
	if code := c.parse(args, 0, 1); code >= 0 {
		return code
	}
	if code := c.checkFormat(*format); code >= 0 {
		return code
	}
	es, truncated, err := c.api.List(c.ctx, c.fs.Arg(0))
	if err != nil {
		return c.fail(err)
	}
	if *format == "json" {
		out := struct {
			Entries   []Entry `json:"entries"`
			Truncated bool    `json:"truncated,omitempty"`
		}{es, truncated}
		json.NewEncoder(c.stdout).Encode(out)
		return 0
	}
	for _, e := range es {
		fmt.Fprintf(c.stdout, "%d\t%s\n", e.Version, e.Key)
	}
	if truncated {
		fmt.Fprintf(c.stderr, "%s: only the first %d keys are listed\n", c.name, len(es))
	}
	return 0
}

// follow runs a stream for --timeout, or until --count items came.
func (c *cli) follow(count int, timeout time.Duration, run func(ctx context.Context, each func() error) error) int {
	if count < 0 || timeout < 0 {
		return c.usage("--count and --timeout must not be negative")
	}
	ctx, cancel := c.ctx, context.CancelFunc(func() {})
	if timeout > 0 {
		ctx, cancel = context.WithTimeout(c.ctx, timeout)
	}
	defer cancel()
	errEnough := errors.New("enough")
	n := 0
	err := run(ctx, func() error {
		n++
		if count > 0 && n >= count {
			return errEnough
		}
		return nil
	})
	switch {
	case errors.Is(err, errEnough):
		return 0
	case ctx.Err() != nil && c.ctx.Err() == nil:
		if count > 0 {
			fmt.Fprintf(c.stderr, "%s: %d of %d within %v\n", c.name, n, count, timeout)
			return ExitTimeout
		}
		return 0
	case c.ctx.Err() != nil:
		return 0
	}
	return c.fail(err)
}

func kvWatch(c *cli, args []string) int {
	count := c.fs.Int("count", 0, "stop after this many changes (0: never)")
	timeout := c.fs.Duration("timeout", 0, "stop after this long (0: never); exit 124 if --count was not reached")
	if code := c.parse(args, 0, 1); code >= 0 {
		return code
	}
	return c.follow(*count, *timeout, func(ctx context.Context, each func() error) error {
		return c.api.Watch(ctx, c.fs.Arg(0), func(e Event) error {
			if e.Deleted {
				fmt.Fprintf(c.stdout, "%d\t%s\tdeleted\n", e.Version, e.Key)
			} else {
				fmt.Fprintf(c.stdout, "%d\t%s\t%s\n", e.Version, e.Key, e.Value)
			}
			return each()
		})
	})
}

func mbPublish(c *cli, args []string) int {
	if code := c.parse(args, 2, 2); code >= 0 {
		return code
	}
	p, err := c.data(c.fs.Arg(1))
	if err != nil {
		return c.fail(err)
	}
	m, err := c.api.Publish(c.ctx, c.fs.Arg(0), p)
	if err != nil {
		return c.fail(err)
	}
	fmt.Fprintln(c.stdout, m.Offset)
	return 0
}

func (c *cli) printMessage(m Message, format string) {
	if format == "json" {
		json.NewEncoder(c.stdout).Encode(m)
		return
	}
	fmt.Fprintf(c.stdout, "%d\t%s\t%s\n", m.Offset, m.Sender, m.Payload)
}

func mbRead(c *cli, args []string) int {
	from := c.fs.Int64("from", 0, "the first offset")
	max := c.fs.Int("max", 100, fmt.Sprintf("at most this many messages (up to %d)", MaxReadLen))
	format := c.formatFlag()
	if code := c.parse(args, 1, 1); code >= 0 {
		return code
	}
	if code := c.checkFormat(*format); code >= 0 {
		return code
	}
	ms, err := c.api.Read(c.ctx, c.fs.Arg(0), *from, *max)
	if err != nil {
		return c.fail(err)
	}
	for _, m := range ms {
		c.printMessage(m, *format)
	}
	return 0
}

func mbSubscribe(c *cli, args []string) int {
	from := c.fs.Int64("from", New, "start at this offset of the topic's log (its history); default: only new messages")
	count := c.fs.Int("count", 0, "stop after this many messages (0: never)")
	timeout := c.fs.Duration("timeout", 0, "stop after this long (0: never); exit 124 if --count was not reached")
	format := c.formatFlag()
	if code := c.parse(args, 1, 1); code >= 0 {
		return code
	}
	if code := c.checkFormat(*format); code >= 0 {
		return code
	}
	return c.follow(*count, *timeout, func(ctx context.Context, each func() error) error {
		return c.api.Subscribe(ctx, c.fs.Arg(0), *from, func(m Message) error {
			c.printMessage(m, *format)
			return each()
		})
	})
}
