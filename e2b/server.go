// Package e2b serves E2B's API over a supervisor.Manager, so that E2B's
// SDKs (the e2b packages for JavaScript and Python) and the agent
// frameworks built on them drive capsa sandboxes unchanged: the control
// API (create, connect, list, describe, time out, pause, kill) and, for
// each sandbox, the API of E2B's in-sandbox daemon, envd (processes and
// the file system over the Connect protocol, file transfers over plain
// HTTP), all on one listener.
//
// Its starting point is the interface E2B's SDKs use (the e2b npm package
// 2.51.0): the control API's OpenAPI types, envd's two protobuf services
// (whose definitions are written here, in envd/, with their generated
// code) and the headers that route a request to a sandbox. API sandboxes
// are ordinary detached sandboxes: `capsa ps`, `exec`, `logs` and the MCP
// server see them, and what the API keeps of them (their template,
// metadata and envd access token) is in their records' labels, so a
// restarted server serves them again.
package e2b

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/capsa-sandbox/capsa/e2b/envd/filesystem/filesystemconnect"
	"github.com/capsa-sandbox/capsa/e2b/envd/process/processconnect"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// EnvdPort is the port E2B's SDKs address envd on (E2b-Sandbox-Port, and
// the first label of a sandbox's host name).
const EnvdPort = 49983

// EnvdVersion is the envd version this server reports: the highest whose
// features (as the SDKs gate them) it implements in full: 0.6.2 brings
// metadata on files, 0.6.3 entries in watch events, 0.6.4 watches of
// network mounts when asked (refused otherwise).
const EnvdVersion = "0.6.4"

// Labels a sandbox's record carries for this API (supervisor.Record.Labels).
const (
	labelToken      = "e2b.token"      // the envd access token
	labelTemplate   = "e2b.template"   // the templateID it was created from
	labelKey        = "e2b.key"        // the ID of the API key that created it
	labelMeta       = "e2b.meta."      // + a metadata key: its value
	labelTraffic    = "e2b.traffic"    // the token its ports need (none: public)
	labelEnv        = "e2b.env"        // a restored sandbox's envVars (JSON), for its processes
	labelAutoResume = "e2b.autoresume" // paused, it is resumed by a request for it
	labelTimeout    = "e2b.timeout"    // its timeout at create, in seconds (an auto-resume's)
	// labelResume says how its next resume starts it: "reboot" from its
	// disk alone (a pause without memory), else from its memory.
	// labelAutoReboot ("1") is what an auto-pause at its timeout leaves
	// it (autoPauseMemory: false), and labelResume goes back to after
	// each resume.
	labelResume     = "e2b.resume"
	labelAutoReboot = "e2b.autopause-reboot"
)

// Options configure a Server.
type Options struct {
	Manager   *supervisor.Manager
	Keys      *Keys
	Templates *Templates // nil: none, only image references and snapshots
	Log       *slog.Logger
	// DefaultTemplate is what the templateID "base" means: an OCI image
	// reference ("": capsa's built-in Linux).
	DefaultTemplate string
	// Domain is the domain the SDKs are told the sandboxes are under
	// (<port>-<id>.DOMAIN); "": none, for clients given E2B_SANDBOX_URL.
	Domain string
	// MaxSandboxesPerKey bounds the sandboxes one API key may have
	// running at once (0: DefaultMaxSandboxesPerKey).
	MaxSandboxesPerKey int
	// VolumeQuota is each API volume's quota in bytes (0:
	// DefaultVolumeQuota).
	VolumeQuota int64
	// DNSServer (IP:PORT), if set, resolves every sandbox's DNS queries
	// instead of the host's resolver (sandbox.Builder.DNSServer).
	DNSServer string
	// UpstreamCAs are PEM files whose CAs a sandbox's interception
	// (header rules) trusts for the real servers beside the host's
	// (sandbox.Builder.UpstreamCA): a private server's CA.
	UpstreamCAs []string
	// PrivateEgressProxy lets a sandbox's egress proxy (network.egressProxy)
	// be on a loopback, private or other non-public address; without it,
	// as on E2B's cloud, one must be public, so that an API caller cannot
	// aim sandboxes' traffic at the host's own services.
	PrivateEgressProxy bool
}

