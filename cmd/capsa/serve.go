package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"text/tabwriter"
	"time"

	"github.com/capsa-sandbox/capsa/e2b"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// runServe is `capsa serve`: E2B's API (package e2b) on one listener, and
// `capsa serve key` for its API keys.
func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "key" {
		return runServeKey(args[1:], stdout, stderr)
	}
	fs := newFlags("serve", "[--listen ADDR] [--default-template IMAGE] [--tls-cert FILE --tls-key FILE]\n       capsa serve key create [--name NAME] [--all] | ls | rm ID|NAME", stdout)
	listen := fs.String("listen", "127.0.0.1:3000", "the address to serve E2B's control API and every sandbox's envd API on (anything but loopback needs --tls-cert and --tls-key)")
	base := fs.String("default-template", "", "the OCI image the template \"base\" means (default: capsa's built-in Linux)")
	domain := fs.String("domain", "", "the domain clients are told the sandboxes are under (PORT-ID.DOMAIN); default: none, for clients given E2B_SANDBOX_URL")
	perKey := fs.Int("max-sandboxes-per-key", e2b.DefaultMaxSandboxesPerKey, "the most sandboxes one API key may have running at once (past it: 429)")
	volSize := fs.String("volume-size", "1G", "each API volume's quota (Volume.create), e.g. 512M, 10G")
	cert := fs.String("tls-cert", "", "serve HTTPS with this certificate (PEM)")
	key := fs.String("tls-key", "", "the certificate's private key (PEM)")
	dns := fs.String("dns-server", "", "resolve every sandbox's DNS queries through this IP:PORT instead of the host's resolver")
	privateProxy := fs.Bool("private-egress-proxy", false, "let a sandbox's egress proxy (network.egressProxy) be on a loopback or private address: one on the host's own network (without it, as on E2B's cloud, it must be public, so API callers cannot aim sandboxes' traffic at the host's services)")
	upstreamCAs := fs.StringArray("tls-upstream-ca", nil, "for sandboxes with header rules (network.rules), trust this PEM file's CAs for the real servers too, beside the host's (repeatable)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 0 {
		fmt.Fprintln(stderr, "capsa serve: takes no arguments (see `capsa serve --help`)")
		return 2
	}
	if (*cert == "") != (*key == "") {
		fmt.Fprintln(stderr, "capsa serve: --tls-cert and --tls-key go together")
		return 2
	}
	if *perKey <= 0 {
		fmt.Fprintf(stderr, "capsa serve: --max-sandboxes-per-key %d: want at least 1\n", *perKey)
		return 2
	}
	volQuota, err := parseSize(*volSize)
	if err != nil || volQuota < 1<<20 {
		fmt.Fprintf(stderr, "capsa serve: --volume-size %s: want a size of at least 1M (%v)\n", *volSize, err)
		return 2
	}
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve: --listen %s: %v\n", *listen, err)
		return 2
	}
	loopback := host == "localhost"
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		loopback = true
	}
	if !loopback && *cert == "" {
		fmt.Fprintf(stderr, "capsa serve: --listen %s is not a loopback address: API keys and sandbox tokens would cross the network in clear; give --tls-cert and --tls-key\n", *listen)
		return 2
	}
	var tlsConfig *tls.Config
	if *cert != "" {
		pair, err := tls.LoadX509KeyPair(*cert, *key)
		if err != nil {
			fmt.Fprintf(stderr, "capsa serve: --tls-cert %s, --tls-key %s: %v\n", *cert, *key, err)
			return 2
		}
		tlsConfig = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	}
	m, err := supervisor.OpenManager("")
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve: %v\n", err)
		return 1
	}
	keys, err := e2b.OpenKeys(m.Dir())
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve: %v\n", err)
		return 1
	}
	templates, err := e2b.OpenTemplates(m.Dir())
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve: %v\n", err)
		return 1
	}
	level := slog.LevelInfo
	if os.Getenv("CAPSA_DEBUG") != "" {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	srv, err := e2b.New(e2b.Options{Manager: m, Keys: keys, Templates: templates, Log: log, DefaultTemplate: *base, Domain: *domain, MaxSandboxesPerKey: *perKey, VolumeQuota: int64(volQuota),
		DNSServer: *dns, UpstreamCAs: *upstreamCAs, PrivateEgressProxy: *privateProxy})
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve: %v\n", err)
		return 1
	}
	defer srv.Close()
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve: %v\n", err)
		return 1
	}
	scheme := "http"
	if tlsConfig != nil {
		scheme = "https"
		l = tls.NewListener(l, tlsConfig)
	}
	if !loopback {
		fmt.Fprintf(stderr, "capsa serve: WARNING: serving on %s, beyond this machine: anyone who reaches it with an API key runs sandboxes here\n", l.Addr())
	}
	if ks, _ := keys.List(); len(ks) == 0 {
		fmt.Fprintln(stderr, "capsa serve: no API key yet: `capsa serve key create` makes one")
	}
	fmt.Fprintf(stderr, "capsa serve: E2B API at %s://%s (E2B_API_URL and E2B_SANDBOX_URL), envd version %s\n", scheme, l.Addr(), e2b.EnvdVersion)
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second, MaxHeaderBytes: 64 << 10,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		hs.Shutdown(sctx)
	}()
	if err := hs.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintf(stderr, "capsa serve: %v\n", err)
		return 1
	}
	return 0
}

