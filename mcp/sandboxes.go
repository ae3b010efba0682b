package mcp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// keepAlive is a sandbox's main process when the agent gives none: the
// sandbox stays up until destroyed or its TTL passes (2^31-1 seconds, a
// number every sleep takes).
var keepAlive = []string{"sleep", "2147483647"}

// watchdog is capsa run's default: a guest counts as hung when its agent
// is silent and its vCPUs stand still for this long.
const watchdog = 5 * time.Minute

// maxLifetime bounds ttl_seconds and idle_timeout_seconds (a year).
const maxLifetime = 365 * 24 * 3600

type shareArg struct {
	Host     string `json:"host" jsonschema:"an absolute host directory"`
	Guest    string `json:"guest" jsonschema:"the absolute guest path where it appears"`
	ReadOnly bool   `json:"read_only,omitempty" jsonschema:"the guest may only read it"`
}

type volumeArg struct {
	Name     string `json:"name" jsonschema:"a named volume (capsa volume create NAME)"`
	Guest    string `json:"guest" jsonschema:"the absolute guest path where it appears"`
	ReadOnly bool   `json:"read_only,omitempty" jsonschema:"the guest may only read it"`
}

type secretArg struct {
	Name  string   `json:"name" jsonschema:"the environment variable the guest gets, holding a placeholder in place of the value"`
	Env   string   `json:"env,omitempty" jsonschema:"the environment variable of the capsa mcp server that holds the value (default: name); the value never passes through this conversation"`
	Hosts []string `json:"hosts" jsonschema:"the hosts (HOST or *.DOMAIN) whose HTTPS requests get the real value in place of the placeholder"`
}

type createArgs struct {
	Name      string   `json:"name,omitempty" jsonschema:"the sandbox's name: 1 to 63 letters, digits, '_', '.' or '-'; default: a new one (sb-XXXXXX)"`
	Image     string   `json:"image,omitempty" jsonschema:"an OCI image for the root filesystem (e.g. python:3.12-slim), pulled if not cached; its environment and working directory apply to sandbox_exec; default: capsa's small built-in Linux with busybox-style tools"`
	Command   []string `json:"command,omitempty" jsonschema:"the main process (argv); the sandbox ends when it does. Default: a sleep that keeps the sandbox up until sandbox_destroy or its TTL (with an image, in place of the image's entrypoint and command, so the image needs sleep)"`
	CPUs      int      `json:"cpus,omitempty" jsonschema:"vCPUs (default 1)"`
	MemoryMiB int      `json:"memory_mib,omitempty" jsonschema:"guest memory in MiB (default 512)"`
	Env       []string `json:"env,omitempty" jsonschema:"environment entries (KEY=VALUE) for every process"`
	hostArgs
	TTLSeconds         int `json:"ttl_seconds,omitempty" jsonschema:"stop the sandbox this many seconds after it started (default 0: never)"`
	IdleTimeoutSeconds int `json:"idle_timeout_seconds,omitempty" jsonschema:"stop the sandbox once no exec or file operation has reached it for this many seconds (default 0: never)"`
}

// hostArgs are a sandbox's host-facing settings: what it may reach on the
// host and the network. sandbox_create and snapshot_restore both take them
// (a restore never takes them from the snapshot).
type hostArgs struct {
	Network  string      `json:"network,omitempty" jsonschema:"none (the default: no network interface), public-only (the internet, not the host's or private networks), allow-all or deny-all"`
	Allow    []string    `json:"allow,omitempty" jsonschema:"with a network: destinations to allow (CIDR, IP, [udp/]HOST[:PORT[-PORT]], DOMAIN or *.DOMAIN)"`
	Deny     []string    `json:"deny,omitempty" jsonschema:"with a network: destinations to deny, as allow; deny beats allow"`
	Shares   []shareArg  `json:"shares,omitempty" jsonschema:"host directories shared into the guest"`
	Volumes  []volumeArg `json:"volumes,omitempty" jsonschema:"named volumes mounted into the guest: shared with the other sandboxes that mount them, kept after this one ends, bounded by their quota"`
	Secrets  []secretArg `json:"secrets,omitempty" jsonschema:"API keys the sandbox's code may use but never read: the guest sees a placeholder, and the network swaps the value in on HTTPS requests to the given hosts only (needs a network); the values come from the server's environment"`
	Mailbox  []string    `json:"mailbox,omitempty" jsonschema:"mailbox topics the sandbox may publish to and subscribe to from inside (capsa mailbox ...): a topic, or PREFIX* for every topic starting with PREFIX"`
	KV       []string    `json:"kv,omitempty" jsonschema:"key prefixes of the shared key-value store the sandbox may read and change from inside (capsa kv ...)"`
	Limits   string      `json:"limits,omitempty" jsonschema:"I/O limits as capsa run --limit takes them, KEY=RATE[:BURST] comma separated: net, net-rx, net-tx (bytes a second: 10MB, 512KiB), net-pps, disk, disk-iops, share; a guest past one is slowed, never failed"`
	CPUQuota float64     `json:"cpu_quota,omitempty" jsonschema:"the most host CPUs the sandbox may use, its vCPUs and its VMM's own threads together (e.g. 0.5); default: its vCPU count"`
	// EgressProxy is E2B's network.egressProxy, as capsa run
	// --egress-proxy takes it.
	EgressProxy *egressProxyArg `json:"egress_proxy,omitempty" jsonschema:"with a network: a SOCKS5 proxy all the sandbox's outbound TCP goes through, after the allow and deny rules (UDP and DNS go straight out; no proxy reached, no connection)"`
}

