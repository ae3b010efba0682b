package agent

// OpReadFiles: several small files read in one request and one reply,
// where OpRead costs a connection apiece. A container's statistics are
// seven cgroup files, which a CRI runtime asks for every few seconds per
// container (containerd 2.x's collector every second): read one by one,
// their connections alone kept a small pod VM's vCPU busy.

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"syscall"
)

// FeatureReadFiles: several small files in one request (OpReadFiles).
const FeatureReadFiles = "readfiles"

// OpReadFiles is the operation's name.
const OpReadFiles = "readfiles"

// Bounds on OpReadFiles: paths in one request, and bytes of each file (a
// larger one is an error for that file, EFBIG). The reply, base64 in JSON, stays
// within a frame.
const (
	MaxReadFiles    = 32
	MaxReadFileSize = 16 << 10
)

// ReadFilesReply is OpReadFiles' reply: one FileRead per path, in order.
type ReadFilesReply struct {
	Files []FileRead `json:"files"`
}

// FileRead is one file of an OpReadFiles: its contents, or why it could
// not be read.
type FileRead struct {
	Data  []byte      `json:"data,omitempty"`
	Error *ErrorReply `json:"error,omitempty"`
}

// checkReadFiles refuses a request no client makes: no paths, too many, or
// one that is not absolute.
func checkReadFiles(paths []string) error {
	if len(paths) == 0 || len(paths) > MaxReadFiles {
		return fmt.Errorf("readfiles: %d paths; 1 to %d", len(paths), MaxReadFiles)
	}
	for _, p := range paths {
		if !filepath.IsAbs(p) || strings.ContainsRune(p, 0) || len(p) > maxTreePath {
			return fmt.Errorf("readfiles: path %.100q must be absolute", p)
		}
	}
	return nil
}

// readFiles reads each path, at most MaxReadFileSize bytes of it.
func readFiles(paths []string) (ReadFilesReply, error) {
	if err := checkReadFiles(paths); err != nil {
		return ReadFilesReply{}, err
	}
	out := ReadFilesReply{Files: make([]FileRead, len(paths))}
	for i, p := range paths {
		data, err := readSmall(p)
		if err != nil {
			e := errorReplyOf(err)
			out.Files[i].Error = &e
			continue
		}
		out.Files[i].Data = data
	}
	return out, nil
}

// readSmall reads a file that must hold at most MaxReadFileSize bytes
// (procfs and sysfs files say no size: it reads until the end).
func readSmall(path string) ([]byte, error) {
	f, _, err := openToRead(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxReadFileSize+1))
	if err != nil {
		return nil, opError("read", path, err)
	}
	if len(data) > MaxReadFileSize {
		return nil, fmt.Errorf("read %s: %w (%d bytes at most)", path, syscall.EFBIG, MaxReadFileSize)
	}
	return data, nil
}

// ReadFiles reads several small files of the guest in one request: for
// each path, in order, its contents or the error reading it gave (a
// *RemoteError, which unwraps to the guest's errno; EFBIG for a file past
// MaxReadFileSize). An agent without
// FeatureReadFiles answers an error wrapping ErrUnsupported.
func (cl *Client) ReadFiles(ctx context.Context, paths []string) ([]FileResult, error) {
	if err := checkReadFiles(paths); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	var r ReadFilesReply
	if err := cl.call(ctx, Request{Op: OpReadFiles, Paths: paths}, &r); err != nil {
		return nil, err
	}
	if len(r.Files) != len(paths) {
		return nil, fmt.Errorf("agent: readfiles: %d files answered for %d paths", len(r.Files), len(paths))
	}
	out := make([]FileResult, len(paths))
	for i, f := range r.Files {
		switch {
		case f.Error != nil && f.Data != nil, len(f.Data) > MaxReadFileSize:
			return nil, fmt.Errorf("agent: readfiles: a bad answer for %s", paths[i])
		case f.Error != nil:
			out[i].Err = f.Error.remote()
		default:
			out[i].Data = f.Data
		}
	}
	return out, nil
}

// FileResult is one file of Client.ReadFiles: its contents, or Err.
type FileResult struct {
	Data []byte
	Err  error
}