// DefaultMaxSandboxesPerKey is Options.MaxSandboxesPerKey's default.
const DefaultMaxSandboxesPerKey = 20

// Server serves E2B's control and envd APIs. Its processes (started
// through envd's Start) belong to the sandboxes: they outlive the request
// and the client that started them, and what the server holds of them
// (their stdin, their terminal) lasts until they end or Close.
type Server struct {
	m            *supervisor.Manager
	keys         *Keys
	templates    *Templates
	log          *slog.Logger
	base         string
	domain       string
	perKey       int
	dns          string   // Options.DNSServer
	upstream     []string // Options.UpstreamCAs
	privateProxy bool     // Options.PrivateEgressProxy

	ctx    context.Context // the polling watchers' lifetime
	cancel context.CancelFunc

	resumeMu sync.Mutex     // one auto-resume at a time
	createMu sync.Mutex     // guards pending
	pending  map[string]int // per API key, the sandboxes being made

	snaps       jsonFile[snapOwner] // the API's snapshots' owners
	vols        jsonFile[volOwner]  // the API's volumes
	volumeQuota int64
	volMu       sync.Mutex             // guards openVols
	openVols    map[string]*openVolume // the file API's open volumes, by capsa volume name

	mu      sync.Mutex
	guests  map[string]*guest // by sandbox name
	control http.Handler
	envd    http.Handler
}

// New returns a Server for o.
func New(o Options) (*Server, error) {
	if o.Manager == nil || o.Keys == nil {
		return nil, errors.New("e2b: a server needs a manager and keys")
	}
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// The sandboxes' network settings, checked as a sandbox's are.
	if o.DNSServer != "" || len(o.UpstreamCAs) > 0 {
		b := sandbox.New().Network(netstack.PublicOnly()).UpstreamCA(o.UpstreamCAs...)
		if o.DNSServer != "" {
			b.DNSServer(o.DNSServer)
		}
		if _, err := b.Run("true").Spec(); err != nil {
			return nil, fmt.Errorf("e2b: the sandboxes' network: %w", err)
		}
	}
	perKey := o.MaxSandboxesPerKey
	if perKey <= 0 {
		perKey = DefaultMaxSandboxesPerKey
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{m: o.Manager, keys: o.Keys, templates: o.Templates, log: log, base: o.DefaultTemplate, domain: o.Domain, perKey: perKey,
		dns: o.DNSServer, upstream: o.UpstreamCAs, privateProxy: o.PrivateEgressProxy,
		ctx: ctx, cancel: cancel, guests: map[string]*guest{}, pending: map[string]int{}, openVols: map[string]*openVolume{}}
	s.snaps = jsonFile[snapOwner]{path: filepath.Join(o.Manager.Dir(), SnapshotsFile), what: "snapshot owners"}
	s.vols = jsonFile[volOwner]{path: filepath.Join(o.Manager.Dir(), VolumesFile), what: "volumes"}
	if s.volumeQuota = o.VolumeQuota; s.volumeQuota <= 0 {
		s.volumeQuota = DefaultVolumeQuota
	}
	s.control = s.controlMux()
	s.envd = s.envdMux()
	return s, nil
}

// Close ends what the server holds of its sandboxes (their processes'
// stdin, polling watchers); the processes and sandboxes go on.
func (s *Server) Close() error {
	s.cancel()
	s.mu.Lock()
	guests := s.guests
	s.guests = map[string]*guest{}
	s.mu.Unlock()
	for _, g := range guests {
		g.closeProcs()
	}
	s.closeVolumeFiles("")
	return nil
}

// maxBody bounds a control request's body, and a Connect message.
const maxBody = 1 << 20

// ServeHTTP routes a request: one for a sandbox (an E2b-Sandbox-Id header,
// or a host name <port>-<id>.<domain>) goes to its envd API, anything else
// to the control API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id, port, ok := sandboxTarget(r)
	if !ok {
		s.control.ServeHTTP(w, r)
		return
	}
	g, err := s.guest(r.Context(), id)
	if err != nil {
		status := http.StatusBadGateway // the SDKs read 502 as "not running"
		switch {
		case errors.Is(err, supervisor.ErrNotFound):
			status = http.StatusNotFound
		case errors.Is(err, errNoToken):
			status = http.StatusUnauthorized
		}
		envdError(w, status, err.Error())
		return
	}
	if port != EnvdPort {
		s.proxyPort(w, r, g, port)
		return
	}
	// /health answers anyone, as envd's does; the rest needs the
	// sandbox's access token.
	// A signed file URL (the SDKs' downloadUrl and uploadUrl) stands
	// for the token.
	authorized := r.URL.Path == "/health" || tokenMatches(r.Header.Get("X-Access-Token"), g.token) ||
		r.URL.Path == "/files" && signatureValid(r, g.token)
	if !authorized {
		envdError(w, http.StatusUnauthorized, "missing or wrong X-Access-Token for sandbox "+id)
		return
	}
	s.envd.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), guestKey{}, g)))
}

