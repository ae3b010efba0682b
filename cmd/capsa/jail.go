package main

// capsa run as root, in the foreground: the VMM runs in the CLI's own
// process, which must have been started in a mount namespace of its own
// to be jailed (package confine). So, once its flags are checked, capsa
// run starts itself again in one and waits for it.

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"github.com/capsa-sandbox/capsa/confine"
)

// jailEnv marks the capsa run started in its own mount namespace. Its
// value is the temporary directory (its TMPDIR) the parent made for it and
// removes after it: the jailed child can empty what it makes there (an
// image's writable layer), not remove it.
const jailEnv = "CAPSA_JAIL_TMP"

// runInJail runs `capsa run args` again in a new mount namespace, with
// the same standard streams and terminal, and returns its exit code
// (128+N for a signal N). Meanwhile it passes on SIGTERM and SIGHUP and
// lets the terminal's SIGINT reach the child alone.
func runInJail(args []string, user *confine.User, stdout, stderr io.Writer) int {
	tmp, err := os.MkdirTemp("", "capsa-run-")
	if err != nil {
		fmt.Fprintf(stderr, "capsa run: %v\n", err)
		return 125
	}
	defer os.RemoveAll(tmp)
	if user != nil {
		if err := os.Chown(tmp, user.UID, user.GID); err != nil {
			fmt.Fprintf(stderr, "capsa run: %v\n", err)
			return 125
		}
	}
	cmd := exec.Command("/proc/self/exe", append([]string{"run"}, args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
	cmd.Env = append(os.Environ(), jailEnv+"="+tmp, "TMPDIR="+tmp)
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(stderr, "capsa run: start in a mount namespace of its own: %v\n", err)
		return 125
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-sigs:
				if s != syscall.SIGINT {
					cmd.Process.Signal(s)
				}
			case <-done:
				return
			}
		}
	}()
	err = cmd.Wait()
	close(done)
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit):
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return exit.ExitCode()
	}
	fmt.Fprintf(stderr, "capsa run: %v\n", err)
	return 125
}
