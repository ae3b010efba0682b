//go:build capsa_builtin

package builtin

import _ "embed"

//go:embed vmlinux
var kernel []byte

//go:embed initramfs.cpio
var initramfs []byte
