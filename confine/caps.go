package confine

import (
	"fmt"
	"slices"
	"strings"

	"kernel.org/pub/linux/libs/security/libcap/cap"
)

// A VMM run by root (a jail without a User, or a containerd pod's, which
// has no jail) that serves host files it did not make (Config.HostFiles:
// shares, volumes, disks, files copied in) keeps only the capabilities a
// file server needs to serve other users' files: reading, writing and
// searching them whatever their modes, setting their modes and times (as
// their owner may), and keeping their set-group-ID bits when it writes.
// One that serves none keeps none: every file it uses after confinement
// is its own, or was opened before, or is lent to it (a layer's parent
// that another user's sandbox wrote: snapshot.OpenLent). Either gives up
// the rest for good, from its bounding set too: mounting,
// namespaces, chown, setuid, raw sockets, network administration, module
// loading, ptrace, kill, device nodes. Its uid stays 0, so files it makes
// stay root's, as before. A process that is not root, or that dropped to
// a jail's User, holds none to begin with.
//
// On libcap's cap package: capabilities are per thread, and a Go process
// has many, so every change must reach all of them at once, which the
// package does (through psx) whether or not the binary uses cgo.
var KeptCapabilities = []cap.Value{cap.DAC_OVERRIDE, cap.DAC_READ_SEARCH, cap.FOWNER, cap.FSETID}

// dropCapabilities leaves the process only the KeptCapabilities it holds
// with files, none otherwise, and removes every other one from its
// bounding and ambient sets. It reports what it kept.
func dropCapabilities(files bool) (string, error) {
	cur := cap.GetProc()
	var keep, held []cap.Value
	if files {
		keep = KeptCapabilities
	}
	var names []string
	for _, v := range keep {
		if ok, err := cur.GetFlag(cap.Permitted, v); err != nil {
			return "", fmt.Errorf("confine: capabilities: %w", err)
		} else if ok {
			held = append(held, v)
			names = append(names, v.String())
		}
	}
	// The bounding set can shrink only with SETPCAP, which a process that
	// is not root does not hold (nor, then, any other to lose).
	if ok, err := cur.GetFlag(cap.Effective, cap.SETPCAP); err != nil {
		return "", fmt.Errorf("confine: capabilities: %w", err)
	} else if ok {
		var drop []cap.Value
		for v := range cap.MaxBits() {
			if !slices.Contains(keep, v) {
				drop = append(drop, v)
			}
		}
		if err := cap.DropBound(drop...); err != nil {
			return "", fmt.Errorf("confine: capabilities: drop from the bounding set: %w", err)
		}
	}
	if err := cap.ResetAmbient(); err != nil {
		return "", fmt.Errorf("confine: capabilities: clear the ambient set: %w", err)
	}
	set := cap.NewSet()
	for _, f := range []cap.Flag{cap.Permitted, cap.Effective} {
		if err := set.SetFlag(f, true, held...); err != nil {
			return "", fmt.Errorf("confine: capabilities: %w", err)
		}
	}
	if err := set.SetProc(); err != nil {
		return "", fmt.Errorf("confine: capabilities: set %s: %w", set, err)
	}
	if len(names) == 0 {
		return "none held", nil
	}
	return "kept " + strings.Join(names, ","), nil
}
