package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/capsa-sandbox/capsa/hub"
	"github.com/capsa-sandbox/capsa/hub/proto"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// runKV is capsa kv: the host's key-value store, which sandboxes reach
// with --kv.
func runKV(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runHub(ctx, "kv", args, stdout, stderr)
}

// runMailbox is capsa mailbox: the host's mailbox, which sandboxes reach
// with --mailbox.
func runMailbox(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runHub(ctx, "mailbox", args, stdout, stderr)
}

// runHub runs a kv or mailbox verb as the host: every key and topic, no
// limits, "host" as the sender.
func runHub(ctx context.Context, group string, args []string, stdout, stderr io.Writer) int {
	dir, err := supervisor.DefaultDir()
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", group, err)
		return proto.ExitFailed
	}
	h, err := hub.Open(dir)
	if err != nil {
		fmt.Fprintf(stderr, "capsa %s: %v\n", group, err)
		return proto.ExitFailed
	}
	defer h.Close()
	return proto.RunCLI(ctx, h.As(hub.Grants{Identity: "host", Host: true}), append([]string{group}, args...), os.Stdin, stdout, stderr)
}
