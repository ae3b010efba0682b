package e2b

// E2B's volume file API (the SDK's Volume instance methods: list,
// makeDir, getInfo, exists, updateMetadata, readFile, writeFile, remove,
// on /volumecontent/{volumeID}/dir, /path and /file), written from the
// SDK's documented interface (VolumeEntryStat and the operations'
// parameters). A request carries the volume's token (Authorization:
// Bearer, from Volume.create or getInfo), not an API key. It acts on the
// volume's files as a sandbox's guest does (volume.Files: the same file
// server, the same quota, nothing outside the volume), with what the host
// owns shown as owned by volumeUID, as in the sandboxes that mount it.

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/capsa-sandbox/capsa/volume"
)

// volumeEntry is what the file API says of a file (VolumeEntryStat).
type volumeEntry struct {
	Name   string `json:"name"`
	Path   string `json:"path"`
	Type   string `json:"type"`
	Size   int64  `json:"size"`
	Mode   uint32 `json:"mode"`
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
	ATime  string `json:"atime"`
	MTime  string `json:"mtime"`
	CTime  string `json:"ctime"`
	Target string `json:"target,omitempty"`
}

func toVolumeEntry(e volume.Entry) volumeEntry {
	return volumeEntry{Name: e.Name, Path: e.Path, Type: e.Type, Size: e.Size, Mode: e.Mode, UID: e.UID, GID: e.GID,
		ATime: e.ATime.Format(time.RFC3339Nano), MTime: e.MTime.Format(time.RFC3339Nano), CTime: e.CTime.Format(time.RFC3339Nano), Target: e.Target}
}

// contentError is the file API's error shape (code and message, both
// strings).
type contentError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func volumeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, contentError{Code: strings.ReplaceAll(strings.ToLower(http.StatusText(status)), " ", "_"), Message: msg})
}

// volumeIdle is how long the file API keeps a volume's files open after
// its last request: a burst of requests mounts it once (and, when no
// sandbox has it, recounts its quota once).
const volumeIdle = 30 * time.Second

// openVolume is a volume's files the file API holds open.
type openVolume struct {
	f    *volume.Files
	refs int
	idle *time.Timer
}

// volumeFiles returns v's files, open, and the func that lets them go.
func (s *Server) volumeFiles(v volOwner) (*volume.Files, func(), error) {
	name := v.volume()
	s.volMu.Lock()
	defer s.volMu.Unlock()
	o := s.openVols[name]
	if o == nil {
		root, err := s.m.Volumes()
		if err != nil {
			return nil, nil, err
		}
		f, err := root.OpenFiles(name, volumeUID, volumeUID, s.log)
		if err != nil {
			return nil, nil, err
		}
		o = &openVolume{f: f}
		s.openVols[name] = o
	}
	o.refs++
	if o.idle != nil {
		o.idle.Stop()
		o.idle = nil
	}
	var once sync.Once
	return o.f, func() {
		once.Do(func() {
			s.volMu.Lock()
			defer s.volMu.Unlock()
			if o.refs--; o.refs == 0 {
				o.idle = time.AfterFunc(volumeIdle, func() {
					s.volMu.Lock()
					defer s.volMu.Unlock()
					if o.refs == 0 && s.openVols[name] == o {
						delete(s.openVols, name)
						o.f.Close()
					}
				})
			}
		})
	}, nil
}

// closeVolumeFiles closes the files of the volume name ("": of every
// volume) that no request uses.
func (s *Server) closeVolumeFiles(name string) {
	s.volMu.Lock()
	defer s.volMu.Unlock()
	for n, o := range s.openVols {
		if (name == "" || n == name) && o.refs == 0 {
			if o.idle != nil {
				o.idle.Stop()
			}
			delete(s.openVols, n)
			o.f.Close()
		}
	}
}

