package e2b

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/e2b/envd/filesystem"
	"github.com/capsa-sandbox/capsa/e2b/envd/filesystem/filesystemconnect"
)

// filesystemService is envd's filesystem.Filesystem over a sandbox's agent.
type filesystemService struct {
	s *Server

	mu       sync.Mutex
	watchers map[string]*pollWatcher // the polling watchers, by ID
}

var _ filesystemconnect.FilesystemHandler = (*filesystemService)(nil)

// Bounds on the file system's answers.
const (
	maxListEntries  = 100_000 // one ListDir's, at every depth
	maxListDepth    = 64
	maxPollWatchers = 256 // polling watchers, all sandboxes together
	maxPollEvents   = 4096
	pollWatcherIdle = 10 * time.Minute // a polling watcher nobody asks goes
)

// fsError turns an agent's error into the Connect error the SDKs expect
// (not_found for a missing file, already_exists, ...).
func fsError(op, p string, err error) error {
	code := connect.CodeInternal
	switch {
	case errors.Is(err, fs.ErrNotExist):
		code = connect.CodeNotFound
	case errors.Is(err, fs.ErrExist):
		code = connect.CodeAlreadyExists
	case errors.Is(err, fs.ErrPermission):
		code = connect.CodePermissionDenied
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ENOTEMPTY):
		code = connect.CodeInvalidArgument
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		code = connect.CodeResourceExhausted
	case errors.Is(err, agent.ErrUnsupported):
		code = connect.CodeUnimplemented
	}
	return connect.NewError(code, fmt.Errorf("%s %s: %w", op, p, err))
}

// entryInfo describes a guest file as envd does.
func entryInfo(p string, fi *agent.FileInfo) *filesystem.EntryInfo {
	mode := fs.FileMode(fi.Mode)
	e := &filesystem.EntryInfo{
		Name:         fi.Name,
		Path:         p,
		Size:         fi.Size,
		Mode:         uint32(mode.Perm()),
		Permissions:  mode.String(),
		Owner:        fi.Owner,
		Group:        fi.Group,
		ModifiedTime: timestamppb.New(time.Unix(0, fi.ModTimeNs)),
	}
	for k, v := range fi.Xattrs {
		if name, ok := strings.CutPrefix(k, xattrMeta); ok {
			if e.Metadata == nil {
				e.Metadata = map[string]string{}
			}
			e.Metadata[name] = v
		}
	}
	if e.Owner == "" {
		e.Owner = fmt.Sprint(fi.UID)
	}
	if e.Group == "" {
		e.Group = fmt.Sprint(fi.GID)
	}
	switch {
	case fi.IsSymlink:
		e.Type = filesystem.FileType_FILE_TYPE_SYMLINK
		t := fi.Target
		e.SymlinkTarget = &t
	case fi.IsDir:
		e.Type = filesystem.FileType_FILE_TYPE_DIRECTORY
	default:
		e.Type = filesystem.FileType_FILE_TYPE_FILE
	}
	return e
}

// userOf is the user a file system request acts for (its Authorization
// header), who relative paths are relative to.
func userOf(ctx context.Context, g *guest, header string) (guestUser, error) {
	name, err := basicUser(header)
	if err != nil {
		return guestUser{}, connect.NewError(connect.CodeUnauthenticated, err)
	}
	u, err := g.user(ctx, name)
	if err != nil {
		return guestUser{}, connect.NewError(connect.CodeInvalidArgument, err)
	}
	return u, nil
}

// xattrMeta prefixes, among a file's user extended attributes, those that
// hold its E2B metadata (files.write's metadata: user.e2b.KEY).
const xattrMeta = "e2b."

// stat describes p, with its metadata (an agent too old to read extended
// attributes gives none).
func stat(ctx context.Context, g *guest, p string) (*filesystem.EntryInfo, error) {
	fi, err := g.h.StatXattrs(ctx, p)
	if errors.Is(err, agent.ErrUnsupported) {
		fi, err = g.h.Stat(ctx, p)
	}
	if err != nil {
		return nil, fsError("stat", p, err)
	}
	return entryInfo(p, fi), nil
}

