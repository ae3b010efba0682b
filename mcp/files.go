package mcp

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/capsa-sandbox/capsa/agent"
)

// The files tools' bounds.
const (
	defaultReadBytes = 1 << 20
	maxReadBytes     = 16 << 20
	maxWriteBytes    = 16 << 20
	maxListEntries   = 1000
)

// Content encodings.
const (
	encText   = "utf-8"
	encBase64 = "base64"
)

type readArgs struct {
	Name     string `json:"name" jsonschema:"the sandbox's name"`
	Path     string `json:"path" jsonschema:"the absolute guest path of a file"`
	MaxBytes int    `json:"max_bytes,omitempty" jsonschema:"read at most this many bytes (default 1048576, at most 16777216)"`
}

type readResult struct {
	Path      string `json:"path"`
	Size      int64  `json:"size" jsonschema:"the file's size (0 for files such as /proc's that announce none)"`
	Content   string `json:"content"`
	Encoding  string `json:"encoding" jsonschema:"utf-8 for text, base64 for anything else"`
	Truncated bool   `json:"truncated,omitempty" jsonschema:"the file goes on past max_bytes"`
}

type writeArgs struct {
	Name        string `json:"name" jsonschema:"the sandbox's name"`
	Path        string `json:"path" jsonschema:"the absolute guest path of the file, created or replaced"`
	Content     string `json:"content" jsonschema:"what the file holds, encoded as encoding says"`
	Encoding    string `json:"encoding,omitempty" jsonschema:"utf-8 (the default) or base64"`
	Mode        string `json:"mode,omitempty" jsonschema:"permission bits in octal (default 0644)"`
	MakeParents bool   `json:"make_parents,omitempty" jsonschema:"create missing parent directories (mkdir -p)"`
}

type writeResult struct {
	Path  string `json:"path"`
	Bytes int    `json:"bytes"`
}

type listDirArgs struct {
	Name string `json:"name" jsonschema:"the sandbox's name"`
	Path string `json:"path" jsonschema:"the absolute guest path of a directory"`
}

type dirEntry struct {
	Name     string `json:"name"`
	Type     string `json:"type" jsonschema:"file, dir, symlink or other"`
	Size     int64  `json:"size"`
	Mode     string `json:"mode" jsonschema:"as ls -l shows it"`
	Modified string `json:"modified" jsonschema:"RFC 3339"`
	Target   string `json:"target,omitempty" jsonschema:"a symlink's"`
}

type listDirResult struct {
	Path      string     `json:"path"`
	Entries   []dirEntry `json:"entries"`
	Truncated bool       `json:"truncated,omitempty" jsonschema:"there are more entries than were listed"`
}

// registerFileTools adds file_read, file_write and file_list.
func registerFileTools(s *sdk.Server, t *tools) {
	addTool(s, t, &sdk.Tool{Name: "file_read", Title: "Read a file in a sandbox",
		Description: "Read a file in a sandbox: text as UTF-8, anything else as base64.",
		Annotations: &sdk.ToolAnnotations{ReadOnlyHint: true},
	}, t.readFile)
	addTool(s, t, &sdk.Tool{Name: "file_write", Title: "Write a file in a sandbox",
		Description: "Create or replace a file in a sandbox.",
		Annotations: &sdk.ToolAnnotations{DestructiveHint: boolPtr(true), IdempotentHint: true},
	}, t.writeFile)
	addTool(s, t, &sdk.Tool{Name: "file_list", Title: "List a directory in a sandbox",
		Description: fmt.Sprintf("List a directory in a sandbox, by name (at most %d entries).", maxListEntries),
		Annotations: &sdk.ToolAnnotations{ReadOnlyHint: true},
	}, t.listDir)
}

// checkPath refuses a guest path that is not absolute: the guest's idea
// of a relative path is nobody's.
func checkPath(p string) error {
	if !path.IsAbs(p) {
		return fmt.Errorf("path %q: want an absolute guest path", p)
	}
	return nil
}

// errEnough ends a read at its limit.
var errEnough = errors.New("read limit reached")

