// Package builtin holds the guest kernel and initramfs built into the capsa
// binary: the asset set of package assets (manifest.json, vmlinux.zst,
// initramfs.cpio.zst) that `make capsa` packs into build/assets, copies
// here as assets/ and embeds with the capsa_builtin tag. A plain `go
// build` or `go test` has none, so the tests and tools that do not boot a
// guest never need a kernel built first, and package assets then looks
// for an installed set instead.
package builtin