// listDir lists dir with each entry's metadata, as stat describes.
func listDir(ctx context.Context, g *guest, dir string) ([]agent.FileInfo, error) {
	ents, err := g.h.ListDirXattrs(ctx, dir)
	if errors.Is(err, agent.ErrUnsupported) {
		ents, err = g.h.ListDir(ctx, dir)
	}
	return ents, err
}

func (fsv *filesystemService) Stat(ctx context.Context, req *connect.Request[filesystem.StatRequest]) (*connect.Response[filesystem.StatResponse], error) {
	g := guestFrom(ctx)
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return nil, err
	}
	e, err := stat(ctx, g, u.resolve(req.Msg.Path))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystem.StatResponse{Entry: e}), nil
}

// MakeDir makes a directory and its missing parents, owned by the user;
// already_exists if it is there.
func (fsv *filesystemService) MakeDir(ctx context.Context, req *connect.Request[filesystem.MakeDirRequest]) (*connect.Response[filesystem.MakeDirResponse], error) {
	g := guestFrom(ctx)
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return nil, err
	}
	p := u.resolve(req.Msg.Path)
	if err := makeDirs(ctx, g, u, p); err != nil {
		return nil, err
	}
	e, err := stat(ctx, g, p)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystem.MakeDirResponse{Entry: e}), nil
}

// makeDirs makes directory p and its missing parents, each owned by u;
// already_exists if p is there.
func makeDirs(ctx context.Context, g *guest, u guestUser, p string) error {
	var missing []string
	for q := p; ; q = path.Dir(q) {
		ok, err := g.h.Exists(ctx, q)
		if err != nil {
			return fsError("make directory", p, err)
		}
		if ok {
			break
		}
		missing = append(missing, q)
		if q == "/" {
			break
		}
	}
	if len(missing) == 0 {
		return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("make directory %s: it exists", p))
	}
	if err := g.h.MkdirAll(ctx, p, 0o755); err != nil {
		return fsError("make directory", p, err)
	}
	if u.uid != 0 || u.gid != 0 {
		for _, q := range missing {
			if err := g.h.Chown(ctx, q, u.uid, u.gid); err != nil {
				return fsError("make directory", q, err)
			}
		}
	}
	return nil
}

func (fsv *filesystemService) Move(ctx context.Context, req *connect.Request[filesystem.MoveRequest]) (*connect.Response[filesystem.MoveResponse], error) {
	g := guestFrom(ctx)
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return nil, err
	}
	from, to := u.resolve(req.Msg.Source), u.resolve(req.Msg.Destination)
	if err := g.h.Rename(ctx, from, to); err != nil {
		return nil, fsError("move", from, err)
	}
	e, err := stat(ctx, g, to)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystem.MoveResponse{Entry: e}), nil
}

// ListDir lists a directory, and the directories in it down to depth
// (1: only its own entries).
func (fsv *filesystemService) ListDir(ctx context.Context, req *connect.Request[filesystem.ListDirRequest]) (*connect.Response[filesystem.ListDirResponse], error) {
	g := guestFrom(ctx)
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.Depth)
	if depth == 0 {
		depth = 1
	}
	if depth > maxListDepth {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("list: depth %d: at most %d", depth, maxListDepth))
	}
	root := u.resolve(req.Msg.Path)
	res := &filesystem.ListDirResponse{}
	level := []string{root}
	for d := 1; d <= depth && len(level) > 0; d++ {
		var next []string
		for _, dir := range level {
			ents, err := listDir(ctx, g, dir)
			if err != nil {
				if dir != root && errors.Is(err, fs.ErrNotExist) {
					continue // gone meanwhile
				}
				return nil, fsError("list", dir, err)
			}
			for i := range ents {
				p := path.Join(dir, ents[i].Name)
				res.Entries = append(res.Entries, entryInfo(p, &ents[i]))
				if len(res.Entries) > maxListEntries {
					return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("list %s: more than %d entries; ask for less depth", root, maxListEntries))
				}
				if ents[i].IsDir && !ents[i].IsSymlink {
					next = append(next, p)
				}
			}
		}
		level = next
	}
	return connect.NewResponse(res), nil
}

// Remove removes a file or a whole directory tree.
func (fsv *filesystemService) Remove(ctx context.Context, req *connect.Request[filesystem.RemoveRequest]) (*connect.Response[filesystem.RemoveResponse], error) {
	g := guestFrom(ctx)
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return nil, err
	}
	p := u.resolve(req.Msg.Path)
	if ok, err := g.h.Exists(ctx, p); err != nil {
		return nil, fsError("remove", p, err)
	} else if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("remove %s: no such file or directory", p))
	}
	if err := g.h.Remove(ctx, p, true); err != nil {
		return nil, fsError("remove", p, err)
	}
	return connect.NewResponse(&filesystem.RemoveResponse{}), nil
}

// eventType maps an agent's watch event to envd's.
func eventType(op string) filesystem.EventType {
	switch op {
	case agent.WatchCreate:
		return filesystem.EventType_EVENT_TYPE_CREATE
	case agent.WatchWrite:
		return filesystem.EventType_EVENT_TYPE_WRITE
	case agent.WatchRemove:
		return filesystem.EventType_EVENT_TYPE_REMOVE
	case agent.WatchRename:
		return filesystem.EventType_EVENT_TYPE_RENAME
	case agent.WatchChmod:
		return filesystem.EventType_EVENT_TYPE_CHMOD
	}
	return filesystem.EventType_EVENT_TYPE_UNSPECIFIED
}

// WatchDir streams a directory's changes: start once it is watched, then
// each change as it happens, with keepalives.
func (fsv *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystem.WatchDirRequest], stream *connect.ServerStream[filesystem.WatchDirResponse]) error {
	g := guestFrom(ctx)
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return err
	}
	dir := u.resolve(req.Msg.Path)
	w, err := g.h.Watch(ctx, dir, req.Msg.Recursive, req.Msg.AllowNetworkMounts)
	if err != nil {
		return fsError("watch", dir, err)
	}
	defer w.Close()
	if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Start{Start: &filesystem.WatchDirResponse_StartEvent{}}}); err != nil {
		return nil
	}
	events := make(chan agent.WatchEvent)
	failed := make(chan error, 1)
	go func() {
		for {
			ev, err := w.Next()
			if err != nil {
				failed <- err
				return
			}
			select {
			case events <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	t := time.NewTicker(keepaliveInterval(req.Header()))
	defer t.Stop()
	for {
		var resp *filesystem.WatchDirResponse
		select {
		case ev := <-events:
			typ := eventType(ev.Op)
			if typ == filesystem.EventType_EVENT_TYPE_UNSPECIFIED {
				continue // an overflow: envd has no word for it
			}
			fe := &filesystem.FilesystemEvent{Name: ev.Name, Type: typ}
			if req.Msg.IncludeEntry {
				fe.Entry = eventEntry(ctx, g, dir, ev.Name, typ)
			}
			resp = &filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Filesystem{Filesystem: fe}}
		case <-t.C:
			resp = &filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Keepalive{Keepalive: &filesystem.WatchDirResponse_KeepAlive{}}}
		case err := <-failed:
			if ctx.Err() != nil {
				return nil
			}
			return connect.NewError(connect.CodeUnavailable, fmt.Errorf("watch %s: %w", dir, err))
		case <-ctx.Done():
			return nil
		}
		if err := stream.Send(resp); err != nil {
			return nil
		}
	}
}

// eventEntry describes the file a watch event names, as it is now (nil:
// gone, as after a removal or a rename away).
func eventEntry(ctx context.Context, g *guest, dir, name string, typ filesystem.EventType) *filesystem.EntryInfo {
	if typ == filesystem.EventType_EVENT_TYPE_REMOVE || typ == filesystem.EventType_EVENT_TYPE_RENAME {
		return nil
	}
	e, err := stat(ctx, g, path.Join(dir, name))
	if err != nil {
		return nil
	}
	return e
}

// pollWatcher is a watch whose events a client fetches (the Python SDK's
// CreateWatcher, GetWatcherEvents, RemoveWatcher).
type pollWatcher struct {
	g      *guest
	cancel context.CancelFunc
	mu     sync.Mutex
	events []*filesystem.FilesystemEvent
	lost   bool
	asked  time.Time
}

func (fsv *filesystemService) CreateWatcher(ctx context.Context, req *connect.Request[filesystem.CreateWatcherRequest]) (*connect.Response[filesystem.CreateWatcherResponse], error) {
	g := guestFrom(ctx)
	u, err := userOf(ctx, g, req.Header().Get("Authorization"))
	if err != nil {
		return nil, err
	}
	fsv.expireWatchers()
	fsv.mu.Lock()
	n := len(fsv.watchers)
	fsv.mu.Unlock()
	if n >= maxPollWatchers {
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("create watcher: %d watchers exist already", n))
	}
	dir := u.resolve(req.Msg.Path)
	wctx, cancel := context.WithCancel(fsv.s.ctx)
	w, err := g.h.Watch(wctx, dir, req.Msg.Recursive, req.Msg.AllowNetworkMounts)
	if err != nil {
		cancel()
		return nil, fsError("watch", dir, err)
	}
	includeEntry := req.Msg.IncludeEntry
	pw := &pollWatcher{g: g, cancel: cancel, asked: time.Now()}
	go func() {
		defer w.Close()
		for {
			ev, err := w.Next()
			if err != nil {
				return
			}
			typ := eventType(ev.Op)
			pw.mu.Lock()
			switch {
			case typ == filesystem.EventType_EVENT_TYPE_UNSPECIFIED:
				pw.lost = true
			case len(pw.events) >= maxPollEvents:
				pw.lost = true // the oldest are kept; the client learns nothing of the rest
			default:
				fe := &filesystem.FilesystemEvent{Name: ev.Name, Type: typ}
				if includeEntry {
					pw.mu.Unlock()
					fe.Entry = eventEntry(wctx, g, dir, ev.Name, typ)
					pw.mu.Lock()
				}
				pw.events = append(pw.events, fe)
			}
			pw.mu.Unlock()
		}
	}()
	id := newID(16)
	fsv.mu.Lock()
	if fsv.watchers == nil {
		fsv.watchers = map[string]*pollWatcher{}
	}
	fsv.watchers[id] = pw
	fsv.mu.Unlock()
	return connect.NewResponse(&filesystem.CreateWatcherResponse{WatcherId: id}), nil
}

// pollWatcherOf returns the polling watcher id of the request's sandbox.
func (fsv *filesystemService) pollWatcherOf(ctx context.Context, id string) (*pollWatcher, error) {
	fsv.mu.Lock()
	pw := fsv.watchers[id]
	fsv.mu.Unlock()
	if pw == nil || pw.g != guestFrom(ctx) {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q: no such watcher", id))
	}
	return pw, nil
}

func (fsv *filesystemService) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystem.GetWatcherEventsRequest]) (*connect.Response[filesystem.GetWatcherEventsResponse], error) {
	pw, err := fsv.pollWatcherOf(ctx, req.Msg.WatcherId)
	if err != nil {
		return nil, err
	}
	pw.mu.Lock()
	events, lost := pw.events, pw.lost
	pw.events, pw.lost, pw.asked = nil, false, time.Now()
	pw.mu.Unlock()
	if lost {
		fsv.s.log.Warn("e2b: a polling watcher lost events (its client asked too seldom)", "sandbox", pw.g.name)
	}
	return connect.NewResponse(&filesystem.GetWatcherEventsResponse{Events: events}), nil
}

func (fsv *filesystemService) RemoveWatcher(ctx context.Context, req *connect.Request[filesystem.RemoveWatcherRequest]) (*connect.Response[filesystem.RemoveWatcherResponse], error) {
	pw, err := fsv.pollWatcherOf(ctx, req.Msg.WatcherId)
	if err != nil {
		return nil, err
	}
	fsv.mu.Lock()
	delete(fsv.watchers, req.Msg.WatcherId)
	fsv.mu.Unlock()
	pw.cancel()
	return connect.NewResponse(&filesystem.RemoveWatcherResponse{}), nil
}

// expireWatchers removes the polling watchers nobody asked for a while.
func (fsv *filesystemService) expireWatchers() {
	fsv.mu.Lock()
	defer fsv.mu.Unlock()
	for id, pw := range fsv.watchers {
		pw.mu.Lock()
		idle := time.Since(pw.asked) > pollWatcherIdle
		pw.mu.Unlock()
		if idle {
			pw.cancel()
			delete(fsv.watchers, id)
		}
	}
}
