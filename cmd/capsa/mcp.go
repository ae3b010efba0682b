package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/internal/bearer"
	"github.com/capsa-sandbox/capsa/mcp"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// runMCP serves the MCP tools (package mcp) on stdin and stdout, or with
// --listen over streamable HTTP on a loopback address.
func runMCP(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("mcp", "[--listen ADDR] [--share-root DIR]... [--secret-env NAME]... [--private-egress-proxy]", stdout)
	listen := fs.String("listen", "", "serve streamable HTTP at http://ADDR/mcp (a loopback address, e.g. 127.0.0.1:8765) instead of stdio; clients send the bearer token printed at start (or set in CAPSA_MCP_TOKEN)")
	shareRoots := fs.StringArray("share-root", nil, "a host directory under which the tools may share directories into sandboxes (repeatable; none: no host directory is shared)")
	secretEnv := fs.StringArray("secret-env", nil, "an environment variable of this server that the tools may use as a secret's value or an egress proxy's password (repeatable; none: no secrets)")
	privateProxy := fs.Bool("private-egress-proxy", false, "let a sandbox's egress proxy (egress_proxy) be on a loopback or private address: one on the host's own network (without it, it must be public, so an agent cannot aim sandboxes' traffic at the host's services)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 0 {
		fmt.Fprintln(stderr, "capsa mcp: takes no arguments (see `capsa mcp --help`)")
		return 2
	}
	for i, r := range *shareRoots {
		abs, err := filepath.Abs(r)
		if err == nil {
			var fi os.FileInfo
			if fi, err = os.Stat(abs); err == nil && !fi.IsDir() {
				err = errors.New("not a directory")
			}
		}
		if err != nil {
			fmt.Fprintf(stderr, "capsa mcp: --share-root %s: %v\n", r, err)
			return 2
		}
		(*shareRoots)[i] = abs
	}
	for _, e := range *secretEnv {
		if e == "" || strings.ContainsAny(e, "= ") || e == mcp.TokenEnv {
			fmt.Fprintf(stderr, "capsa mcp: --secret-env %q: want the name of an environment variable (not %s, the server's own token)\n", e, mcp.TokenEnv)
			return 2
		}
	}
	m, err := supervisor.OpenManager("")
	if err != nil {
		fmt.Fprintf(stderr, "capsa mcp: %v\n", err)
		return 1
	}
	level := slog.LevelInfo
	if os.Getenv("CAPSA_DEBUG") != "" {
		level = slog.LevelDebug
	}
	// stdout is the protocol's: the log goes to stderr.
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	s := mcp.NewServer(mcp.Options{Manager: m, ShareRoots: *shareRoots, SecretEnv: *secretEnv, PrivateEgressProxy: *privateProxy, Log: log, Version: version})
	if *listen == "" {
		err := s.Run(ctx, &sdk.IOTransport{Reader: os.Stdin, Writer: nopCloser{stdout}})
		if err != nil && ctx.Err() == nil {
			fmt.Fprintf(stderr, "capsa mcp: %v\n", err)
			return 1
		}
		return 0
	}
	l, err := mcp.ListenLoopback(*listen)
	if err != nil {
		fmt.Fprintf(stderr, "capsa mcp: %v\n", err)
		return 2
	}
	token := os.Getenv(mcp.TokenEnv)
	if token == "" {
		token = bearer.NewToken()
		fmt.Fprintf(stderr, "capsa mcp: serving http://%s%s (header Authorization: Bearer %s)\n", l.Addr(), mcp.HTTPPath, token)
	} else {
		fmt.Fprintf(stderr, "capsa mcp: serving http://%s%s (the bearer token is CAPSA_MCP_TOKEN's)\n", l.Addr(), mcp.HTTPPath)
	}
	srv := &http.Server{Handler: mcp.HTTPHandler(s, token, log), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintf(stderr, "capsa mcp: %v\n", err)
		return 1
	}
	return 0
}

// nopCloser is stdout as the transport's writer: closing the session does
// not close it.
type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }
