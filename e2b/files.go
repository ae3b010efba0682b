package e2b

import (
	"compress/gzip"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strconv"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
)

// maxUploadParts bounds the files of one multipart upload.
const maxUploadParts = 1000

// decodeBase64 decodes standard base64, padded or not.
func decodeBase64(s string) ([]byte, error) {
	return base64.RawStdEncoding.DecodeString(strings.TrimRight(s, "="))
}

// signatureValid checks a signed file URL (the SDKs' uploadUrl and
// downloadUrl): v1_ and the unpadded base64 of
// sha256("PATH:OPERATION:USER:TOKEN[:EXPIRATION]"), not yet expired.
func signatureValid(r *http.Request, token string) bool {
	q := r.URL.Query()
	sig := q.Get("signature")
	if token == "" || !strings.HasPrefix(sig, "v1_") {
		return false
	}
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	raw := q.Get("path") + ":" + op + ":" + q.Get("username") + ":" + token
	if exp := q.Get("signature_expiration"); exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil || time.Now().Unix() > n {
			return false
		}
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	want := "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
	return subtle.ConstantTimeCompare([]byte(sig), []byte(want)) == 1
}

// fileStatus is the HTTP status a file error gets (the SDKs read 404 as
// a missing file and 507 as a full disk).
func fileStatus(err error) int {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return http.StatusNotFound
	case errors.Is(err, fs.ErrPermission):
		return http.StatusForbidden
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return http.StatusInsufficientStorage
	case errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EINVAL):
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

// fileUser is the user a /files request acts for (its username query, or
// its Authorization header).
func fileUser(r *http.Request, g *guest) (guestUser, int, error) {
	name := r.URL.Query().Get("username")
	if name == "" {
		var err error
		if name, err = basicUser(r.Header.Get("Authorization")); err != nil {
			return guestUser{}, http.StatusUnauthorized, err
		}
	}
	u, err := g.user(r.Context(), name)
	if err != nil {
		return guestUser{}, http.StatusBadRequest, err
	}
	return u, 0, nil
}