// sandboxTarget says which sandbox and port a request is for, if any.
func sandboxTarget(r *http.Request) (id string, port int, ok bool) {
	if id = r.Header.Get("E2b-Sandbox-Id"); id != "" {
		port = EnvdPort
		if p := r.Header.Get("E2b-Sandbox-Port"); p != "" {
			n, err := strconv.Atoi(p)
			if err != nil || n <= 0 || n > 65535 {
				return id, -1, true
			}
			port = n
		}
		return id, port, true
	}
	// <port>-<id>.<domain>[:<listen port>]
	host := r.Host
	if i := strings.LastIndexByte(host, ':'); i >= 0 && !strings.Contains(host[i:], "]") {
		host = host[:i]
	}
	label, _, found := strings.Cut(host, ".")
	if !found {
		return "", 0, false
	}
	p, rest, found := strings.Cut(label, "-")
	if !found || rest == "" {
		return "", 0, false
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 || n > 65535 {
		return "", 0, false
	}
	return rest, n, true
}

// tokenMatches compares an access token in constant time.
func tokenMatches(got, want string) bool {
	return want != "" && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// envdMux serves envd's API: its two Connect services and its plain HTTP
// routes. Every handler finds its sandbox in the request's context.
func (s *Server) envdMux() http.Handler {
	mux := http.NewServeMux()
	opts := []connect.HandlerOption{connect.WithReadMaxBytes(maxBody), connect.WithSendMaxBytes(4 << 20)}
	path, h := processconnect.NewProcessHandler(&processService{s: s}, opts...)
	mux.Handle(path, h)
	path, h = filesystemconnect.NewFilesystemHandler(&filesystemService{s: s}, opts...)
	mux.Handle(path, h)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("GET /files", s.downloadFile)
	mux.HandleFunc("POST /files", s.uploadFiles)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		envdError(w, http.StatusNotFound, fmt.Sprintf("%s %s: no such envd route", r.Method, r.URL.Path))
	})
	return mux
}

// guestKey keys the request's guest in its context.
type guestKey struct{}

func guestFrom(ctx context.Context) *guest {
	g, _ := ctx.Value(guestKey{}).(*guest)
	return g
}

// errorBody is E2B's error shape, on both APIs' plain HTTP routes.
type errorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// writeJSON answers status with v as JSON.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// apiError answers a control request with E2B's error shape: the SDKs
// read the body's code (404, 409) as well as the status.
func apiError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, errorBody{Code: status, Message: msg})
}

// envdError answers an envd plain HTTP request with E2B's error shape.
func envdError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, errorBody{Code: status, Message: msg})
}

// newID returns n random lowercase letters and digits.
func newID(n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}

// newToken returns a random access token.
func newToken() string { return newID(32) }

// since says how long ago t was, for logs.
func since(t time.Time) time.Duration { return time.Since(t).Round(time.Millisecond) }
