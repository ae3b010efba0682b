package e2b

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httputil"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/supervisor"
)

// guest is what the server holds of a running sandbox it serves envd's
// API for: its handle, its access token, its users, and the processes
// started through the API.
type guest struct {
	name    string
	token   string
	traffic string            // the token its ports need ("": none, public)
	env     map[string]string // every process's, under its own (a restored sandbox's envVars)
	started time.Time
	h       *supervisor.Handle
	checked time.Time // when its record last said it runs (under Server.mu)

	mu      sync.Mutex
	users   map[string]guestUser // the guest's /etc/passwd, by name
	usersAt time.Time
	shell   string          // the shell commands run with ("": not looked up)
	homes   map[string]bool // whether each user's home exists, as first looked up
	procs   map[uint32]*proc
	proxy   *httputil.ReverseProxy // to its ports, made on first use
}

// guestUser is a user of the guest's /etc/passwd.
type guestUser struct {
	name     string
	uid, gid int
	home     string
}

// errNoToken marks a sandbox that has no access token yet (one not made
// through the API, never connected to).
var errNoToken = errors.New("it has no envd access token")

// recheck is how long a guest's record is trusted to say it runs.
const recheck = 2 * time.Second

// guest returns the running sandbox id's guest, for its envd API.
func (s *Server) guest(ctx context.Context, id string) (*guest, error) {
	if err := supervisor.CheckName(id); err != nil {
		return nil, fmt.Errorf("%w: %v", supervisor.ErrNotFound, err)
	}
	s.mu.Lock()
	g := s.guests[id]
	if g != nil && time.Since(g.checked) < recheck {
		s.mu.Unlock()
		return g, nil
	}
	s.mu.Unlock()
	rec, err := s.m.Get(id)
	if err != nil {
		s.forget(id)
		return nil, err
	}
	// One paused without its memory is not: it boots again, and
	// only connect does that.
	if paused(rec) && rec.Labels[labelAutoResume] != "" && rec.Labels[labelResume] != "reboot" {
		// Traffic wakes a sandbox made with autoResume, for the
		// timeout it was made with: one request resumes it, those
		// that come meanwhile wait for that.
		s.resumeMu.Lock()
		rec, err = s.m.Get(id)
		if err == nil && paused(rec) {
			timeout, _ := strconv.Atoi(rec.Labels[labelTimeout])
			if err = s.resume(ctx, rec, cmp.Or(timeout, defaultTimeout), false); err == nil {
				rec, err = s.m.Get(id)
			}
		}
		s.resumeMu.Unlock()
		if err != nil {
			return nil, err
		}
	}
	if rec.State != supervisor.Running {
		s.forget(id)
		return nil, fmt.Errorf("sandbox %s is %s, not running", id, rec.State)
	}
	token := rec.Labels[labelToken]
	if token == "" {
		return nil, fmt.Errorf("sandbox %s: %w: connect to it first (POST /sandboxes/%s/connect)", id, errNoToken, id)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if g = s.guests[id]; g != nil && g.started.Equal(rec.Started) && g.token == token {
		g.checked = time.Now()
		return g, nil
	}
	h, err := s.m.Open(ctx, id)
	if err != nil {
		return nil, err
	}
	g = &guest{name: id, token: token, traffic: rec.Labels[labelTraffic], started: rec.Started, h: h, checked: time.Now(), procs: map[uint32]*proc{}}
	if e := rec.Labels[labelEnv]; e != "" {
		json.Unmarshal([]byte(e), &g.env)
	}
	s.guests[id] = g
	return g, nil
}

// forget drops what the server holds of the sandbox id (it ended, or was
// killed through the API).
func (s *Server) forget(id string) {
	s.mu.Lock()
	g := s.guests[id]
	delete(s.guests, id)
	s.mu.Unlock()
	if g != nil {
		g.closeProcs()
	}
}

// maxPasswd bounds the guest's /etc/passwd as read here.
const maxPasswd = 1 << 20

// user returns the guest user name ("": the sandbox's default user: E2B's
// "user" where the guest has it, else root).
func (g *guest) user(ctx context.Context, name string) (guestUser, error) {
	g.mu.Lock()
	fresh := g.users != nil && time.Since(g.usersAt) < 10*time.Second
	g.mu.Unlock()
	if !fresh {
		b, err := g.h.ReadFile(ctx, "/etc/passwd")
		users := map[string]guestUser{}
		if err == nil && len(b) <= maxPasswd {
			users = parsePasswd(string(b))
		}
		g.mu.Lock()
		g.users, g.usersAt = users, time.Now()
		g.mu.Unlock()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if name == "" {
		if u, ok := g.users["user"]; ok {
			return u, nil
		}
		if u, ok := g.users["root"]; ok {
			return u, nil
		}
		return guestUser{name: "root", home: "/root"}, nil
	}
	u, ok := g.users[name]
	if !ok {
		if name == "root" {
			return guestUser{name: "root", home: "/root"}, nil
		}
		return guestUser{}, fmt.Errorf("user %q: not in the sandbox's /etc/passwd", name)
	}
	return u, nil
}

// parsePasswd reads passwd(5) lines.
func parsePasswd(s string) map[string]guestUser {
	users := map[string]guestUser{}
	for line := range strings.SplitSeq(s, "\n") {
		f := strings.Split(line, ":")
		if len(f) < 7 || f[0] == "" {
			continue
		}
		uid, err1 := strconv.Atoi(f[2])
		gid, err2 := strconv.Atoi(f[3])
		if err1 != nil || err2 != nil || uid < 0 || gid < 0 {
			continue
		}
		if _, dup := users[f[0]]; !dup {
			users[f[0]] = guestUser{name: f[0], uid: uid, gid: gid, home: f[5]}
		}
	}
	return users
}

// resolve makes p absolute: a relative path is the user's home's.
func (u guestUser) resolve(p string) string {
	if p == "" {
		return u.homeDir()
	}
	if !path.IsAbs(p) {
		p = path.Join(u.homeDir(), p)
	}
	return path.Clean(p)
}

// execUser is the user the agent runs a process as: root as the agent's
// own user (a guest without /etc/passwd has root too), anyone else by
// name.
func (u guestUser) execUser() string {
	if u.uid == 0 {
		return ""
	}
	return u.name
}

// homeDir is the user's home, or / without one.
func (u guestUser) homeDir() string {
	if u.home == "" || !path.IsAbs(u.home) {
		return "/"
	}
	return u.home
}

// commandShell returns the program E2B's SDKs' commands should run in
// place of /bin/bash: bash where the guest has it, else /bin/sh (said
// once in the log).
func (s *Server) commandShell(ctx context.Context, g *guest) string {
	g.mu.Lock()
	sh := g.shell
	g.mu.Unlock()
	if sh != "" {
		return sh
	}
	sh = "/bin/bash"
	if ok, err := g.h.Exists(ctx, "/bin/bash"); err == nil && !ok {
		sh = "/bin/sh"
		s.log.Info("e2b: the sandbox has no /bin/bash: the SDK's commands run with /bin/sh", "sandbox", g.name)
	}
	g.mu.Lock()
	g.shell = sh
	g.mu.Unlock()
	return sh
}

// homeExists reports whether the directory home exists in the guest,
// looked up once (a command's default directory, on every start).
func (g *guest) homeExists(ctx context.Context, home string) bool {
	g.mu.Lock()
	ok, known := g.homes[home]
	g.mu.Unlock()
	if known {
		return ok
	}
	ok, err := g.h.Exists(ctx, home)
	if err != nil {
		return false
	}
	g.mu.Lock()
	if g.homes == nil {
		g.homes = map[string]bool{}
	}
	if len(g.homes) < 64 {
		g.homes[home] = ok
	}
	g.mu.Unlock()
	return ok
}

// basicUser is the user an Authorization: Basic header names ("": none).
func basicUser(header string) (string, error) {
	if header == "" {
		return "", nil
	}
	scheme, cred, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Basic") {
		return "", errors.New("authorization: want Basic")
	}
	b, err := decodeBase64(strings.TrimSpace(cred))
	if err != nil {
		return "", fmt.Errorf("authorization: %v", err)
	}
	user, _, _ := strings.Cut(string(b), ":")
	if len(user) > 64 {
		return "", errors.New("authorization: user name too long")
	}
	return user, nil
}
