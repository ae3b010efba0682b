// Package statedir says where capsa keeps its state when nobody says
// otherwise: the detached sandboxes' records (package store), named
// volumes (package volume) and the hub's mailbox and key-value store
// (package hub). Its one function is Default.
package statedir

import (
	"fmt"
	"os"
	"path/filepath"
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