// egressProxyArg is a SOCKS5 proxy for a sandbox's outbound TCP. Its
// password, like a secret's value, comes from the server's environment,
// never from the agent.
type egressProxyArg struct {
	Address     string `json:"address" jsonschema:"HOST:PORT of the SOCKS5 proxy; it must be on a public address unless the server allows private ones (capsa mcp --private-egress-proxy)"`
	Username    string `json:"username,omitempty" jsonschema:"the proxy's username, if it asks for one"`
	PasswordEnv string `json:"password_env,omitempty" jsonschema:"the server's environment variable holding the proxy's password (with username; it must be one the server allows: capsa mcp --secret-env)"`
}

type createResult struct {
	Name  string `json:"name" jsonschema:"the sandbox's name, for the other tools"`
	State string `json:"state"`
}

type listArgs struct {
	All bool `json:"all,omitempty" jsonschema:"list the sandboxes that ended too"`
}

type sandboxRow struct {
	Name          string `json:"name"`
	State         string `json:"state" jsonschema:"created, creating, running, paused, suspended (on disk), exited or crashed"`
	Command       string `json:"command" jsonschema:"the image and arguments, or the main process"`
	CPUs          int    `json:"cpus"`
	MemoryMiB     int    `json:"memory_mib"`
	UptimeSeconds int64  `json:"uptime_seconds,omitempty"`
	ExitCode      *int   `json:"exit_code,omitempty" jsonschema:"the main process's, once it ended"`
	Reason        string `json:"reason,omitempty" jsonschema:"why it ended"`
}

type listResult struct {
	Sandboxes []sandboxRow `json:"sandboxes"`
}

type nameArgs struct {
	Name string `json:"name" jsonschema:"the sandbox's name"`
}

type suspendArgs struct {
	Name          string `json:"name" jsonschema:"the sandbox's name"`
	WithoutMemory bool   `json:"without_memory,omitempty" jsonschema:"keep an image sandbox's disk alone, not its memory: much faster and smaller, and sandbox_resume boots it again (its files kept, its processes started afresh)"`
}

type stateResult struct {
	Name  string `json:"name"`
	State string `json:"state" jsonschema:"the sandbox's state now: suspended, or running"`
}

type networkArgs struct {
	Name    string   `json:"name" jsonschema:"the sandbox's name"`
	Network string   `json:"network" jsonschema:"the new policy, replacing the one it has: public-only (the internet, not the host's or private networks), allow-all or deny-all"`
	Allow   []string `json:"allow,omitempty" jsonschema:"destinations to allow (CIDR, IP, [udp/]HOST[:PORT[-PORT]], DOMAIN or *.DOMAIN)"`
	Deny    []string `json:"deny,omitempty" jsonschema:"destinations to deny, as allow; deny beats allow"`
	// EgressProxy replaces the sandbox's proxy; absent, it keeps it.
	EgressProxy *egressProxyArg `json:"egress_proxy,omitempty" jsonschema:"a SOCKS5 proxy for the sandbox's outbound TCP from now on, replacing the one it has (address none: straight out); absent: the proxy it has stays"`
}

