//go:build !capsa_builtin

package builtin

var kernel, initramfs []byte
