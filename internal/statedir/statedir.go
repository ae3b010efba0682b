// Package statedir says where capsa keeps its state when nobody says
// otherwise: the detached sandboxes' records (package store), named
// volumes (package volume) and the hub's mailbox and key-value store
// (package hub). Default is the directory; ValidName is the rule for the
// names of what lives in it (sandboxes, snapshots, volumes), which name
// directories and appear in socket paths.
package statedir

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
)

// Default is $CAPSA_STATE, else $XDG_STATE_HOME/capsa, else
// ~/.local/state/capsa.
func Default() (string, error) {
	if d := os.Getenv("CAPSA_STATE"); d != "" {
		return d, nil
	}
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "capsa"), nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("no state directory: %w", err)
	}
	return filepath.Join(home, ".local", "state", "capsa"), nil
}

// NameRule says in words what ValidName accepts, for error messages.
const NameRule = "1 to 63 letters, digits, '_', '.' or '-', starting with a letter or digit"

var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$`)

// ValidName reports whether name may name a sandbox, a snapshot or a
// volume.
func ValidName(name string) bool { return nameRE.MatchString(name) }