type networkResult struct {
	Name        string `json:"name"`
	Network     string `json:"network" jsonschema:"the policy now in force"`
	EgressProxy string `json:"egress_proxy,omitempty" jsonschema:"the proxy now in force, if sandbox_network was given one: its address, or none"`
}

type destroyResult struct {
	Name      string `json:"name"`
	Destroyed bool   `json:"destroyed"`
}

// registerSandboxTools adds sandbox_create, sandbox_list, sandbox_suspend,
// sandbox_resume, sandbox_network and sandbox_destroy.
func registerSandboxTools(s *sdk.Server, t *tools) {
	addTool(s, t, &sdk.Tool{Name: "sandbox_create", Title: "Create a sandbox",
		Description: "Start a sandbox: a microVM with its own kernel, running until sandbox_destroy or its TTL. Returns its name. Booting takes about a second; pulling an image the first time takes longer.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false), OpenWorldHint: boolPtr(true)},
	}, t.create)
	addTool(s, t, &sdk.Tool{Name: "sandbox_list", Title: "List sandboxes",
		Description: "List the detached sandboxes (running ones; with all, the ended ones too): the agent's and any other started with capsa run -d.",
		Annotations: &sdk.ToolAnnotations{ReadOnlyHint: true},
	}, t.list)
	addTool(s, t, &sdk.Tool{Name: "sandbox_suspend", Title: "Suspend a sandbox to disk",
		Description: "Write a sandbox to disk and end its VM: it holds no memory until sandbox_resume, which brings it back with its files, memory and running processes (with without_memory, an image sandbox's disk alone is kept and the resume boots it again). Refused for a sandbox with disks.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false)},
	}, t.suspend)
	addTool(s, t, &sdk.Tool{Name: "sandbox_resume", Title: "Resume a sandbox",
		Description: "Run a suspended sandbox again (restored from disk, its processes going on where they were), or a paused one.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false)},
	}, t.resume)
	addTool(s, t, &sdk.Tool{Name: "sandbox_network", Title: "Change a sandbox's network policy",
		Description: "Replace the network policy of a sandbox made with a network, and with egress_proxy its SOCKS5 proxy: at once for every new connection and DNS query (connections already open go on), and for its next resume. It cannot give a network to a sandbox made without one.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false), IdempotentHint: true, OpenWorldHint: boolPtr(true)},
	}, t.network)
	addTool(s, t, &sdk.Tool{Name: "sandbox_destroy", Title: "Destroy a sandbox",
		Description: "Kill a sandbox if it runs and remove it with everything in it (files written inside are gone).",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(true), IdempotentHint: true},
	}, t.destroy)
}

// create builds the sandbox's Spec with the sandbox builder, as capsa run
// does (so bad arguments get the builder's errors), and starts it through
// the manager (Manager.Launch), as capsa run -d does.
func (t *tools) create(ctx context.Context, a createArgs) (createResult, error) {
	if a.Name != "" {
		if err := supervisor.CheckName(a.Name); err != nil {
			return createResult{}, err
		}
	}
	if a.TTLSeconds < 0 || a.TTLSeconds > maxLifetime {
		return createResult{}, fmt.Errorf("ttl_seconds %d: want 0 to %d", a.TTLSeconds, maxLifetime)
	}
	if a.IdleTimeoutSeconds < 0 || a.IdleTimeoutSeconds > maxLifetime {
		return createResult{}, fmt.Errorf("idle_timeout_seconds %d: want 0 to %d", a.IdleTimeoutSeconds, maxLifetime)
	}
	b := sandbox.New().Env(a.Env...).Watchdog(watchdog)
	if a.CPUs != 0 {
		b.CPUs(a.CPUs)
	}
	if a.MemoryMiB != 0 {
		b.Memory(a.MemoryMiB)
	}
	if err := t.applyHost(ctx, b, a.hostArgs); err != nil {
		return createResult{}, err
	}
	var w *sandbox.Workload
	switch {
	case a.Image != "" && len(a.Command) == 0:
		w = b.Entrypoint(keepAlive...).OCI(a.Image)
	case a.Image != "":
		w = b.Entrypoint(a.Command...).OCI(a.Image)
	case len(a.Command) == 0:
		w = b.Run(keepAlive[0], keepAlive[1:]...)
	default:
		w = b.Run(a.Command[0], a.Command[1:]...)
	}
	spec, err := w.Spec()
	if err != nil {
		return createResult{}, err
	}
	rec := &supervisor.Record{Name: a.Name, Spec: spec,
		TTL: time.Duration(a.TTLSeconds) * time.Second, IdleTimeout: time.Duration(a.IdleTimeoutSeconds) * time.Second}
	name, err := t.m.Launch(ctx, rec, w.SecretValues())
	if err != nil {
		return createResult{}, failedLaunch(name, err)
	}
	return createResult{Name: name, State: string(supervisor.Running)}, nil
}