// runServeKey is `capsa serve key create|ls|rm`.
func runServeKey(args []string, stdout, stderr io.Writer) int {
	usage := "capsa serve key create [--name NAME] [--all] | ls | rm ID|NAME"
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: "+usage)
		return 2
	}
	m, err := supervisor.OpenManager("")
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve key: %v\n", err)
		return 1
	}
	keys, err := e2b.OpenKeys(m.Dir())
	if err != nil {
		fmt.Fprintf(stderr, "capsa serve key: %v\n", err)
		return 1
	}
	switch args[0] {
	case "create":
		fs := newFlags("serve key create", "[--name NAME] [--all]", stdout)
		name := fs.String("name", "", "a name for the key, to tell keys apart")
		all := fs.Bool("all", false, "the key reaches every sandbox and snapshot of the state directory (those capsa run -d made too), not only those made with it")
		if code := parseFlags(fs, args[1:], stderr); code >= 0 {
			return code
		}
		if fs.NArg() != 0 {
			fmt.Fprintln(stderr, "capsa serve key create: takes no arguments")
			return 2
		}
		secret, _, err := keys.Create(*name, *all)
		if err != nil {
			fmt.Fprintf(stderr, "capsa serve key create: %v\n", err)
			return 1
		}
		// The key is shown once: only its hash is kept.
		fmt.Fprintln(stdout, secret)
		return 0
	case "ls":
		if len(args) != 1 {
			fmt.Fprintln(stderr, "capsa serve key ls: takes no arguments")
			return 2
		}
		list, err := keys.List()
		if err != nil {
			fmt.Fprintf(stderr, "capsa serve key ls: %v\n", err)
			return 1
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tNAME\tKEY\tREACHES\tCREATED")
		for _, k := range list {
			reach := "its own"
			if k.All {
				reach = "all"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s…\t%s\t%s\n", k.ID, k.Name, k.Prefix, reach, k.Created.Format(time.RFC3339))
		}
		tw.Flush()
		return 0
	case "rm":
		if len(args) != 2 {
			fmt.Fprintln(stderr, "usage: capsa serve key rm ID|NAME")
			return 2
		}
		if err := keys.Remove(args[1]); err != nil {
			fmt.Fprintf(stderr, "capsa serve key rm: %v\n", err)
			return 1
		}
		return 0
	}
	fmt.Fprintf(stderr, "capsa serve key: unknown subcommand %q (usage: %s)\n", args[0], usage)
	return 2
}
