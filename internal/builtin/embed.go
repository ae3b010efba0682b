//go:build capsa_builtin

package builtin

import (
	"embed"
	"io/fs"
)

//go:embed assets
var files embed.FS

// FS returns the built-in asset set.
func FS() fs.FS {
	sub, err := fs.Sub(files, "assets")
	if err != nil {
		panic(err) // "assets" is a valid path: fs.Sub cannot fail
	}
	return sub
}
