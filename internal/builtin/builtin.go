// Package builtin holds the guest kernel and the initramfs (u-root and the
// capsa agent) built into the capsa binary. `make capsa` copies them here and builds with the
// capsa_builtin tag; a plain `go build` or `go test` has none, so the tests
// and tools that do not boot a guest never need a kernel built first.
package builtin

import "errors"

// ErrNoKernel is returned by Kernel in a binary built without one.
var ErrNoKernel = errors.New("this capsa binary has no built-in kernel (build it with `make capsa`, or pass --kernel)")

// ErrNoInitramfs is returned by Initramfs in a binary built without one.
var ErrNoInitramfs = errors.New("this capsa binary has no built-in initramfs (build it with `make capsa`, or pass --initrd)")

// Initramfs returns the built-in guest initramfs (an uncompressed cpio).
func Initramfs() ([]byte, error) {
	if len(initramfs) == 0 {
		return nil, ErrNoInitramfs
	}
	return initramfs, nil
}

// Kernel returns the built-in guest kernel image (an uncompressed vmlinux).
func Kernel() ([]byte, error) {
	if len(kernel) == 0 {
		return nil, ErrNoKernel
	}
	return kernel, nil
}
