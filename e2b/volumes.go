package e2b

// E2B's volumes, over capsa's named volumes (package volume): the SDK's
// Volume.create, list, getInfo, connect and destroy (POST and GET
// /volumes, GET and DELETE /volumes/{volumeID}), and Sandbox.create's
// volumeMounts, which mount volumes by name at guest paths. Written from
// E2B's documented API (the SDK's Volume class and its OpenAPI types
// NewVolume, Volume, VolumeAndToken and SandboxVolumeMount).
//
// A volume belongs to the API key that made it: another key neither sees
// it nor mounts it. Its data is a capsa volume named e2b-ID in the state
// directory, with the server's quota (Options.VolumeQuota), which `capsa
// volume ls` shows too. The file API on a volume without a sandbox
// (/volumecontent) is volumecontent.go's.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path"
	"slices"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/volume"
)

// VolumesFile is where the API keeps its volumes' owners.
const VolumesFile = "e2b-volumes.json"

// DefaultVolumeQuota is Options.VolumeQuota's default.
const DefaultVolumeQuota = 1 << 30

const (
	maxVolumesPerKey = 64
	maxVolumeMounts  = 8
	// volumeUID is whom a sandbox sees owning what its volumes' file
	// server made (all it and the host wrote): E2B's user, uid and gid
	// 1000 in E2B's images, so that the commands and files the API runs
	// as that user can write what they made, as in E2B.
	volumeUID = 1000
)

// volOwner is an API volume: its id and name, the key it belongs to, and
// the token its file API would take.
type volOwner struct {
	ID    string `json:"volumeID"`
	Name  string `json:"name"`
	Key   string `json:"key"`
	Token string `json:"token"`
}

// volume is the capsa volume that holds v's data.
func (v volOwner) volume() string { return "e2b-" + v.ID }

// volumeInfo is what the API says of a volume (Volume; VolumeAndToken
// with the token).
type volumeInfo struct {
	ID     string  `json:"volumeID"`
	Name   string  `json:"name"`
	Token  string  `json:"token,omitempty"`
	Domain *string `json:"domain,omitempty"`
}

// volumeMount is a volume mounted in a sandbox (SandboxVolumeMount).
type volumeMount struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

func (s *Server) volumeInfo(v volOwner, token bool) volumeInfo {
	in := volumeInfo{ID: v.ID, Name: v.Name}
	if token {
		in.Token = v.Token
		if s.domain != "" {
			d := s.domain
			in.Domain = &d
		}
	}
	return in
}

// keyVolume is key's volume with the id or (byName) the name; false if it
// has none.
func (s *Server) keyVolume(key Key, id string, byName bool) (volOwner, bool, error) {
	list, err := s.vols.load()
	if err != nil {
		return volOwner{}, false, err
	}
	i := slices.IndexFunc(list, func(v volOwner) bool {
		return v.Key == key.ID && (!byName && v.ID == id || byName && v.Name == id)
	})
	if i < 0 {
		return volOwner{}, false, nil
	}
	return list[i], true, nil
}

