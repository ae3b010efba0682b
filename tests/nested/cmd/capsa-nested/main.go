// Command capsa-nested runs a command on a machine with KVM: directly where
// /dev/kvm exists, else inside the nested L1 host (see package nested).
//
//	capsa-nested [-f SRC[:DST]]... [-e K=V]... [--timeout D] -- CMD [ARGS...]
//
// It streams the command's output and exits with its exit status.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/capsa-sandbox/capsa/tests/nested"
)

func main() {
	os.Exit(run())
}

func run() int {
	fs := pflag.NewFlagSet("capsa-nested", pflag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: capsa-nested [flags] -- CMD [ARGS...]\n\nRuns CMD where /dev/kvm works: here if it exists, else in a nested L1 guest under QEMU.\n\n%s", fs.FlagUsages())
	}
	files := fs.StringArrayP("file", "f", nil, "make host file SRC available as DST (default: its base name) in the working directory")
	env := fs.StringArrayP("env", "e", nil, "set K=V in the command's environment")
	timeout := fs.Duration("timeout", 60*time.Minute, "stop the job after this long")
	mem := fs.Int("memory", 4096, "L1 guest memory in MiB")
	cpus := fs.Int("cpus", 2, "L1 guest vCPUs")
	force := fs.Bool("force-nested", false, "use the L1 guest even where /dev/kvm exists")
	verbose := fs.BoolP("verbose", "v", false, "log progress to stderr")
	kargs := fs.String("l1-append", "", "add these to L1's kernel command line")
	accel := fs.String("l1-accel", "", "QEMU's -accel for L1 (default tcg,thread=multi)")
	retries := fs.Int("l1-retries", 2, "run the job again this many times if the L1 kernel crashes (QEMU TCG's emulated SVM)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if err == pflag.ErrHelp {
			return 0
		}
		fmt.Fprintf(os.Stderr, "capsa-nested: %v\n", err)
		return 2
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "capsa-nested: no command given (usage: capsa-nested [flags] -- CMD [ARGS...])")
		return 2
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	h := &nested.Host{
		Log:         slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})),
		MemoryMB:    *mem,
		CPUs:        *cpus,
		ForceNested: *force,
		L1Retries:   *retries,
		KernelArgs:  *kargs,
		Accel:       *accel,
	}
	job := nested.Job{Argv: fs.Args(), Env: *env, Output: os.Stdout}
	for _, f := range *files {
		src, dst, ok := strings.Cut(f, ":")
		if !ok {
			dst = filepath.Base(src)
		}
		job.Files = append(job.Files, nested.File{Src: src, Dst: dst})
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	res, err := h.Run(ctx, job)
	if err != nil {
		fmt.Fprintf(os.Stderr, "capsa-nested: %v\n", err)
		return 125
	}
	where := "directly (/dev/kvm present)"
	if res.Nested {
		where = fmt.Sprintf("in the nested L1 host (KVM ready after %.1fs)", res.Ready.Seconds())
	}
	fmt.Fprintf(os.Stderr, "capsa-nested: %s exited %d after %.1fs, %s\n", fs.Arg(0), res.ExitCode, res.Total.Seconds(), where)
	return res.ExitCode
}
