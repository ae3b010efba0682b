package mcp

import (
	"context"
	"errors"
	"fmt"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// maxFork bounds the copies one sandbox_fork makes: each is a VM on this
// machine.
const maxFork = 16

type snapshotArgs struct {
	Name     string `json:"name" jsonschema:"the running sandbox to snapshot"`
	Snapshot string `json:"snapshot,omitempty" jsonschema:"the snapshot's name (letters, digits, '_', '.', '-'); default NAME-YYYYMMDD-HHMMSS"`
	Parent   string `json:"parent,omitempty" jsonschema:"an earlier snapshot of the same size to write this one as a layer over: only the memory that differs from it is written, and it must stay while this one is kept"`
}

type snapshotResult struct {
	Snapshot string `json:"snapshot" jsonschema:"the snapshot's name, for snapshot_restore"`
}

type restoreArgs struct {
	Snapshot string `json:"snapshot" jsonschema:"the snapshot's name (from snapshot_create or capsa snapshot ls)"`
	Name     string `json:"name,omitempty" jsonschema:"the restored sandbox's name; default: a new one"`
	// What it may reach comes from here, never from the snapshot: a
	// snapshot with shares or volumes needs them given again, by guest
	// path; its network is deny-all unless given.
	hostArgs
}

type forkArgs struct {
	Name  string `json:"name" jsonschema:"the running sandbox to copy"`
	Count int    `json:"count,omitempty" jsonschema:"how many copies (default 1, at most 16)"`
}

type forkResult struct {
	Names  []string `json:"names" jsonschema:"the copies that run: NAME-1, NAME-2..."`
	Errors []string `json:"errors,omitempty" jsonschema:"why the other copies did not start"`
}

// registerSnapshotTools adds snapshot_create, snapshot_restore and
// sandbox_fork.
func registerSnapshotTools(s *sdk.Server, t *tools) {
	addTool(s, t, &sdk.Tool{Name: "snapshot_create", Title: "Snapshot a sandbox",
		Description: "Save a running sandbox (its memory, devices and processes) as a named snapshot in capsa's state directory; the sandbox runs on.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false)},
	}, t.snapshot)
	addTool(s, t, &sdk.Tool{Name: "snapshot_restore", Title: "Restore a snapshot",
		Description: "Start a new sandbox from a snapshot: its processes go on where they were. What it may reach on the host and the network is given here, as for sandbox_create, never taken from the snapshot: a snapshot of a sandbox with shares or volumes needs them again (same guest paths); without network arguments it reaches nothing. Returns its name.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false)},
	}, t.restore)
	addTool(s, t, &sdk.Tool{Name: "sandbox_fork", Title: "Fork a sandbox",
		Description: "Make running copies of a running sandbox, each with its own memory, files, hostname and random numbers, named NAME-1, NAME-2...",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(false)},
	}, t.fork)
}

func (t *tools) snapshot(ctx context.Context, a snapshotArgs) (snapshotResult, error) {
	snap, err := t.m.SaveSnapshot(ctx, a.Name, a.Snapshot, a.Parent, progress(ctx))
	if err != nil {
		return snapshotResult{}, err
	}
	return snapshotResult{Snapshot: snap}, nil
}

func (t *tools) restore(ctx context.Context, a restoreArgs) (createResult, error) {
	b := sandbox.New()
	if err := t.applyHost(ctx, b, a.hostArgs); err != nil {
		return createResult{}, err
	}
	settings, secrets, err := b.Settings()
	if err != nil {
		return createResult{}, err
	}
	name, err := t.m.Restore(ctx, a.Snapshot, a.Name, "", false, settings, secrets)
	if err != nil {
		return createResult{}, failedLaunch(name, err)
	}
	return createResult{Name: name, State: string(supervisor.Running)}, nil
}

func (t *tools) fork(ctx context.Context, a forkArgs) (forkResult, error) {
	count := a.Count
	if count == 0 {
		count = 1
	}
	if count < 1 || count > maxFork {
		return forkResult{}, fmt.Errorf("count %d: want 1 to %d", a.Count, maxFork)
	}
	names, errs, err := t.m.Fork(ctx, a.Name, count, progress(ctx))
	if err != nil {
		return forkResult{}, err
	}
	res := forkResult{Names: []string{}}
	for i, n := range names {
		if errs[i] != nil {
			res.Errors = append(res.Errors, errs[i].Error())
		} else {
			res.Names = append(res.Names, n)
		}
	}
	if len(res.Names) == 0 {
		return forkResult{}, errors.Join(errs...)
	}
	return res, nil
}
