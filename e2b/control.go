package e2b

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// Bounds on a create request.
const (
	maxTimeout     = 30 * 24 * 3600 // seconds
	maxMetadata    = 64
	maxMetaKey     = 128
	maxMetaValue   = 1024
	maxEnvVars     = 256
	maxRules       = 256
	maxTemplateID  = 512
	defaultTimeout = 300 // seconds, /v2's (the first API's is 15)
	maxListLimit   = 1000
)

// keepAlive is an API sandbox's main process: the sandbox runs until its
// timeout or a kill (2^31-1 seconds, a number every sleep takes).
var keepAlive = []string{"sleep", "2147483647"}

// controlMux serves the control API; every route needs an API key.
func (s *Server) controlMux() http.Handler {
	mux := http.NewServeMux()
	handle := func(pattern string, h func(w http.ResponseWriter, r *http.Request, key Key)) {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			key, ok := s.keys.Check(r.Header.Get("X-API-KEY"))
			if !ok {
				apiError(w, http.StatusUnauthorized, "missing or unknown API key (X-API-KEY; capsa serve key create makes one)")
				return
			}
			r.Body = http.MaxBytesReader(w, r.Body, maxBody)
			h(w, r, key)
		})
	}
	handle("POST /sandboxes", func(w http.ResponseWriter, r *http.Request, key Key) { s.create(w, r, key, 15) })
	handle("POST /v2/sandboxes", func(w http.ResponseWriter, r *http.Request, key Key) { s.create(w, r, key, defaultTimeout) })
	handle("GET /sandboxes", func(w http.ResponseWriter, r *http.Request, key Key) { s.list(w, r, key, false) })
	handle("GET /v2/sandboxes", func(w http.ResponseWriter, r *http.Request, key Key) { s.list(w, r, key, true) })
	handle("GET /sandboxes/{id}", s.info)
	handle("DELETE /sandboxes/{id}", s.kill)
	handle("POST /sandboxes/{id}/timeout", s.setTimeout)
	handle("POST /sandboxes/{id}/connect", s.connect)
	handle("POST /v2/sandboxes/{id}/connect", s.connect)
	handle("POST /sandboxes/{id}/resume", s.connect)
	handle("POST /sandboxes/{id}/pause", s.pause)
	handle("PUT /sandboxes/{id}/network", s.updateNetwork)
	handle("GET /sandboxes/{id}/metrics", s.metrics)
	handle("POST /sandboxes/{id}/fork", s.fork)
	handle("POST /sandboxes/{id}/snapshots", s.createSnapshot)
	handle("GET /snapshots", s.listSnapshots)
	handle("DELETE /templates/{id}", s.deleteSnapshot)
	handle("POST /volumes", s.createVolume)
	handle("GET /volumes", s.listVolumes)
	handle("GET /volumes/{volumeID}", s.getVolume)
	handle("DELETE /volumes/{volumeID}", s.deleteVolume)
	s.volumeContentRoutes(mux)
	handle("/", func(w http.ResponseWriter, r *http.Request, _ Key) {
		apiError(w, http.StatusNotImplemented, fmt.Sprintf("%s %s: capsa serve does not serve this E2B API route", r.Method, r.URL.Path))
	})
	return mux
}

// newSandbox is a create request (NewSandbox, NewSandboxV2).
type newSandbox struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int              `json:"timeout"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkConfig    `json:"network"`
	AutoPause           bool              `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume"`
	Secure       *bool           `json:"secure"`
	MCP          json.RawMessage `json:"mcp"`
	VolumeMounts json.RawMessage `json:"volumeMounts"`
}

// networkConfig is a sandbox's egress rules (SandboxNetworkConfig).
type networkConfig struct {
	AllowOut []string `json:"allowOut"`
	DenyOut  []string `json:"denyOut"`
	// AllowPublicTraffic false: the sandbox's ports (getHost) need its
	// traffic access token.
	AllowPublicTraffic *bool `json:"allowPublicTraffic"`
	// Rules are headers set on the sandbox's HTTPS requests to a host
	// (SandboxNetworkRule, by host pattern).
	Rules map[string][]networkRule `json:"rules"`
	// EgressProxy tunnels the sandbox's outbound TCP through a SOCKS5
	// proxy (SandboxEgressProxyConfig).
	EgressProxy *egressProxyConfig `json:"egressProxy"`
}

