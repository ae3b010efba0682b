//go:build !capsa_builtin

package builtin

import "io/fs"

// FS returns nil: this binary was built without the capsa_builtin tag.
func FS() fs.FS { return nil }
