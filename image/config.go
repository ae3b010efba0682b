package image

import (
	"errors"
	"strings"
)

// DefaultPath is the PATH a process gets when the image sets none
// (Docker's).
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Overrides are what the user says about the main process, over the
// image's config.
type Overrides struct {
	// Entrypoint replaces the image's ENTRYPOINT when set (an empty,
	// non-nil slice clears it); it also drops the image's CMD, as
	// Docker's --entrypoint does.
	Entrypoint []string
	// Args replace the image's CMD when non-empty.
	Args []string
	Env  []string // KEY=VALUE, over the image's ENV
	Dir  string   // over WORKDIR
	User string   // over USER
}

// Process is the resolved main process.
type Process struct {
	Argv []string
	Env  []string
	Dir  string
	User string // name, uid, name:group or uid:gid; "" is root
}

// ErrNoCommand is returned when neither the image nor the user gives a
// command.
var ErrNoCommand = errors.New("the image has no ENTRYPOINT or CMD; give a command")

// Resolve applies Docker's rules for the main process: argv is the
// entrypoint followed by the user's arguments, else the image's CMD; the
// environment is the image's, with the user's entries replacing those of
// the same name, and PATH defaulting to DefaultPath; the working
// directory and user are the user's, else the image's, else / and root.
func (img *Image) Resolve(o Overrides) (Process, error) {
	cfg := img.Config.Config
	entry, cmd := cfg.Entrypoint, cfg.Cmd
	if o.Entrypoint != nil {
		entry, cmd = o.Entrypoint, nil
	}
	if len(o.Args) > 0 {
		cmd = o.Args
	}
	p := Process{Argv: append(append([]string(nil), entry...), cmd...)}
	if len(p.Argv) == 0 {
		return Process{}, ErrNoCommand
	}
	p.Env = MergeEnv(cfg.Env, o.Env)
	if !hasKey(p.Env, "PATH") {
		p.Env = append([]string{"PATH=" + DefaultPath}, p.Env...)
	}
	p.Dir = firstOf(o.Dir, cfg.WorkingDir, "/")
	p.User = firstOf(o.User, cfg.User)
	return p, nil
}

// Env is the image's environment with PATH defaulted, for processes other
// than the main one.
func (img *Image) Env() []string {
	env := MergeEnv(img.Config.Config.Env, nil)
	if !hasKey(env, "PATH") {
		env = append([]string{"PATH=" + DefaultPath}, env...)
	}
	return env
}

// MergeEnv returns base with over's entries replacing base's of the same
// name, in base's order, then over's new names.
func MergeEnv(base, over []string) []string {
	idx := map[string]int{}
	var out []string
	for _, list := range [][]string{base, over} {
		for _, kv := range list {
			k, _, _ := strings.Cut(kv, "=")
			if i, ok := idx[k]; ok {
				out[i] = kv
				continue
			}
			idx[k] = len(out)
			out = append(out, kv)
		}
	}
	return out
}

func hasKey(env []string, key string) bool {
	for _, kv := range env {
		if k, _, _ := strings.Cut(kv, "="); k == key {
			return true
		}
	}
	return false
}

func firstOf(s ...string) string {
	for _, x := range s {
		if x != "" {
			return x
		}
	}
	return ""
}