// createVolume makes a volume (POST /volumes, NewVolume).
func (s *Server) createVolume(w http.ResponseWriter, r *http.Request, key Key) {
	var body struct {
		Name string `json:"name"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		apiError(w, http.StatusBadRequest, fmt.Sprintf("create volume: the body: %v", err))
		return
	}
	if err := volume.CheckName(body.Name); err != nil {
		apiError(w, http.StatusBadRequest, "create volume: "+err.Error())
		return
	}
	root, err := s.m.Volumes()
	if err != nil {
		apiError(w, http.StatusInternalServerError, "create volume: "+err.Error())
		return
	}
	v := volOwner{ID: "v" + newID(19), Name: body.Name, Key: key.ID, Token: newToken()}
	status := http.StatusInternalServerError
	err = s.vols.change(func(list []volOwner) ([]volOwner, error) {
		n := 0
		for _, o := range list {
			if o.Key != key.ID {
				continue
			}
			if n++; o.Name == v.Name {
				status = http.StatusConflict
				return nil, fmt.Errorf("a volume named %s exists", v.Name)
			}
		}
		if n >= maxVolumesPerKey {
			status = http.StatusTooManyRequests
			return nil, fmt.Errorf("this API key has %d volumes, its most", n)
		}
		info, err := root.Create(v.volume(), s.volumeQuota)
		if err != nil {
			return nil, err
		}
		// Every user of a guest may write it, as in E2B's, where
		// commands run as the image's user: its top directory is
		// world-writable (the host's volumes directory is private).
		if err := os.Chmod(info.Path, 0o777); err != nil {
			root.Remove(v.volume(), true)
			return nil, err
		}
		return append(list, v), nil
	})
	if err != nil {
		apiError(w, status, fmt.Sprintf("create volume %s: %v", body.Name, err))
		return
	}
	s.log.Info("e2b: volume created", "volume", v.ID, "name", v.Name, "key", key.Name)
	writeJSON(w, http.StatusCreated, s.volumeInfo(v, true))
}

// listVolumes lists key's volumes (GET /volumes).
func (s *Server) listVolumes(w http.ResponseWriter, r *http.Request, key Key) {
	list, err := s.vols.load()
	if err != nil {
		apiError(w, http.StatusInternalServerError, "list volumes: "+err.Error())
		return
	}
	out := []volumeInfo{}
	for _, v := range list {
		if v.Key == key.ID {
			out = append(out, s.volumeInfo(v, false))
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// getVolume says what the volume is, with its token (GET
// /volumes/{volumeID}).
func (s *Server) getVolume(w http.ResponseWriter, r *http.Request, key Key) {
	id := r.PathValue("volumeID")
	v, ok, err := s.keyVolume(key, id, false)
	switch {
	case err != nil:
		apiError(w, http.StatusInternalServerError, "volume: "+err.Error())
	case !ok:
		apiError(w, http.StatusNotFound, fmt.Sprintf("volume %q not found", id))
	default:
		writeJSON(w, http.StatusOK, s.volumeInfo(v, true))
	}
}

// deleteVolume removes a volume and its data (DELETE /volumes/{volumeID});
// one a sandbox has mounted is refused (409).
func (s *Server) deleteVolume(w http.ResponseWriter, r *http.Request, key Key) {
	id := r.PathValue("volumeID")
	root, err := s.m.Volumes()
	if err != nil {
		apiError(w, http.StatusInternalServerError, "delete volume: "+err.Error())
		return
	}
	status := http.StatusInternalServerError
	err = s.vols.change(func(list []volOwner) ([]volOwner, error) {
		i := slices.IndexFunc(list, func(v volOwner) bool { return v.Key == key.ID && v.ID == id })
		if i < 0 {
			status = http.StatusNotFound
			return nil, errors.New("not found")
		}
		// A suspended (paused) sandbox holds no mount while it is on
		// disk, and needs the volume to resume.
		if user, err := s.volumeUser(list[i]); err != nil {
			return nil, err
		} else if user != "" {
			status = http.StatusConflict
			return nil, fmt.Errorf("sandbox %s mounts it: kill it first", user)
		}
		s.closeVolumeFiles(list[i].volume())
		if err := root.Remove(list[i].volume(), false); errors.Is(err, volume.ErrInUse) {
			status = http.StatusConflict
			return nil, errors.New("in use: a sandbox has it mounted (kill it first), or a request of its file API is under way")
		} else if err != nil && !errors.Is(err, volume.ErrNotFound) {
			return nil, err
		}
		return slices.Delete(list, i, i+1), nil
	})
	if err != nil {
		apiError(w, status, fmt.Sprintf("delete volume %q: %v", id, err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// volumeUser names a sandbox that has not ended (running, paused or
// suspended) and mounts v; "" if none does.
func (s *Server) volumeUser(v volOwner) (string, error) {
	recs, err := s.m.List()
	if err != nil {
		return "", err
	}
	for _, rec := range recs {
		if rec.Live() && slices.ContainsFunc(rec.Spec.Volumes, func(sv sandbox.VolumeSpec) bool { return sv.Name == v.volume() }) {
			return rec.Name, nil
		}
	}
	return "", nil
}

// apiMount is a volume of the API at a guest path, as a create asks.
type apiMount struct {
	Vol  volOwner
	Path string
}

// volumeMounts reads a create request's volumeMounts: key's volumes by
// name at absolute guest paths, each path once, at most maxVolumeMounts.
func (s *Server) volumeMounts(key Key, raw json.RawMessage) ([]apiMount, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var mounts []volumeMount
	if err := json.Unmarshal(raw, &mounts); err != nil {
		return nil, fmt.Errorf("volumeMounts: %v", err)
	}
	if len(mounts) > maxVolumeMounts {
		return nil, fmt.Errorf("volumeMounts: %d, at most %d", len(mounts), maxVolumeMounts)
	}
	seen := map[string]bool{}
	out := make([]apiMount, 0, len(mounts))
	for _, m := range mounts {
		if !path.IsAbs(m.Path) || path.Clean(m.Path) == "/" {
			return nil, fmt.Errorf("volumeMounts: volume %q: path %q: want an absolute path other than /", m.Name, m.Path)
		}
		p := path.Clean(m.Path)
		if seen[p] {
			return nil, fmt.Errorf("volumeMounts: %s: mounted twice", p)
		}
		seen[p] = true
		v, ok, err := s.keyVolume(key, m.Name, true)
		if err != nil {
			return nil, fmt.Errorf("volumeMounts: %w", err)
		} else if !ok {
			return nil, fmt.Errorf("volumeMounts: no volume named %q", m.Name)
		}
		out = append(out, apiMount{Vol: v, Path: p})
	}
	return out, nil
}

// mountVolumes mounts mounts (volumeMounts' result) on b, read-write.
func (s *Server) mountVolumes(b *sandbox.Builder, mounts []apiMount) error {
	if len(mounts) == 0 {
		return nil
	}
	root, err := s.m.Volumes()
	if err != nil {
		return err
	}
	for _, m := range mounts {
		b.VolumeOwned(root.Dir(), m.Vol.volume(), m.Path, sandbox.ReadWrite, volumeUID, volumeUID)
	}
	return nil
}

// mountsOf are the API's volumes the sandbox of spec mounts, by their API
// names; nil if none.
func (s *Server) mountsOf(spec sandbox.Spec) []volumeMount {
	if len(spec.Volumes) == 0 {
		return nil
	}
	list, err := s.vols.load()
	if err != nil {
		return nil
	}
	var out []volumeMount
	for _, sv := range spec.Volumes {
		if i := slices.IndexFunc(list, func(v volOwner) bool { return v.volume() == sv.Name }); i >= 0 {
			out = append(out, volumeMount{Name: list[i].Name, Path: sv.Guest})
		}
	}
	return out
}