// applyHost gives b the host-facing settings a asks for, within what
// this server allows (its share roots, secret variables and egress
// proxies).
func (t *tools) applyHost(ctx context.Context, b *sandbox.Builder, a hostArgs) error {
	switch {
	case a.Network != "" && a.Network != "none":
		policy, err := netstack.ParsePolicy(a.Network, a.Allow, a.Deny)
		if err != nil {
			return fmt.Errorf("network: %w", err)
		}
		b.Network(policy)
	case len(a.Allow) > 0 || len(a.Deny) > 0:
		return errors.New("allow and deny need a network (network: public-only, allow-all or deny-all)")
	}
	for _, sh := range a.Shares {
		// Relative to what? The server's working directory is the
		// client's choice, not the agent's.
		if !filepath.IsAbs(sh.Host) {
			return fmt.Errorf("shares: host %q: want an absolute host path", sh.Host)
		}
		if err := t.mayShare(sh.Host); err != nil {
			return err
		}
		mode := sandbox.ReadWrite
		if sh.ReadOnly {
			mode = sandbox.ReadOnly
		}
		b.Share(sh.Host, sh.Guest, mode)
	}
	for _, v := range a.Volumes {
		mode := sandbox.ReadWrite
		if v.ReadOnly {
			mode = sandbox.ReadOnly
		}
		b.Volume(v.Name, v.Guest, mode)
	}
	for _, sec := range a.Secrets {
		env := sec.Env
		if env == "" {
			env = sec.Name
		}
		if !t.secretEnv[env] {
			return fmt.Errorf("secrets: %s: this server may not use its environment variable %s as a secret (capsa mcp --secret-env %s allows it)", sec.Name, env, env)
		}
		value, ok := os.LookupEnv(env)
		if !ok || value == "" {
			return fmt.Errorf("secrets: %s: the capsa mcp server's environment has no %s (set it where the server starts, e.g. in the MCP client's server config)", sec.Name, env)
		}
		b.Secret(sec.Name, value, sec.Hosts...)
	}
	b.Mailbox(a.Mailbox...).KV(a.KV...)
	if a.Limits != "" {
		b.LimitString(a.Limits)
	}
	if a.CPUQuota != 0 {
		b.CPUQuota(a.CPUQuota)
	}
	if a.EgressProxy != nil {
		if a.Network == "" || a.Network == "none" {
			return errors.New("egress_proxy needs a network (network: public-only, allow-all or deny-all)")
		}
		p, err := t.egressProxy(ctx, *a.EgressProxy)
		if err != nil {
			return err
		}
		b.EgressProxy(*p)
	}
	return nil
}