func (t *tools) readFile(ctx context.Context, a readArgs) (readResult, error) {
	if err := checkPath(a.Path); err != nil {
		return readResult{}, err
	}
	limit := defaultReadBytes
	if a.MaxBytes != 0 {
		if a.MaxBytes < 0 || a.MaxBytes > maxReadBytes {
			return readResult{}, fmt.Errorf("max_bytes %d: want 1 to %d", a.MaxBytes, maxReadBytes)
		}
		limit = a.MaxBytes
	}
	h, err := t.m.Open(ctx, a.Name)
	if err != nil {
		return readResult{}, err
	}
	fi, err := h.Stat(ctx, a.Path)
	if err != nil {
		return readResult{}, err
	}
	if fi.IsDir {
		return readResult{}, fmt.Errorf("%s is a directory (file_list lists it)", a.Path)
	}
	// One byte past the limit tells a file that goes on from one that
	// ends there; a writer that fails past it ends the read.
	w := &limited{max: limit + 1}
	if err := h.ReadFileTo(ctx, a.Path, w); err != nil && !errors.Is(err, errEnough) {
		return readResult{}, err
	}
	data, truncated := w.buf, len(w.buf) > limit
	if truncated {
		data = data[:limit]
	}
	res := readResult{Path: a.Path, Size: fi.Size, Truncated: truncated}
	res.Content, res.Encoding = encode(data, truncated)
	return res, nil
}

// encode gives data as text if it is UTF-8 (a rune cut at the end of a
// truncated read left out), else as base64.
func encode(data []byte, truncated bool) (content, encoding string) {
	text := data
	for i := 0; truncated && i < utf8.UTFMax-1 && len(text) > 0 && !utf8.Valid(text); i++ {
		text = text[:len(text)-1]
	}
	if utf8.Valid(text) {
		return string(text), encText
	}
	return base64.StdEncoding.EncodeToString(data), encBase64
}

// decode reads content given in encoding (utf-8 when empty, or base64);
// what names the argument in errors.
func decode(what, content, encoding string) ([]byte, error) {
	switch encoding {
	case "", encText:
		return []byte(content), nil
	case encBase64:
		data, err := base64.StdEncoding.DecodeString(content)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		return data, nil
	}
	return nil, fmt.Errorf("encoding %q: want utf-8 or base64", encoding)
}

// limited keeps what is written to it up to max bytes, then fails.
type limited struct {
	buf []byte
	max int
}

func (l *limited) Write(p []byte) (int, error) {
	n := min(len(p), l.max-len(l.buf))
	l.buf = append(l.buf, p[:n]...)
	if n < len(p) {
		return n, errEnough
	}
	return n, nil
}

func (t *tools) writeFile(ctx context.Context, a writeArgs) (writeResult, error) {
	if err := checkPath(a.Path); err != nil {
		return writeResult{}, err
	}
	data, err := decode("content", a.Content, a.Encoding)
	if err != nil {
		return writeResult{}, err
	}
	if len(data) > maxWriteBytes {
		return writeResult{}, fmt.Errorf("content: %d bytes: at most %d", len(data), maxWriteBytes)
	}
	mode := os.FileMode(0o644)
	if a.Mode != "" {
		m, err := strconv.ParseUint(a.Mode, 8, 32)
		if err != nil || m > 0o7777 {
			return writeResult{}, fmt.Errorf("mode %q: want permission bits in octal, e.g. 0644 or 755", a.Mode)
		}
		mode = os.FileMode(m)
	}
	h, err := t.m.Open(ctx, a.Name)
	if err != nil {
		return writeResult{}, err
	}
	if a.MakeParents {
		if err := h.MkdirAll(ctx, path.Dir(a.Path), 0o755); err != nil {
			return writeResult{}, err
		}
	}
	if err := h.WriteFile(ctx, a.Path, data, mode); err != nil {
		return writeResult{}, err
	}
	return writeResult{Path: a.Path, Bytes: len(data)}, nil
}

func (t *tools) listDir(ctx context.Context, a listDirArgs) (listDirResult, error) {
	if err := checkPath(a.Path); err != nil {
		return listDirResult{}, err
	}
	h, err := t.m.Open(ctx, a.Name)
	if err != nil {
		return listDirResult{}, err
	}
	list, err := h.ListDir(ctx, a.Path)
	if err != nil {
		return listDirResult{}, err
	}
	res := listDirResult{Path: a.Path, Entries: []dirEntry{}}
	slices.SortFunc(list, func(a, b agent.FileInfo) int { return strings.Compare(a.Name, b.Name) })
	if len(list) > maxListEntries {
		list, res.Truncated = list[:maxListEntries], true
	}
	for _, fi := range list {
		mode := os.FileMode(fi.Mode)
		e := dirEntry{Name: fi.Name, Type: "other", Size: fi.Size, Mode: mode.String(), Target: fi.Target,
			Modified: time.Unix(0, fi.ModTimeNs).UTC().Format(time.RFC3339)}
		switch {
		case fi.IsSymlink:
			e.Type = "symlink"
		case fi.IsDir:
			e.Type = "dir"
		case mode.IsRegular():
			e.Type = "file"
		}
		res.Entries = append(res.Entries, e)
	}
	return res, nil
}