// downloadFile serves GET /files?path=: the file's bytes, streamed.
func (s *Server) downloadFile(w http.ResponseWriter, r *http.Request) {
	g := guestFrom(r.Context())
	u, status, err := fileUser(r, g)
	if err != nil {
		envdError(w, status, err.Error())
		return
	}
	p := r.URL.Query().Get("path")
	if p == "" {
		envdError(w, http.StatusBadRequest, "download: no path")
		return
	}
	p = u.resolve(p)
	fi, err := g.h.Stat(r.Context(), p)
	if err != nil {
		envdError(w, fileStatus(err), fmt.Sprintf("download %s: %v", p, err))
		return
	}
	if fi.IsDir {
		envdError(w, http.StatusBadRequest, fmt.Sprintf("download %s: a directory", p))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": path.Base(p)}))
	if !fi.IsSymlink {
		w.Header().Set("Content-Length", strconv.FormatInt(fi.Size, 10))
	}
	// Once bytes went out, an error can only cut the response short.
	if err := g.h.ReadFileTo(r.Context(), p, w); err != nil {
		s.log.Warn("e2b: download", "sandbox", g.name, "path", p, "err", err)
	}
}

// writeInfo is one written file, in an upload's answer.
type writeInfo struct {
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Path     string            `json:"path"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// uploadMetadata is what an upload's X-Metadata-KEY headers give each of
// its files (keys lowercased: HTTP does not keep their case), bounded as
// the agent bounds extended attributes.
func uploadMetadata(h http.Header) (map[string]string, error) {
	var m map[string]string
	for k, vs := range h {
		key, ok := strings.CutPrefix(k, "X-Metadata-")
		if !ok || len(vs) == 0 {
			continue
		}
		key = strings.ToLower(key)
		if key == "" || len(key) > 128 || len(vs[0]) > 1024 {
			return nil, fmt.Errorf("upload: metadata %q: want a key of 1 to 128 bytes and a value of at most 1024", key)
		}
		if m == nil {
			m = map[string]string{}
		}
		m[key] = vs[0]
	}
	if len(m) > maxMetadata {
		return nil, fmt.Errorf("upload: %d metadata entries, at most %d", len(m), maxMetadata)
	}
	return m, nil
}

// uploadFiles serves POST /files: multipart/form-data with a part "file"
// per file (its filename the destination, or the path query for one), or
// the raw bytes of one file (application/octet-stream, maybe gzipped) to
// the path query. Each file is streamed into the guest, replacing what
// was there atomically, owned by the user.
func (s *Server) uploadFiles(w http.ResponseWriter, r *http.Request) {
	g := guestFrom(r.Context())
	u, status, err := fileUser(r, g)
	if err != nil {
		envdError(w, status, err.Error())
		return
	}
	query := r.URL.Query().Get("path")
	meta, err := uploadMetadata(r.Header)
	if err != nil {
		envdError(w, http.StatusBadRequest, err.Error())
		return
	}
	ctype, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var written []writeInfo
	switch {
	case ctype == "multipart/form-data":
		mr := multipart.NewReader(r.Body, params["boundary"])
		for n := 0; ; n++ {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				envdError(w, http.StatusBadRequest, fmt.Sprintf("upload: %v", err))
				return
			}
			if n >= maxUploadParts {
				envdError(w, http.StatusBadRequest, fmt.Sprintf("upload: more than %d files", maxUploadParts))
				return
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			// The SDKs name each part's destination in its filename
			// (the path query as well, for one file): the whole path,
			// which Part.FileName would cut to its last element.
			dest := query
			if _, p, err := mime.ParseMediaType(part.Header.Get("Content-Disposition")); err == nil && p["filename"] != "" {
				dest = p["filename"]
			}
			info, status, err := s.writeOne(r.Context(), g, u, dest, part, meta)
			part.Close()
			if err != nil {
				envdError(w, status, err.Error())
				return
			}
			written = append(written, info)
		}
	default:
		if query == "" {
			envdError(w, http.StatusBadRequest, "upload: no path")
			return
		}
		body := io.Reader(r.Body)
		if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				envdError(w, http.StatusBadRequest, fmt.Sprintf("upload: gzip: %v", err))
				return
			}
			defer zr.Close()
			body = zr
		}
		info, status, err := s.writeOne(r.Context(), g, u, query, body, meta)
		if err != nil {
			envdError(w, status, err.Error())
			return
		}
		written = append(written, info)
	}
	if len(written) == 0 {
		envdError(w, http.StatusBadRequest, "upload: no file in the request")
		return
	}
	writeJSON(w, http.StatusOK, written)
}

// isAlreadyExists reports a Connect already_exists error.
func isAlreadyExists(err error) bool { return connect.CodeOf(err) == connect.CodeAlreadyExists }

// writeOne writes r to the guest file dest (relative: the user's home's),
// making its missing directories, with the metadata meta (as the
// extended attributes user.e2b.KEY), and gives it to the user.
func (s *Server) writeOne(ctx context.Context, g *guest, u guestUser, dest string, r io.Reader, meta map[string]string) (writeInfo, int, error) {
	if dest == "" {
		return writeInfo{}, http.StatusBadRequest, errors.New("upload: a file with no destination path")
	}
	p := u.resolve(dest)
	if dir := path.Dir(p); dir != "/" {
		if err := makeDirs(ctx, g, u, dir); err != nil && !isAlreadyExists(err) {
			return writeInfo{}, http.StatusInternalServerError, fmt.Errorf("upload %s: %v", p, err)
		}
	}
	var err error
	if len(meta) == 0 {
		err = g.h.WriteFileFrom(ctx, p, r, 0o644)
	} else {
		x := map[string]string{}
		for k, v := range meta {
			x[xattrMeta+k] = v
		}
		err = g.h.WriteFileXattrs(ctx, p, r, 0o644, x)
	}
	if err != nil {
		return writeInfo{}, fileStatus(err), fmt.Errorf("upload %s: %v", p, err)
	}
	if u.uid != 0 || u.gid != 0 {
		if err := g.h.Chown(ctx, p, u.uid, u.gid); err != nil {
			return writeInfo{}, fileStatus(err), fmt.Errorf("upload %s: %v", p, err)
		}
	}
	return writeInfo{Name: path.Base(p), Type: "file", Path: p, Metadata: meta}, 0, nil
}
