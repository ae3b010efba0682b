package statedir

import (
	"path/filepath"
	"strings"
	"testing"
)

func TestDefault(t *testing.T) {
	t.Setenv("CAPSA_STATE", "/x/state")
	t.Setenv("XDG_STATE_HOME", "/xdg")
	if got, err := Default(); err != nil || got != "/x/state" {
		t.Errorf("Default() with $CAPSA_STATE = %q, %v; want /x/state", got, err)
	}
	t.Setenv("CAPSA_STATE", "")
	if got, err := Default(); err != nil || got != "/xdg/capsa" {
		t.Errorf("Default() with $XDG_STATE_HOME = %q, %v; want /xdg/capsa", got, err)
	}
	t.Setenv("XDG_STATE_HOME", "")
	t.Setenv("HOME", "/home/u")
	if got, err := Default(); err != nil || got != filepath.Join("/home/u", ".local/state/capsa") {
		t.Errorf("Default() with $HOME = %q, %v; want /home/u/.local/state/capsa", got, err)
	}
}

func TestValidName(t *testing.T) {
	for _, n := range []string{"a", "shared", "A-1.b_c", strings.Repeat("x", 63)} {
		if !ValidName(n) {
			t.Errorf("ValidName(%q) = false, want true", n)
		}
	}
	for _, n := range []string{"", ".", "..", "-a", "_a", "a/b", "a b", strings.Repeat("x", 64), "a\x00"} {
		if ValidName(n) {
			t.Errorf("ValidName(%q) = true, want false", n)
		}
	}
}