// volumeContentRoutes serves the file API on mux.
func (s *Server) volumeContentRoutes(mux *http.ServeMux) {
	handle := func(pattern string, h func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string)) {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			id := r.PathValue("volumeID")
			v, ok := s.volumeByToken(id, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
			if !ok {
				volumeError(w, http.StatusUnauthorized, "volume "+id+": missing or wrong token (Authorization: Bearer, the volume's token)")
				return
			}
			f, release, err := s.volumeFiles(v)
			if err != nil {
				volumeError(w, http.StatusInternalServerError, fmt.Sprintf("volume %s: %v", id, err))
				return
			}
			defer release()
			// Only a file's upload may be as big as the volume.
			limit := int64(maxBody)
			if r.Method == http.MethodPut {
				limit = s.volumeQuota + 1
			}
			r.Body = http.MaxBytesReader(w, r.Body, limit)
			h(w, r, f, r.URL.Query().Get("path"))
		})
	}
	handle("GET /volumecontent/{volumeID}/dir", func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string) {
		depth := 1
		if d := r.URL.Query().Get("depth"); d != "" {
			n, err := strconv.Atoi(d)
			if err != nil || n < 1 || n > volume.MaxPathDepth {
				volumeError(w, http.StatusBadRequest, fmt.Sprintf("depth %q: want 1 to %d", d, volume.MaxPathDepth))
				return
			}
			depth = n
		}
		list, err := f.List(p, depth)
		if err != nil {
			fileAPIError(w, "list "+p, err)
			return
		}
		out := make([]volumeEntry, 0, len(list))
		for _, e := range list {
			out = append(out, toVolumeEntry(e))
		}
		writeJSON(w, http.StatusOK, out)
	})
	handle("POST /volumecontent/{volumeID}/dir", func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string) {
		a, force, err := fileAttrs(r)
		if err != nil {
			volumeError(w, http.StatusBadRequest, "make directory: "+err.Error())
			return
		}
		e, err := f.MakeDir(p, a, force)
		if err != nil {
			fileAPIError(w, "make directory "+p, err)
			return
		}
		writeJSON(w, http.StatusCreated, toVolumeEntry(e))
	})
	handle("GET /volumecontent/{volumeID}/path", func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string) {
		e, err := f.Stat(p)
		if err != nil {
			fileAPIError(w, "stat "+p, err)
			return
		}
		writeJSON(w, http.StatusOK, toVolumeEntry(e))
	})
	handle("PATCH /volumecontent/{volumeID}/path", func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string) {
		var body struct {
			UID  *uint32 `json:"uid"`
			GID  *uint32 `json:"gid"`
			Mode *uint32 `json:"mode"`
		}
		if err := readOptional(r, &body); err != nil {
			volumeError(w, http.StatusBadRequest, "update metadata: "+err.Error())
			return
		}
		e, err := f.SetAttrs(p, volume.Attrs{UID: body.UID, GID: body.GID, Mode: body.Mode})
		if err != nil {
			fileAPIError(w, "update metadata of "+p, err)
			return
		}
		writeJSON(w, http.StatusOK, toVolumeEntry(e))
	})
	handle("DELETE /volumecontent/{volumeID}/path", func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string) {
		if err := f.Remove(p); err != nil {
			fileAPIError(w, "remove "+p, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	handle("GET /volumecontent/{volumeID}/file", func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string) {
		rc, size, err := f.Open(p)
		if err != nil {
			fileAPIError(w, "read "+p, err)
			return
		}
		defer rc.Close()
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		io.Copy(w, io.LimitReader(rc, size))
	})
	handle("PUT /volumecontent/{volumeID}/file", func(w http.ResponseWriter, r *http.Request, f *volume.Files, p string) {
		// The SDK's writeFile replaces a file that exists, with force
		// or without.
		a, _, err := fileAttrs(r)
		if err != nil {
			volumeError(w, http.StatusBadRequest, "write file: "+err.Error())
			return
		}
		e, err := f.Write(p, r.Body, a, true)
		if err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				err = syscall.ENOSPC
			}
			fileAPIError(w, "write "+p, err)
			return
		}
		writeJSON(w, http.StatusCreated, toVolumeEntry(e))
	})
}

// volumeByToken is the volume id if token is its own and the API key it
// belongs to still exists.
func (s *Server) volumeByToken(id, token string) (volOwner, bool) {
	list, err := s.vols.load()
	if err != nil {
		return volOwner{}, false
	}
	i := slices.IndexFunc(list, func(v volOwner) bool { return v.ID == id })
	if i < 0 || !tokenMatches(token, list[i].Token) {
		return volOwner{}, false
	}
	keys, err := s.keys.List()
	if err != nil || !slices.ContainsFunc(keys, func(k Key) bool { return k.ID == list[i].Key }) {
		return volOwner{}, false
	}
	return list[i], true
}

// fileAttrs reads a write's uid, gid, mode and force from the query.
func fileAttrs(r *http.Request) (volume.Attrs, bool, error) {
	q := r.URL.Query()
	var a volume.Attrs
	for name, dst := range map[string]**uint32{"uid": &a.UID, "gid": &a.GID, "mode": &a.Mode} {
		if v := q.Get(name); v != "" {
			n, err := strconv.ParseUint(v, 10, 32)
			if err != nil {
				return a, false, fmt.Errorf("%s %q: want a number", name, v)
			}
			u := uint32(n)
			*dst = &u
		}
	}
	force := false
	if v := q.Get("force"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return a, false, fmt.Errorf("force %q: want true or false", v)
		}
		force = b
	}
	return a, force, nil
}

// fileAPIError answers a failed file operation with the status its error
// means.
func fileAPIError(w http.ResponseWriter, what string, err error) {
	status := http.StatusInternalServerError
	switch {
	case errors.Is(err, volume.ErrBadPath), errors.Is(err, volume.ErrBadMode), errors.Is(err, volume.ErrTooMany), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENOTDIR),
		errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ELOOP), errors.Is(err, syscall.ENAMETOOLONG):
		status = http.StatusBadRequest
	case errors.Is(err, fs.ErrNotExist):
		status = http.StatusNotFound
	case errors.Is(err, fs.ErrExist), errors.Is(err, syscall.ENOTEMPTY):
		status = http.StatusConflict
	case errors.Is(err, fs.ErrPermission):
		status = http.StatusForbidden
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		status = http.StatusInsufficientStorage
	}
	volumeError(w, status, what+": "+err.Error())
}
