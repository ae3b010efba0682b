//go:build !capsa_builtin

package builtin

var kernel []byte