// egressProxy checks an egress proxy an agent asks for, as capsa serve
// does E2B's: its form, its password's variable (one the server allows,
// set), and unless the server allows private proxies, that its address
// resolves now to public ones only (it must at every dial too).
func (t *tools) egressProxy(ctx context.Context, a egressProxyArg) (*sandbox.EgressProxy, error) {
	p := &sandbox.EgressProxy{Address: a.Address, Username: a.Username, PublicOnly: !t.privateProxy}
	if a.PasswordEnv != "" {
		if !t.secretEnv[a.PasswordEnv] {
			return nil, fmt.Errorf("egress_proxy: password_env: this server may not use its environment variable %s (capsa mcp --secret-env %s allows it)", a.PasswordEnv, a.PasswordEnv)
		}
		v, ok := os.LookupEnv(a.PasswordEnv)
		if !ok || v == "" {
			return nil, fmt.Errorf("egress_proxy: password_env: the capsa mcp server's environment has no %s", a.PasswordEnv)
		}
		p.Password = v
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := sandbox.CheckEgressProxy(ctx, *p); err != nil {
		msg := err.Error()
		if p.PublicOnly && errors.Is(err, sandbox.ErrNonPublicProxy) {
			msg += " (capsa mcp --private-egress-proxy allows one)"
		}
		return nil, fmt.Errorf("egress_proxy: %s", msg)
	}
	return p, nil
}

// failedLaunch says, of a sandbox that was recorded but did not start,
// that its record stays (as capsa run -d's does) until sandbox_destroy.
func failedLaunch(name string, err error) error {
	if name == "" {
		return err
	}
	return fmt.Errorf("%w (its record %s stays, for capsa ps -a; sandbox_destroy removes it)", err, name)
}

func (t *tools) list(ctx context.Context, a listArgs) (listResult, error) {
	recs, err := t.m.List()
	if err != nil {
		return listResult{}, err
	}
	res := listResult{Sandboxes: []sandboxRow{}}
	for _, r := range recs {
		if !a.All && !r.Live() {
			continue
		}
		row := sandboxRow{Name: r.Name, State: string(r.State), Command: supervisor.CommandLine(r.Spec),
			CPUs: r.Spec.CPUs, MemoryMiB: r.Spec.MemoryMiB, ExitCode: r.ExitCode, Reason: r.Reason}
		if (r.State == supervisor.Running || r.State == supervisor.Paused) && !r.Started.IsZero() {
			row.UptimeSeconds = int64(time.Since(r.Started).Seconds())
		}
		res.Sandboxes = append(res.Sandboxes, row)
	}
	return res, nil
}

func (t *tools) suspend(ctx context.Context, a suspendArgs) (stateResult, error) {
	suspend := t.m.Suspend
	if a.WithoutMemory {
		suspend = t.m.SuspendWithoutMemory
	}
	if err := suspend(ctx, a.Name); err != nil {
		return stateResult{}, err
	}
	return stateResult{Name: a.Name, State: string(supervisor.Suspended)}, nil
}

func (t *tools) resume(ctx context.Context, a nameArgs) (stateResult, error) {
	if err := t.m.Resume(ctx, a.Name); err != nil {
		return stateResult{}, err
	}
	return stateResult{Name: a.Name, State: string(supervisor.Running)}, nil
}

// network replaces a sandbox's network policy, as capsa update --net
// does.
func (t *tools) network(ctx context.Context, a networkArgs) (networkResult, error) {
	if a.Network == "" || a.Network == "none" {
		return networkResult{}, errors.New("network: public-only, allow-all or deny-all (a sandbox's network cannot be removed; deny-all without allow rules shuts it)")
	}
	policy, err := netstack.ParsePolicy(a.Network, a.Allow, a.Deny)
	if err != nil {
		return networkResult{}, fmt.Errorf("network: %w", err)
	}
	res := networkResult{Name: a.Name, Network: policy.String()}
	u := supervisor.NetworkUpdate{Policy: policy}
	if a.EgressProxy != nil {
		u.SetProxy, res.EgressProxy = true, "none"
		if a.EgressProxy.Address != "none" {
			if u.Proxy, err = t.egressProxy(ctx, *a.EgressProxy); err != nil {
				return networkResult{}, err
			}
			res.EgressProxy = u.Proxy.Address
		}
	}
	if err := t.m.UpdateNetwork(ctx, a.Name, u); err != nil {
		return networkResult{}, err
	}
	return res, nil
}

func (t *tools) destroy(ctx context.Context, a nameArgs) (destroyResult, error) {
	if err := t.m.Remove(ctx, a.Name); err != nil {
		return destroyResult{}, err
	}
	return destroyResult{Name: a.Name, Destroyed: true}, nil
}

// mayShare refuses a host directory that is not under one of the
// server's share roots, symlinks resolved (a link inside a root that
// leads out of it is refused).
func (t *tools) mayShare(host string) error {
	if len(t.shareRoots) == 0 {
		return fmt.Errorf("shares: host %q: this server shares no host directory (capsa mcp --share-root DIR allows those under DIR)", host)
	}
	real, err := filepath.EvalSymlinks(host)
	if err != nil {
		return fmt.Errorf("shares: host %q: %w", host, err)
	}
	for _, root := range t.shareRoots {
		if rel, err := filepath.Rel(root, real); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			return nil
		}
	}
	return fmt.Errorf("shares: host %q: not under a share root of this server (%s)", host, strings.Join(t.shareRoots, ", "))
}