// egressProxyConfig is a SOCKS5 proxy (SandboxEgressProxyConfig): the
// API never gives the password back (egressProxyInfo).
type egressProxyConfig struct {
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// egressProxyInfo is the proxy as the API gives it
// (SandboxEgressProxyInfo).
type egressProxyInfo struct {
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
}

// egressProxy checks an egress proxy of a request, as E2B does before a
// sandbox exists: its form, and unless the server allows private proxies
// (Options.PrivateEgressProxy), that its address resolves now to public
// ones only (it must at every dial too); nil for none.
func (s *Server) egressProxy(ctx context.Context, c *egressProxyConfig) (*sandbox.EgressProxy, error) {
	if c == nil {
		return nil, nil
	}
	p := &sandbox.EgressProxy{Address: c.Address, Username: c.Username, Password: c.Password, PublicOnly: !s.privateProxy}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := sandbox.CheckEgressProxy(ctx, *p); err != nil {
		msg := err.Error()
		if p.PublicOnly && errors.Is(err, sandbox.ErrNonPublicProxy) {
			msg += " (capsa serve --private-egress-proxy allows one)"
		}
		return nil, fmt.Errorf("egressProxy: %s", msg)
	}
	return p, nil
}

// networkRule is one of a host's rules (SandboxNetworkRule).
type networkRule struct {
	Transform *networkTransform `json:"transform,omitempty"`
}

// networkTransform is what a rule does to a request
// (SandboxNetworkTransform): headers set, replacing the guest's.
type networkTransform struct {
	Headers map[string]string `json:"headers,omitempty"`
}

// maxRulesPerHost bounds the rules one host pattern lists.
const maxRulesPerHost = 32

// headerRules turns E2B's rules into capsa's header rules: a host's rules
// applied in order into one (a later header of a name replaces an
// earlier), hosts lower-cased, one that sets nothing left out.
func headerRules(in map[string][]networkRule) ([]sandbox.HeaderRule, error) {
	hosts := slices.Sorted(maps.Keys(in))
	var out []sandbox.HeaderRule
	for _, h := range hosts {
		rules := in[h]
		if len(rules) > maxRulesPerHost {
			return nil, fmt.Errorf("network.rules[%q]: %d rules, at most %d", h, len(rules), maxRulesPerHost)
		}
		set := map[string]string{}
		for _, r := range rules {
			if r.Transform == nil {
				continue
			}
			for k, v := range r.Transform.Headers {
				set[http.CanonicalHeaderKey(k)] = v
			}
		}
		if err := sandbox.CheckHostPattern(h); err != nil {
			return nil, fmt.Errorf("network.rules: %w", err)
		}
		if len(set) == 0 {
			continue
		}
		out = append(out, sandbox.HeaderRule{Host: h, Headers: set})
	}
	if err := sandbox.CheckHeaderRules(out); err != nil {
		return nil, fmt.Errorf("network.rules: %w", err)
	}
	return out, nil
}

// e2bRules is the inverse of headerRules, for getInfo.
func e2bRules(rules []sandbox.HeaderRule) map[string][]networkRule {
	if len(rules) == 0 {
		return nil
	}
	out := map[string][]networkRule{}
	for _, r := range rules {
		out[r.Host] = []networkRule{{Transform: &networkTransform{Headers: r.Headers}}}
	}
	return out
}

// sandboxInfo is what the API says of a sandbox (Sandbox, SandboxDetail,
// ListedSandbox: one shape with the fields of all three).
type sandboxInfo struct {
	SandboxID       string            `json:"sandboxID"`
	TemplateID      string            `json:"templateID"`
	ClientID        string            `json:"clientID"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken string            `json:"envdAccessToken,omitempty"`
	TrafficToken    string            `json:"trafficAccessToken,omitempty"`
	Domain          *string           `json:"domain"`
	StartedAt       *time.Time        `json:"startedAt,omitempty"`
	EndAt           *time.Time        `json:"endAt,omitempty"`
	State           string            `json:"state,omitempty"`
	CPUCount        int               `json:"cpuCount,omitempty"`
	MemoryMB        int               `json:"memoryMB,omitempty"`
	DiskSizeMB      int               `json:"diskSizeMB"`
	Metadata        map[string]string `json:"metadata,omitempty"`
	Lifecycle       *lifecycle        `json:"lifecycle,omitempty"`
	VolumeMounts    []volumeMount     `json:"volumeMounts,omitempty"`
	Network         *networkInfo      `json:"network,omitempty"`
	AllowInternet   *bool             `json:"allowInternetAccess,omitempty"`
}

// networkInfo is a sandbox's egress rules as the API gives them
// (SandboxNetworkInfo).
type networkInfo struct {
	AllowOut           []string                 `json:"allowOut,omitempty"`
	DenyOut            []string                 `json:"denyOut,omitempty"`
	AllowPublicTraffic bool                     `json:"allowPublicTraffic"`
	Rules              map[string][]networkRule `json:"rules,omitempty"`
	EgressProxy        *egressProxyInfo         `json:"egressProxy,omitempty"`
}

// networkOf says the egress rules of the sandbox of spec as E2B writes
// them (egressPolicy's inverse); nil without capsa's NAT.
func networkOf(spec sandbox.Spec, labels map[string]string) *networkInfo {
	n := spec.Network
	if n == nil || n.Policy == nil {
		return nil
	}
	allow, deny := n.Policy.Rules()
	in := &networkInfo{AllowOut: allow, DenyOut: deny, AllowPublicTraffic: labels[labelTraffic] == ""}
	if p := n.EgressProxy; p != nil {
		in.EgressProxy = &egressProxyInfo{Address: p.Address, Username: p.Username}
	}
	if n.Policy.Mode() == netstack.ModeDenyAll {
		in.DenyOut = append(in.DenyOut, "0.0.0.0/0")
	}
	return in
}

// lifecycle is what happens to a sandbox at its timeout.
type lifecycle struct {
	OnTimeout  string `json:"onTimeout"` // kill or pause
	AutoResume bool   `json:"autoResume"`
}

// clientID is what the API calls the machine a sandbox runs on.
const clientID = "capsa"

// describe says what the API says of rec; with token, its access token.
func (s *Server) describe(rec *supervisor.Record, token bool) sandboxInfo {
	in := sandboxInfo{SandboxID: rec.Name, TemplateID: templateOf(rec), ClientID: clientID,
		EnvdVersion: EnvdVersion, CPUCount: rec.Spec.CPUs, MemoryMB: rec.Spec.MemoryMiB}
	if s.domain != "" {
		d := s.domain
		in.Domain = &d
	}
	if token {
		in.EnvdAccessToken = rec.Labels[labelToken]
		in.TrafficToken = rec.Labels[labelTraffic]
	}
	if !rec.Started.IsZero() {
		started := rec.Started.UTC()
		in.StartedAt = &started
		end := started.Add(rec.TTL)
		if rec.TTL == 0 {
			end = started.Add(maxTimeout * time.Second)
		}
		in.EndAt = &end
	}
	in.State = "running"
	if paused(rec) {
		in.State = "paused"
	}
	in.VolumeMounts = s.mountsOf(rec.Spec)
	in.Network = networkOf(rec.Spec, rec.Labels)
	if in.Network != nil && len(rec.Spec.Network.Headers) > 0 {
		// Shown to whoever may see the sandbox, who set them.
		if rules, err := s.m.HeaderRules(rec.Name); err == nil {
			in.Network.Rules = e2bRules(rules)
		}
	}
	// Internet access: a NIC whose rules let something out.
	internet := in.Network != nil && !(slices.Contains(in.Network.DenyOut, "0.0.0.0/0") && len(in.Network.AllowOut) == 0)
	in.AllowInternet = &internet
	in.Lifecycle = &lifecycle{OnTimeout: "kill"}
	if rec.PauseAtTTL {
		in.Lifecycle = &lifecycle{OnTimeout: "pause", AutoResume: rec.Labels[labelAutoResume] != ""}
	}
	for k, v := range rec.Labels {
		if name, ok := strings.CutPrefix(k, labelMeta); ok {
			if in.Metadata == nil {
				in.Metadata = map[string]string{}
			}
			in.Metadata[name] = v
		}
	}
	return in
}

// templateOf is the templateID the sandbox rec was made from: the API's,
// or for one the CLI made, its image or "capsa".
func templateOf(rec *supervisor.Record) string {
	switch {
	case rec.Labels[labelTemplate] != "":
		return rec.Labels[labelTemplate]
	case rec.Spec.Image != nil:
		return rec.Spec.Image.Ref
	}
	return "capsa"
}

// create makes a sandbox: it answers once the sandbox runs.
func (s *Server) create(w http.ResponseWriter, r *http.Request, key Key, defTimeout int) {
	var req newSandbox
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		apiError(w, http.StatusBadRequest, fmt.Sprintf("create: the body: %v", err))
		return
	}
	wl, tmpl, err := s.buildSandbox(r.Context(), &req, key)
	if err != nil {
		apiError(w, http.StatusBadRequest, "create: "+err.Error())
		return
	}
	timeout, err := timeoutOr("create", req.Timeout, defTimeout)
	if err != nil {
		apiError(w, http.StatusBadRequest, err.Error())
		return
	}
	spec, err := wl.Spec()
	if err != nil {
		apiError(w, http.StatusBadRequest, "create: "+err.Error())
		return
	}
	labels := map[string]string{labelToken: newToken(), labelTemplate: req.TemplateID, labelKey: key.ID}
	for k, v := range req.Metadata {
		labels[labelMeta+k] = v
	}
	if n := req.Network; n != nil && n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic {
		labels[labelTraffic] = newToken()
	}
	if req.AutoResume != nil && req.AutoResume.Enabled {
		labels[labelAutoResume] = "1"
	}
	if req.AutoPause && req.AutoPauseMemory != nil && !*req.AutoPauseMemory {
		if spec.Image == nil {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("create: autoPauseMemory: false: template %q is capsa's built-in Linux, with no disk of its own to boot again from; use an image template", req.TemplateID))
			return
		}
		labels[labelAutoReboot], labels[labelResume] = "1", "reboot"
	}
	labels[labelTimeout] = strconv.Itoa(timeout)
	id := "i" + newID(19)
	rec := &supervisor.Record{Name: id, Spec: spec, Labels: labels}
	// A pre-booted template, or a templateID that names a snapshot of
	// this server's state directory, starts from the snapshot, with the
	// request's host-facing settings (its network), never the
	// snapshot's own.
	// A sandbox that mounts volumes boots: a snapshot's devices are
	// fixed, and a pre-booted template's has no volume.
	snap := req.TemplateID
	if tmpl != nil {
		snap = tmpl.Snapshot
	}
	coldBoot := tmpl != nil && tmpl.Snapshot != "" && len(spec.Volumes) > 0
	if dir, ok := s.snapshotDir(snap); ok && !coldBoot {
		if tmpl == nil && !s.reachesSnapshot(key, snap) {
			apiError(w, http.StatusNotFound, fmt.Sprintf("create: template %q not found", req.TemplateID))
			return
		}
		if len(spec.Volumes) > 0 {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("create: volumeMounts: a sandbox made from snapshot %s keeps the snapshot's devices and cannot mount volumes", req.TemplateID))
			return
		}
		if rec, err = supervisor.RestoreRecord(dir, id, id, false, &spec); err != nil {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("create from snapshot %s: %v", req.TemplateID, err))
			return
		}
		// A restored guest keeps the snapshot's environment: the
		// request's goes to each process the API starts.
		if len(req.EnvVars) > 0 {
			b, _ := json.Marshal(req.EnvVars)
			labels[labelEnv] = string(b)
		}
		rec.Labels = labels
	}
	rec.TTL = time.Duration(timeout) * time.Second
	rec.PauseAtTTL = req.AutoPause
	rec.PauseWithoutMemory = labels[labelAutoReboot] != ""
	release, n, ok := s.reserve(key.ID, 1)
	if !ok {
		apiError(w, http.StatusTooManyRequests, fmt.Sprintf("create: this API key has %d sandboxes running or starting, its most (capsa serve --max-sandboxes-per-key)", n))
		return
	}
	// The sandbox is made whether or not the client waits for it (it is
	// killed at its timeout if nobody connects).
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 10*time.Minute)
	defer cancel()
	start := time.Now()
	name, err := s.m.Launch(ctx, rec, wl.SecretValues()) // the header rules' values
	release()
	if err != nil {
		if name != "" {
			s.m.Remove(context.WithoutCancel(ctx), name)
		}
		s.log.Warn("e2b: create", "template", req.TemplateID, "err", err)
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("create from template %q: %v", req.TemplateID, err))
		return
	}
	s.log.Info("e2b: created", "sandbox", name, "template", req.TemplateID, "in", since(start))
	if tmpl != nil && (tmpl.Snapshot == "" || coldBoot) && tmpl.StartCmd != "" {
		if err := s.startCommand(ctx, name, tmpl.StartCmd); err != nil {
			s.log.Warn("e2b: the template's start command", "sandbox", name, "template", tmpl.Name, "err", err)
		}
	}
	got, err := s.m.Get(name)
	if err != nil {
		apiError(w, http.StatusInternalServerError, "create: "+err.Error())
		return
	}
	writeJSON(w, http.StatusCreated, s.describe(got, true))
}

// startCommand runs a template's start command in the background in the
// sandbox name, as the user commands run as; it belongs to the guest.
func (s *Server) startCommand(ctx context.Context, name, cmd string) error {
	g, err := s.guest(ctx, name)
	if err != nil {
		return err
	}
	u, err := g.user(ctx, "")
	if err != nil {
		return err
	}
	_, err = g.h.Stream(context.Background(), agent.ExecOptions{Argv: []string{"/bin/sh", "-c", cmd}, Dir: u.homeDir(), User: u.execUser()})
	return err
}

// snapshotDir returns the directory of the state directory's snapshot
// name, if there is one.
func (s *Server) snapshotDir(name string) (string, bool) {
	if supervisor.CheckSnapshotName(name) != nil {
		return "", false
	}
	dir, err := s.m.SnapshotDir(name, false)
	if err != nil {
		return "", false
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return "", false
	}
	return dir, true
}

// reserve holds n of API key key's sandboxes for a create or fork under
// way, if the key's sandboxes (running, and being made) leave room for
// them; release gives them back once they are recorded as the key's. It
// returns how many the key has. Creates run at once, each holding its
// own: none waits for another's boot or pull.
func (s *Server) reserve(key string, n int) (release func(), have int, ok bool) {
	s.createMu.Lock()
	defer s.createMu.Unlock()
	have = s.pending[key]
	if recs, err := s.m.List(); err == nil {
		for _, r := range recs {
			// A sandbox still being made is counted by its
			// reservation.
			if r.Alive() && r.State != supervisor.Creating && r.Labels[labelKey] == key {
				have++
			}
		}
	}
	if have+n > s.perKey {
		return nil, have, false
	}
	s.pending[key] += n
	var once sync.Once
	return func() {
		once.Do(func() {
			s.createMu.Lock()
			defer s.createMu.Unlock()
			if s.pending[key] -= n; s.pending[key] <= 0 {
				delete(s.pending, key)
			}
		})
	}, have, true
}

// buildSandbox checks a create request and turns it into a sandbox
// workload: the template's (with it, if templateID names one), an image
// reference's, or capsa's built-in Linux's; the environment; the
// network.
func (s *Server) buildSandbox(ctx context.Context, req *newSandbox, key Key) (*sandbox.Workload, *Template, error) {
	if req.TemplateID == "" {
		req.TemplateID = "base"
	}
	if len(req.TemplateID) > maxTemplateID {
		return nil, nil, fmt.Errorf("templateID: longer than %d characters", maxTemplateID)
	}
	if req.AutoResume != nil && req.AutoResume.Enabled && !req.AutoPause {
		return nil, nil, errors.New("autoResume: needs autoPause")
	}
	if req.AutoPause && req.AutoPauseMemory != nil && !*req.AutoPauseMemory && req.AutoResume != nil && req.AutoResume.Enabled {
		return nil, nil, errors.New("autoResume: not with autoPauseMemory: false (a sandbox paused without its memory boots again, so traffic cannot wake it; connect resumes it)")
	}
	if len(req.MCP) > 0 && string(req.MCP) != "null" {
		return nil, nil, errors.New("mcp: capsa serve has no MCP gateway")
	}
	mounts, err := s.volumeMounts(key, req.VolumeMounts)
	if err != nil {
		return nil, nil, err
	}
	if len(req.Metadata) > maxMetadata {
		return nil, nil, fmt.Errorf("metadata: %d entries, at most %d", len(req.Metadata), maxMetadata)
	}
	for k, v := range req.Metadata {
		if k == "" || len(k) > maxMetaKey || len(v) > maxMetaValue {
			return nil, nil, fmt.Errorf("metadata %q: want a key of 1 to %d bytes and a value of at most %d", k, maxMetaKey, maxMetaValue)
		}
	}
	if len(req.EnvVars) > maxEnvVars {
		return nil, nil, fmt.Errorf("envVars: %d entries, at most %d", len(req.EnvVars), maxEnvVars)
	}
	env, err := envList(req.EnvVars)
	if err != nil {
		return nil, nil, fmt.Errorf("envVars: %w", err)
	}
	var allow, deny []string
	var rules []sandbox.HeaderRule
	var proxy *sandbox.EgressProxy
	if n := req.Network; n != nil {
		allow, deny = n.AllowOut, n.DenyOut
		if rules, err = headerRules(n.Rules); err != nil {
			return nil, nil, err
		}
		if proxy, err = s.egressProxy(ctx, n.EgressProxy); err != nil {
			return nil, nil, fmt.Errorf("network.%w", err)
		}
	}
	policy, err := egressPolicy(req.AllowInternetAccess, allow, deny)
	if err != nil {
		return nil, nil, err
	}
	if policy == nil && len(rules) > 0 {
		return nil, nil, errors.New("network.rules: the sandbox has no network (allow_internet_access false)")
	}
	if policy == nil && proxy != nil {
		return nil, nil, errors.New("network.egressProxy: the sandbox has no network (allow_internet_access false)")
	}
	// extra adds what a template's workload and a plain one share: the
	// volumes and the header rules.
	extra := func(b *sandbox.Builder) error {
		if policy != nil && s.dns != "" {
			b.DNSServer(s.dns)
		}
		if len(rules) > 0 {
			b.UpstreamCA(s.upstream...)
		}
		for _, r := range rules {
			for _, name := range slices.Sorted(maps.Keys(r.Headers)) {
				b.Header(r.Host, name, r.Headers[name])
			}
		}
		if proxy != nil {
			b.EgressProxy(*proxy)
		}
		return s.mountVolumes(b, mounts)
	}
	if s.templates != nil && req.TemplateID != "base" {
		if t, ok := s.templates.Get(req.TemplateID); ok {
			w, err := t.workload(policy, env, extra)
			return w, &t, err
		}
	}
	b := sandbox.New().Env(env...)
	if policy != nil {
		b.Network(policy)
	}
	if err := extra(b); err != nil {
		return nil, nil, err
	}
	ref := req.TemplateID
	if ref == "base" {
		ref = s.base
	}
	if ref == "" {
		return b.Run(keepAlive[0], keepAlive[1:]...), nil, nil
	}
	return b.Entrypoint(keepAlive...).OCI(ref), nil, nil
}

// egressPolicy is the NAT's policy for E2B's egress settings (a create's,
// or an updateNetwork's): public-only with allowOut and denyOut as allow
// and deny rules, where a denyOut of 0.0.0.0/0 (or ::/0) leaves only
// allowOut (deny-all). Without internet access (allowInternet false) it
// is nil: no network, which rules may not come with.
func egressPolicy(allowInternet *bool, allowOut, denyOut []string) (*netstack.Policy, error) {
	if allowInternet != nil && !*allowInternet {
		if len(allowOut) > 0 || len(denyOut) > 0 {
			return nil, errors.New("network: allowOut and denyOut need allow_internet_access")
		}
		return nil, nil
	}
	if len(allowOut) > maxRules || len(denyOut) > maxRules {
		return nil, fmt.Errorf("network: at most %d allowOut and denyOut rules", maxRules)
	}
	mode, deny := "public-only", []string(nil)
	for _, d := range denyOut {
		if d == "0.0.0.0/0" || d == "::/0" {
			mode = "deny-all" // only what allowOut names
			continue
		}
		deny = append(deny, d)
	}
	policy, err := netstack.ParsePolicy(mode, allowOut, deny)
	if err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	return policy, nil
}

// envList is the environment m sets, as KEY=VALUE entries by key; a key
// that is empty or holds '=' or NUL, or a value that holds NUL, is
// refused.
func envList(m map[string]string) ([]string, error) {
	env := make([]string, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.Contains(m[k], "\x00") {
			return nil, fmt.Errorf("bad environment variable %q", k)
		}
		env = append(env, k+"="+m[k])
	}
	return env, nil
}

// paused reports whether rec is paused as E2B has it: in memory or on
// disk (suspended).
func paused(rec *supervisor.Record) bool {
	return rec.State == supervisor.Paused || rec.State == supervisor.Suspended
}

// record returns the live sandbox the request's {id} names, if key may
// reach it, or answers 404 and returns nil.
func (s *Server) record(w http.ResponseWriter, r *http.Request, key Key) *supervisor.Record {
	id := r.PathValue("id")
	rec, err := s.m.Get(id)
	if err != nil || !rec.Live() || rec.State == supervisor.Created || !key.reaches(rec) {
		apiError(w, http.StatusNotFound, fmt.Sprintf("sandbox %q not found", id))
		return nil
	}
	return rec
}

func (s *Server) info(w http.ResponseWriter, r *http.Request, key Key) {
	if rec := s.record(w, r, key); rec != nil {
		writeJSON(w, http.StatusOK, s.describe(rec, true))
	}
}

func (s *Server) kill(w http.ResponseWriter, r *http.Request, key Key) {
	rec := s.record(w, r, key)
	if rec == nil {
		return
	}
	s.forget(rec.Name)
	if err := s.m.Remove(context.WithoutCancel(r.Context()), rec.Name); err != nil {
		if errors.Is(err, supervisor.ErrNotFound) {
			apiError(w, http.StatusNotFound, fmt.Sprintf("sandbox %q not found", rec.Name))
			return
		}
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("kill %s: %v", rec.Name, err))
		return
	}
	s.log.Info("e2b: killed", "sandbox", rec.Name)
	w.WriteHeader(http.StatusNoContent)
}

// timeoutBody is a timeout or connect request's body; Memory, a
// connect's (and a pause's): false, without the sandbox's memory.
type timeoutBody struct {
	Timeout *int  `json:"timeout"`
	Memory  *bool `json:"memory"`
}

// readOptional decodes a request's JSON body into v, if it has one.
func readOptional(r *http.Request, v any) error {
	if err := json.NewDecoder(r.Body).Decode(v); err != nil && err != io.EOF {
		return fmt.Errorf("the body: %v", err)
	}
	return nil
}

// readTimeout reads an optional {"timeout": seconds} body.
func readTimeout(r *http.Request) (*int, error) {
	body, err := readBody(r)
	return body.Timeout, err
}

// readBody reads an optional timeoutBody, its timeout checked.
func readBody(r *http.Request) (timeoutBody, error) {
	var body timeoutBody
	if err := readOptional(r, &body); err != nil {
		return body, err
	}
	if body.Timeout != nil {
		if _, err := timeoutOr("", body.Timeout, 0); err != nil {
			return body, err
		}
	}
	return body, nil
}

// timeoutOr is a request's timeout in seconds, t, or def without one; op
// names the request in the error.
func timeoutOr(op string, t *int, def int) (int, error) {
	if t == nil {
		return def, nil
	}
	if *t < 0 || *t > maxTimeout {
		if op != "" {
			op += ": "
		}
		return 0, fmt.Errorf("%stimeout %d: want 0 to %d seconds", op, *t, maxTimeout)
	}
	return *t, nil
}

// setTimeout ends the sandbox timeout seconds from now.
func (s *Server) setTimeout(w http.ResponseWriter, r *http.Request, key Key) {
	t, err := readTimeout(r)
	if err != nil || t == nil {
		apiError(w, http.StatusBadRequest, fmt.Sprintf("timeout: %v", cmp.Or(err, errors.New("no timeout given"))))
		return
	}
	rec := s.record(w, r, key)
	if rec == nil {
		return
	}
	if err := s.m.SetTTL(r.Context(), rec.Name, ttlFrom(rec.Started, *t)); err != nil {
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("timeout %s: %v", rec.Name, err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// connect answers with the sandbox and its access token: a running one
// (200) has its timeout extended to the one asked (300 s without one), if
// later; a paused one is resumed (201) with that timeout from now. A
// sandbox not made through the API gets a token.
func (s *Server) connect(w http.ResponseWriter, r *http.Request, key Key) {
	body, err := readBody(r)
	if err != nil {
		apiError(w, http.StatusBadRequest, "connect: "+err.Error())
		return
	}
	timeout, _ := timeoutOr("", body.Timeout, defaultTimeout)
	rec := s.record(w, r, key)
	if rec == nil {
		return
	}
	status := http.StatusOK
	if paused(rec) {
		if err := s.resume(r.Context(), rec, timeout, body.Memory != nil && !*body.Memory); err != nil {
			apiError(w, http.StatusInternalServerError, err.Error())
			return
		}
		status = http.StatusCreated
	} else if ttl := ttlFrom(rec.Started, timeout); rec.TTL != 0 && ttl > rec.TTL {
		if err := s.m.SetTTL(r.Context(), rec.Name, ttl); err != nil {
			apiError(w, http.StatusInternalServerError, fmt.Sprintf("connect %s: %v", rec.Name, err))
			return
		}
	}
	if rec.Labels[labelToken] == "" {
		err := s.m.SetLabels(rec.Name, func(l map[string]string) error {
			if l[labelToken] == "" {
				l[labelToken] = newToken()
			}
			return nil
		})
		if err != nil {
			apiError(w, http.StatusInternalServerError, fmt.Sprintf("connect %s: %v", rec.Name, err))
			return
		}
	}
	got, err := s.m.Get(rec.Name)
	if err != nil {
		apiError(w, http.StatusNotFound, fmt.Sprintf("sandbox %q not found", rec.Name))
		return
	}
	writeJSON(w, status, s.describe(got, true))
}

// resume runs the paused sandbox rec again, to end timeout seconds from
// now (a sandbox paused at its timeout has none left): from its memory,
// or booted again from its disk alone where reboot says so, its pause
// was to keep no memory (labelResume), or its suspension holds none.
func (s *Server) resume(ctx context.Context, rec *supervisor.Record, timeout int, reboot bool) error {
	s.forget(rec.Name)
	asked := reboot
	// A suspension of the disk alone boots whatever asked for it (capsa
	// suspend --no-memory from the CLI, say): its start command runs.
	reboot = reboot || rec.Labels[labelResume] == "reboot" || s.m.SuspendedWithoutMemory(rec.Name)
	resume := s.m.Resume
	if reboot {
		resume = s.m.ResumeCold
	}
	if err := resume(ctx, rec.Name); err != nil {
		// Made to pause without its memory, but paused in memory at its
		// timeout (its suspension failed, and so does this one): it runs
		// on from its memory rather than not at all.
		cur, gerr := s.m.Get(rec.Name)
		if asked || !reboot || gerr != nil || (cur.State != supervisor.Running && cur.State != supervisor.Paused) {
			return fmt.Errorf("resume %s: %v", rec.Name, err)
		}
		s.log.Warn("e2b: a resume without memory failed; resuming from memory", "sandbox", rec.Name, "err", err)
		if cur.State == supervisor.Paused {
			if err := s.m.Resume(ctx, rec.Name); err != nil {
				return fmt.Errorf("resume %s: %v", rec.Name, err)
			}
		}
		reboot = false
	}
	// The next pause is as the sandbox was made to pause, until a pause
	// says otherwise.
	next := ""
	if rec.Labels[labelAutoReboot] != "" {
		next = "reboot"
	}
	if _, err := s.setResume(rec.Name, next); err != nil {
		return fmt.Errorf("resume %s: %v", rec.Name, err)
	}
	// One restored from disk started again: its TTL counts from then.
	cur, err := s.m.Get(rec.Name)
	if err != nil {
		return fmt.Errorf("resume %s: %v", rec.Name, err)
	}
	if err := s.m.SetTTL(ctx, rec.Name, ttlFrom(cur.Started, timeout)); err != nil {
		return fmt.Errorf("resume %s: %v", rec.Name, err)
	}
	// Booted again, it runs its template's start command again, as a
	// sandbox booted from the template does.
	if reboot && s.templates != nil {
		if t, ok := s.templates.Get(rec.Labels[labelTemplate]); ok && t.StartCmd != "" {
			if err := s.startCommand(ctx, rec.Name, t.StartCmd); err != nil {
				s.log.Warn("e2b: the template's start command", "sandbox", rec.Name, "template", t.Name, "err", err)
			}
		}
	}
	s.log.Info("e2b: resumed", "sandbox", rec.Name, "timeout", timeout, "rebooted", reboot)
	return nil
}

// pause pauses a running sandbox (in memory: connect resumes it); 409 if
// it is paused.
func (s *Server) pause(w http.ResponseWriter, r *http.Request, key Key) {
	body, err := readBody(r)
	if err != nil {
		apiError(w, http.StatusBadRequest, "pause: "+err.Error())
		return
	}
	rec := s.record(w, r, key)
	if rec == nil {
		return
	}
	if paused(rec) {
		apiError(w, http.StatusConflict, fmt.Sprintf("sandbox %s is paused already", rec.Name))
		return
	}
	s.forget(rec.Name)
	if body.Memory != nil && !*body.Memory {
		s.pauseWithoutMemory(w, r, rec)
		return
	}
	// With its memory, whatever it was made to do at its timeout.
	restore, err := s.setResume(rec.Name, "")
	if err != nil {
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("pause %s: %v", rec.Name, err))
		return
	}
	// To disk, as E2B pauses: the VM ends and its memory is freed. A
	// sandbox that cannot be snapshotted pauses in memory instead.
	if err := s.m.Suspend(r.Context(), rec.Name); err != nil {
		s.log.Warn("e2b: pause to disk failed; pausing in memory", "sandbox", rec.Name, "err", err)
		if cur, gerr := s.m.Get(rec.Name); gerr != nil || !cur.Alive() {
			restore()
			apiError(w, http.StatusInternalServerError, fmt.Sprintf("pause %s: %v", rec.Name, err))
			return
		}
		if err := s.m.Pause(r.Context(), rec.Name); err != nil {
			restore()
			apiError(w, http.StatusInternalServerError, fmt.Sprintf("pause %s: %v", rec.Name, err))
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// pauseWithoutMemory pauses rec keeping its disk alone (E2B's memory:
// false): it is suspended, and its next resume boots it again from the
// disk. Unlike a pause with memory it is never done in memory instead:
// that would keep what the caller asked to drop.
func (s *Server) pauseWithoutMemory(w http.ResponseWriter, r *http.Request, rec *supervisor.Record) {
	if rec.Spec.Image == nil {
		apiError(w, http.StatusBadRequest, fmt.Sprintf("pause %s: memory: false: it runs capsa's built-in Linux, with no disk of its own to boot again from", rec.Name))
		return
	}
	// The suspension writes what the guest's page cache holds to its
	// disk first.
	restore, err := s.setResume(rec.Name, "reboot")
	if err != nil {
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("pause %s: %v", rec.Name, err))
		return
	}
	if err := s.m.SuspendWithoutMemory(r.Context(), rec.Name); err != nil {
		restore()
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("pause %s: %v", rec.Name, err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// setResume sets how the sandbox name's next resume starts it
// (labelResume: "reboot", or "" from its memory) and returns what sets
// back the one before, for a pause that fails.
func (s *Server) setResume(name, how string) (restore func(), err error) {
	var was string
	set := func(v string) func(map[string]string) error {
		return func(l map[string]string) error {
			if v == "" {
				delete(l, labelResume)
			} else {
				l[labelResume] = v
			}
			return nil
		}
	}
	err = s.m.SetLabels(name, func(l map[string]string) error {
		was = l[labelResume]
		return set(how)(l)
	})
	return func() {
		if err := s.m.SetLabels(name, set(was)); err != nil {
			s.log.Warn("e2b: the resume's kind not set back after a failed pause", "sandbox", name, "err", err)
		}
	}, err
}

// metric is one SandboxMetric.
type metric struct {
	Timestamp  time.Time `json:"timestamp"`
	CPUUsedPct float64   `json:"cpuUsedPct"`
	CPUCount   int       `json:"cpuCount"`
	MemUsed    uint64    `json:"memUsed"`
	MemTotal   uint64    `json:"memTotal"`
	DiskUsed   uint64    `json:"diskUsed"`
	DiskTotal  uint64    `json:"diskTotal"`
}

// metrics answers the sandbox's figures now: its vCPUs' use since it
// started, and the guest memory the host holds.
func (s *Server) metrics(w http.ResponseWriter, r *http.Request, key Key) {
	rec := s.record(w, r, key)
	if rec == nil {
		return
	}
	st, err := s.m.Stats(r.Context(), rec.Name)
	if err != nil {
		status := http.StatusInternalServerError
		if errors.Is(err, supervisor.ErrNotRunning) || errors.Is(err, supervisor.ErrPaused) {
			status = http.StatusConflict
		}
		apiError(w, status, fmt.Sprintf("metrics %s: %v", rec.Name, err))
		return
	}
	m := metric{Timestamp: st.Taken.UTC(), CPUCount: st.CPUs, MemUsed: st.MemoryResident, MemTotal: st.MemoryBytes}
	if st.Uptime > 0 && st.CPUs > 0 {
		m.CPUUsedPct = 100 * float64(st.CPUTime) / float64(st.Uptime) / float64(st.CPUs)
	}
	writeJSON(w, http.StatusOK, []metric{m})
}

// list answers the live sandboxes the key reaches: v2 filtered by state,
// metadata, template and start, ordered by start (newest first unless
// order=asc) and paged (limit, nextToken, the next page's token in
// X-Next-Token); the first API's, every running one.
func (s *Server) list(w http.ResponseWriter, r *http.Request, key Key, v2 bool) {
	q := r.URL.Query()
	recs, err := s.m.List()
	if err != nil {
		apiError(w, http.StatusInternalServerError, "list: "+err.Error())
		return
	}
	states := map[string]bool{"running": true}
	if v2 {
		states["paused"] = true
		if st := q.Get("state"); st != "" {
			states = map[string]bool{}
			for _, x := range strings.Split(st, ",") {
				if x != "running" && x != "paused" {
					apiError(w, http.StatusBadRequest, fmt.Sprintf("list: state %q: want running or paused", x))
					return
				}
				states[x] = true
			}
		}
	}
	meta, err := metadataFilter(q.Get("metadata"))
	if err != nil {
		apiError(w, http.StatusBadRequest, "list: "+err.Error())
		return
	}
	limit, err := pageLimit(q)
	if err != nil {
		apiError(w, http.StatusBadRequest, "list: "+err.Error())
		return
	}
	tmpl := q.Get("template")
	var after time.Time
	if a := q.Get("startedAfter"); a != "" {
		if after, err = time.Parse(time.RFC3339Nano, a); err != nil {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("list: startedAfter %q: want an RFC 3339 time", a))
			return
		}
	}
	var rows []*supervisor.Record
	for _, rec := range recs {
		if !rec.Live() || rec.State == supervisor.Created || rec.State == supervisor.Creating || !key.reaches(rec) {
			continue
		}
		state := "running"
		if paused(rec) {
			state = "paused"
		}
		if !states[state] {
			continue
		}
		match := (tmpl == "" || templateOf(rec) == tmpl) && !rec.Started.Before(after)
		for k, v := range meta {
			if got, ok := rec.Labels[labelMeta+k]; !ok || got != v {
				match = false
			}
		}
		if match {
			rows = append(rows, rec)
		}
	}
	// By start then name, newest first unless order=asc: a page's token
	// is the last sandbox it held.
	slices.SortFunc(rows, func(a, b *supervisor.Record) int {
		return cmp.Or(a.Started.Compare(b.Started), strings.Compare(a.Name, b.Name))
	})
	switch q.Get("order") {
	case "", "desc":
		slices.Reverse(rows)
	case "asc":
	default:
		apiError(w, http.StatusBadRequest, fmt.Sprintf("list: order %q: want asc or desc", q.Get("order")))
		return
	}
	if tok := q.Get("nextToken"); tok != "" {
		i := slices.IndexFunc(rows, func(r *supervisor.Record) bool { return r.Name == tok })
		if i < 0 {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("list: nextToken %q: no such sandbox (it may have ended)", tok))
			return
		}
		rows = rows[i+1:]
	}
	out := []sandboxInfo{}
	for _, rec := range firstPage(w, rows, limit, func(r *supervisor.Record) string { return r.Name }) {
		out = append(out, s.describe(rec, false))
	}
	writeJSON(w, http.StatusOK, out)
}

// pageLimit is a list's limit query: how many items a page holds (at most
// maxListLimit, and that without one).
func pageLimit(q url.Values) (int, error) {
	l := q.Get("limit")
	if l == "" {
		return maxListLimit, nil
	}
	n, err := strconv.Atoi(l)
	if err != nil || n <= 0 || n > maxListLimit {
		return 0, fmt.Errorf("limit %q: want 1 to %d", l, maxListLimit)
	}
	return n, nil
}

// firstPage is items' first limit; when more follow, X-Next-Token names
// the last item of the page (name gives an item's), from which the next
// page goes on.
func firstPage[T any](w http.ResponseWriter, items []T, limit int, name func(T) string) []T {
	if len(items) > limit {
		w.Header().Set("X-Next-Token", name(items[limit-1]))
		items = items[:limit]
	}
	return items
}

// metadataFilter reads the list's metadata query: key=value pairs joined
// as a query string, each key and value escaped once more (as the SDKs
// send them).
func metadataFilter(s string) (map[string]string, error) {
	if s == "" {
		return nil, nil
	}
	vals, err := url.ParseQuery(s)
	if err != nil {
		return nil, fmt.Errorf("metadata %q: %v", s, err)
	}
	m := map[string]string{}
	for k, vs := range vals {
		key, err1 := url.QueryUnescape(k)
		val, err2 := url.QueryUnescape(vs[len(vs)-1])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("metadata %q: bad escape", s)
		}
		m[key] = val
	}
	return m, nil
}

// forkBody is a fork request's body.
type forkBody struct {
	Count   *int `json:"count"`
	Timeout *int `json:"timeout"`
}

// forkResult is one copy in a fork's answer: the sandbox or why it did not
// start.
type forkResult struct {
	Sandbox *sandboxInfo `json:"sandbox,omitempty"`
	Error   *errorBody   `json:"error,omitempty"`
}

// maxForkCount bounds one fork request's copies (E2B's bound).
const maxForkCount = 100

// fork makes running copies of a sandbox (supervisor.Manager.Fork), each
// with its own access token and the source's template and metadata.
func (s *Server) fork(w http.ResponseWriter, r *http.Request, key Key) {
	var body forkBody
	if err := readOptional(r, &body); err != nil {
		apiError(w, http.StatusBadRequest, "fork: "+err.Error())
		return
	}
	count := 1
	if body.Count != nil {
		count = *body.Count
	}
	if count < 1 || count > maxForkCount {
		apiError(w, http.StatusBadRequest, fmt.Sprintf("fork: count %d: want 1 to %d", count, maxForkCount))
		return
	}
	timeout, err := timeoutOr("fork", body.Timeout, defaultTimeout)
	if err != nil {
		apiError(w, http.StatusBadRequest, err.Error())
		return
	}
	src := s.record(w, r, key)
	if src == nil {
		return
	}
	release, n, ok := s.reserve(key.ID, count)
	if !ok {
		apiError(w, http.StatusTooManyRequests, fmt.Sprintf("fork: %d copies would make this API key's %d sandboxes more than its %d", count, n, s.perKey))
		return
	}
	// Released once the copies are labelled as the key's (below).
	defer release()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 10*time.Minute)
	defer cancel()
	names, errs, err := s.m.Fork(ctx, src.Name, count, nil)
	if err != nil {
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("fork %s: %v", src.Name, err))
		return
	}
	out := make([]forkResult, len(names))
	for i, name := range names {
		if errs[i] == nil {
			errs[i] = s.m.SetLabels(name, func(l map[string]string) error {
				for k, v := range src.Labels {
					if strings.HasPrefix(k, labelMeta) || k == labelTemplate {
						l[k] = v
					}
				}
				l[labelToken], l[labelKey] = newToken(), key.ID
				return nil
			})
		}
		var rec *supervisor.Record
		if errs[i] == nil {
			rec, errs[i] = s.m.Get(name)
		}
		if errs[i] == nil {
			rec.TTL = ttlFrom(rec.Started, timeout)
			errs[i] = s.m.SetTTL(ctx, name, rec.TTL)
		}
		if errs[i] != nil {
			out[i].Error = &errorBody{Code: http.StatusInternalServerError, Message: fmt.Sprintf("fork %s as %s: %v", src.Name, name, errs[i])}
			continue
		}
		in := s.describe(rec, true)
		out[i].Sandbox = &in
	}
	s.log.Info("e2b: forked", "sandbox", src.Name, "copies", names)
	writeJSON(w, http.StatusCreated, out)
}

// ttlFrom is the TTL, counted from started, that ends a sandbox timeout
// seconds from now (0: never).
func ttlFrom(started time.Time, timeout int) time.Duration {
	if timeout == 0 {
		return 0
	}
	return time.Since(started) + time.Duration(timeout)*time.Second
}

// snapshotInfo is what the API says of a snapshot (SnapshotInfo).
type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// snapOwner says which API key made a snapshot, of which sandbox: a key
// reaches the snapshots it made (all of the state directory's, with
// Key.All).
type snapOwner struct {
	Name    string `json:"name"`
	Key     string `json:"key"`
	Sandbox string `json:"sandbox"`
}

// SnapshotsFile is where the API keeps its snapshots' owners.
const SnapshotsFile = "e2b-snapshots.json"

// snapshotOwner returns who made the snapshot name through the API.
func (s *Server) snapshotOwner(name string) (snapOwner, bool) {
	owners, err := s.snaps.load()
	if err != nil {
		return snapOwner{}, false
	}
	for _, o := range owners {
		if o.Name == name {
			return o, true
		}
	}
	return snapOwner{}, false
}

// reachesSnapshot reports whether key may list, delete and create from
// the state directory's snapshot name.
func (s *Server) reachesSnapshot(key Key, name string) bool {
	o, made := s.snapshotOwner(name)
	return key.reachesSnapshot(o, made)
}

// createSnapshot snapshots a running sandbox into the state directory: a
// templateID that later creates start from.
func (s *Server) createSnapshot(w http.ResponseWriter, r *http.Request, key Key) {
	var body struct {
		Name string `json:"name"`
	}
	if err := readOptional(r, &body); err != nil {
		apiError(w, http.StatusBadRequest, "snapshot: "+err.Error())
		return
	}
	if body.Name != "" {
		if err := supervisor.CheckSnapshotName(body.Name); err != nil {
			apiError(w, http.StatusBadRequest, fmt.Sprintf("snapshot: name: %v", err))
			return
		}
		if _, exists := s.snapshotDir(body.Name); exists {
			apiError(w, http.StatusConflict, fmt.Sprintf("snapshot: a snapshot named %q exists", body.Name))
			return
		}
	}
	rec := s.record(w, r, key)
	if rec == nil {
		return
	}
	snap, err := s.m.SaveSnapshot(context.WithoutCancel(r.Context()), rec.Name, body.Name, "", nil)
	if err != nil {
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("snapshot %s: %v", rec.Name, err))
		return
	}
	err = s.snaps.change(func(owners []snapOwner) ([]snapOwner, error) {
		return append(slices.DeleteFunc(owners, func(o snapOwner) bool { return o.Name == snap }),
			snapOwner{Name: snap, Key: key.ID, Sandbox: rec.Name}), nil
	})
	if err != nil {
		s.log.Warn("e2b: keep the snapshot's owner", "snapshot", snap, "err", err)
	}
	writeJSON(w, http.StatusCreated, snapshotInfo{SnapshotID: snap, Names: []string{snap}})
}

// listSnapshots lists the state directory's snapshots (with sandboxID,
// those made of that sandbox through the API; with name, that one), by
// name, paged as list is.
func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request, key Key) {
	q := r.URL.Query()
	snaps, err := s.m.Snapshots()
	if err != nil {
		apiError(w, http.StatusInternalServerError, "list snapshots: "+err.Error())
		return
	}
	limit, err := pageLimit(q)
	if err != nil {
		apiError(w, http.StatusBadRequest, "list snapshots: "+err.Error())
		return
	}
	list, err := s.snaps.load()
	if err != nil {
		apiError(w, http.StatusInternalServerError, "list snapshots: "+err.Error())
		return
	}
	owners := map[string]snapOwner{}
	for _, o := range list {
		owners[o.Name] = o
	}
	of, only := q.Get("sandboxID"), q.Get("name")
	var names []string
	for _, sn := range snaps {
		o, made := owners[sn.Name]
		switch {
		case sn.Err != "", only != "" && only != sn.Name:
		case !key.reachesSnapshot(o, made):
		case of != "" && (!made || o.Sandbox != of):
		default:
			names = append(names, sn.Name)
		}
	}
	slices.Sort(names)
	if tok := q.Get("nextToken"); tok != "" {
		i, found := slices.BinarySearch(names, tok)
		if found {
			i++
		}
		names = names[i:]
	}
	out := []snapshotInfo{}
	for _, n := range firstPage(w, names, limit, func(n string) string { return n }) {
		out = append(out, snapshotInfo{SnapshotID: n, Names: []string{n}})
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteSnapshot removes a snapshot of the state directory (the SDKs
// delete a snapshot as a template).
func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request, key Key) {
	name := r.PathValue("id")
	if _, ok := s.snapshotDir(name); !ok || !s.reachesSnapshot(key, name) {
		apiError(w, http.StatusNotFound, fmt.Sprintf("snapshot %q not found", name))
		return
	}
	if err := s.m.RemoveSnapshot(name); err != nil {
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("delete snapshot %s: %v", name, err))
		return
	}
	s.snaps.change(func(owners []snapOwner) ([]snapOwner, error) {
		return slices.DeleteFunc(owners, func(o snapOwner) bool { return o.Name == name }), nil
	})
	w.WriteHeader(http.StatusNoContent)
}

// updateNetwork replaces a sandbox's egress rules (PUT
// /sandboxes/{id}/network, SandboxNetworkUpdate): what the body leaves out
// is cleared, as E2B's does. They are in force at once for every new
// connection and DNS query (those under way go on) and kept for its
// resume. allow_internet_access false denies all but allowOut; a sandbox
// made without internet access has no NIC to open (409). rules (header
// transforms) replace the sandbox's, and may name only hosts it
// intercepted at its start (its CA's, 409 otherwise: see
// supervisor.Manager.SetHeaderRules). egressProxy replaces the sandbox's
// proxy, and leaving it out sends its TCP out directly, as E2B's does.
func (s *Server) updateNetwork(w http.ResponseWriter, r *http.Request, key Key) {
	var body struct {
		AllowOut            []string                 `json:"allowOut"`
		DenyOut             []string                 `json:"denyOut"`
		AllowInternetAccess *bool                    `json:"allow_internet_access"`
		EgressProxy         *egressProxyConfig       `json:"egressProxy"`
		Rules               map[string][]networkRule `json:"rules"`
	}
	if err := readOptional(r, &body); err != nil {
		apiError(w, http.StatusBadRequest, "update network: "+err.Error())
		return
	}
	proxy, err := s.egressProxy(r.Context(), body.EgressProxy)
	if err != nil {
		apiError(w, http.StatusBadRequest, "update network: "+err.Error())
		return
	}
	rules, err := headerRules(body.Rules)
	if err != nil {
		apiError(w, http.StatusBadRequest, "update "+err.Error())
		return
	}
	// allow_internet_access false is a denyOut of all traffic: only
	// allowOut passes (as the SDK documents it).
	deny := body.DenyOut
	if body.AllowInternetAccess != nil && !*body.AllowInternetAccess {
		deny = append(slices.Clone(deny), "0.0.0.0/0")
	}
	policy, err := egressPolicy(nil, body.AllowOut, deny)
	if err != nil {
		apiError(w, http.StatusBadRequest, "update "+err.Error())
		return
	}
	rec := s.record(w, r, key)
	if rec == nil {
		return
	}
	// The rules first: they are what may be refused.
	if err := s.m.SetHeaderRules(r.Context(), rec.Name, rules); errors.Is(err, sandbox.ErrNoInterception) || errors.Is(err, sandbox.ErrOutsideCA) {
		apiError(w, http.StatusConflict, fmt.Sprintf("update network of %s: rules: %v; a sandbox's TLS interception covers the hosts it was made with: give rules for these hosts at create", rec.Name, err))
		return
	} else if err != nil && !errors.Is(err, sandbox.ErrNoNAT) {
		apiError(w, http.StatusBadRequest, fmt.Sprintf("update network of %s: rules: %v", rec.Name, err))
		return
	}
	// A proxy set goes in before the policy, one removed after it
	// (supervisor.Manager.UpdateNetwork).
	err = s.m.UpdateNetwork(r.Context(), rec.Name, supervisor.NetworkUpdate{Policy: policy, SetProxy: true, Proxy: proxy})
	var step *supervisor.NetworkStepError
	switch {
	case errors.Is(err, sandbox.ErrNoNAT):
		apiError(w, http.StatusConflict, fmt.Sprintf("update network of %s: it was made without internet access (allow_internet_access false), so it has no network to change or tunnel", rec.Name))
		return
	case errors.As(err, &step) && step.Step == supervisor.StepProxy:
		// The sandbox refused the proxy: the request's.
		apiError(w, http.StatusBadRequest, fmt.Sprintf("update network of %s: egressProxy: %v", rec.Name, err))
		return
	case err != nil:
		apiError(w, http.StatusInternalServerError, fmt.Sprintf("update network of %s: %v", rec.Name, err))
		return
	}
	s.log.Info("e2b: network updated", "sandbox", rec.Name, "policy", policy.String())
	w.WriteHeader(http.StatusNoContent)
}
