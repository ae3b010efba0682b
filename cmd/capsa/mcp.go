package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/mcp"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// runMCP serves the MCP tools (package mcp) on stdin and stdout, or with
// --listen over streamable HTTP on a loopback address.
func runMCP(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("mcp", "[--listen ADDR]", stdout)
	listen := fs.String("listen", "", "serve streamable HTTP at http://ADDR/mcp (a loopback address, e.g. 127.0.0.1:8765) instead of stdio; clients send the bearer token printed at start (or set in CAPSA_MCP_TOKEN)")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	if fs.NArg() != 0 {
		fmt.Fprintln(stderr, "capsa mcp: takes no arguments (see `capsa mcp --help`)")
		return 2
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
	s := mcp.NewServer(mcp.Options{Manager: m, Log: log, Version: version})
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
	token := os.Getenv("CAPSA_MCP_TOKEN")
	if token == "" {
		b := make([]byte, 16)
		rand.Read(b)
		token = hex.EncodeToString(b)
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
