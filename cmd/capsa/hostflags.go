package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
)

// egressProxyPasswordEnv holds --egress-proxy's password: kept off the
// command line, where every process of the host can read it.
const egressProxyPasswordEnv = "CAPSA_EGRESS_PROXY_PASSWORD"

// parseEgressProxy reads --egress-proxy's [USER@]HOST:PORT, the password
// from egressProxyPasswordEnv when a USER is given.
func parseEgressProxy(spec string) (*sandbox.EgressProxy, error) {
	p := sandbox.EgressProxy{Address: spec}
	// At the last @: a username may hold one (me@example.com@HOST:PORT).
	if i := strings.LastIndex(spec, "@"); i >= 0 {
		user, addr := spec[:i], spec[i+1:]
		if user == "" {
			return nil, fmt.Errorf("--egress-proxy %s: an empty USER before @", spec)
		}
		p.Username, p.Address = user, addr
		p.Password = os.Getenv(egressProxyPasswordEnv)
	}
	if err := p.Check(); err != nil {
		return nil, fmt.Errorf("--egress-proxy: %v", err)
	}
	return &p, nil
}

// hostFlags are a sandbox's host-facing settings on the command line: the
// host directories, volumes and network it may reach, its grants in the
// hub, its limits. capsa run and create take them, and so does capsa
// snapshot restore: a restore never takes them from the snapshot.
type hostFlags struct {
	volumes, allow, deny, publish, mailbox, kv, limits *[]string
	netMode, dnsServer, egressProxy, shareFS           *string
	cpuQuota                                           *float64
	secrets                                            *secretFlags
}

func addHostFlags(fs *pflag.FlagSet) *hostFlags {
	h := &hostFlags{
		limits:   fs.StringArray("limit", nil, "I/O limits, KEY=RATE[:BURST] comma separated (repeatable): net, net-rx, net-tx (bytes a second: 10MB, 512KiB), net-pps, net-rx-pps, net-tx-pps, disk (each disk, the image's root included), disk-iops, share (each share); see capsa update"),
		cpuQuota: fs.Float64("cpu-quota", 0, "the most host CPUs the sandbox may use, vCPUs and the VMM's own threads together (e.g. 0.5, 2); default: --cpus"),
		volumes:  fs.StringArrayP("volume", "v", nil, "share a host directory, HOST:GUEST[:ro], or mount a named volume (capsa volume create), NAME:GUEST[:ro]; a NAME has no slash (repeatable)"),
		shareFS:  fs.String("share-fs", "9p", "how -v host directories reach the guest: 9p, or virtiofs (fewer round trips a call, renameat2's flags; no snapshot or fork yet)"),
		netMode:  fs.String("net", "none", "network: none (no NIC), public-only, allow-all or deny-all; --net alone is public-only"),
	}
	fs.Lookup("net").NoOptDefVal = "public-only"
	h.allow = fs.StringArray("allow", nil, "allow destinations: CIDR, IP, [udp/]HOST[:PORT[-PORT]], DOMAIN or *.DOMAIN (repeatable)")
	h.deny = fs.StringArray("deny", nil, "deny destinations, same syntax as --allow; deny beats allow (repeatable)")
	h.publish = fs.StringArrayP("publish", "p", nil, "publish a guest port: [HOSTIP:]HOSTPORT:GUESTPORT[/udp], on 127.0.0.1 by default (repeatable)")
	h.dnsServer = fs.String("dns-server", "", "resolve the guest's DNS queries through this IP:PORT instead of the host's resolver")
	h.egressProxy = fs.String("egress-proxy", "", "tunnel the guest's outbound TCP through this SOCKS5 proxy, [USER@]HOST:PORT, after --allow and --deny (UDP goes out directly; a connection the proxy refuses fails, never goes direct); the password, if any, from $"+egressProxyPasswordEnv)
	h.secrets = addSecretFlags(fs)
	h.mailbox = fs.StringArray("mailbox", nil, "let the guest publish and subscribe to this mailbox topic, or to every topic starting with PREFIX given as PREFIX* (repeatable; inside: capsa mailbox)")
	h.kv = fs.StringArray("kv", nil, "let the guest read and change the keys starting with this prefix in the key-value store (repeatable; inside: capsa kv)")
	return h
}

// apply gives b the settings; an error names the flag. detach says the
// sandbox runs detached (where --net-log has no place).
func (h *hostFlags) apply(fs *pflag.FlagSet, b *sandbox.Builder, detach bool) error {
	if fs.Changed("cpu-quota") {
		if !(*h.cpuQuota >= 0.01 && *h.cpuQuota <= sandbox.MaxCPUQuota) {
			return fmt.Errorf("--cpu-quota %g: must be between 0.01 and %d CPUs", *h.cpuQuota, sandbox.MaxCPUQuota)
		}
		b.CPUQuota(*h.cpuQuota)
	}
	for _, l := range *h.limits {
		b.LimitString(l)
	}
	switch {
	case *h.netMode != "none":
		policy, err := netstack.ParsePolicy(*h.netMode, *h.allow, *h.deny)
		if err != nil {
			return fmt.Errorf("--net: %v", err)
		}
		b.Network(policy)
	case len(*h.allow) > 0 || len(*h.deny) > 0 || len(*h.publish) > 0 || *h.dnsServer != "" || *h.egressProxy != "":
		return fmt.Errorf("--allow, --deny, --publish, --dns-server and --egress-proxy need a network: add --net")
	}
	if *h.egressProxy != "" {
		p, err := parseEgressProxy(*h.egressProxy)
		if err != nil {
			return err
		}
		b.EgressProxy(*p)
	}
	for _, p := range *h.publish {
		b.Publish(p)
	}
	if *h.dnsServer != "" {
		b.DNSServer(*h.dnsServer)
	}
	if h.secrets.used() {
		switch {
		case *h.netMode == "none":
			return fmt.Errorf("--secret, --tls-intercept, --net-log and the other secret flags need a network: add --net")
		case detach && *h.secrets.netLog != "":
			return fmt.Errorf("--net-log and -d do not go together: see capsa logs --net")
		}
		if err := h.secrets.apply(b); err != nil {
			return err
		}
	}
	for _, v := range *h.volumes {
		host, guest, mode, err := sandbox.ParseShare(v)
		if err != nil {
			return fmt.Errorf("-v: %v", err)
		}
		if strings.Contains(host, "/") {
			b.Share(host, guest, mode)
		} else {
			b.Volume(host, guest, mode)
		}
	}
	b.ShareFS(*h.shareFS)
	b.Mailbox(*h.mailbox...).KV(*h.kv...)
	return nil
}
