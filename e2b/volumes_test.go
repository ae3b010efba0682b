package e2b

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor/supervisortest"
)

// TestVolumes: the volume routes make, list, describe and remove a capsa
// volume per API volume, each key seeing only its own; a create's
// volumeMounts names them, and what is wrong with a mount is refused
// before anything boots.
func TestVolumes(t *testing.T) {
	s, key := testServer(t)
	otherKey, _, err := s.keys.Create("other", false)
	if err != nil {
		t.Fatal(err)
	}
	var v volumeInfo
	if code := do(t, s, "POST", "/volumes", key, `{"name":"data"}`, nil, &v); code != http.StatusCreated || !strings.HasPrefix(v.ID, "v") || v.Name != "data" || len(v.Token) != 32 {
		t.Fatalf("POST /volumes: %d %+v; want 201 with an id, the name and a token", code, v)
	}
	root, err := s.m.Volumes()
	if err != nil {
		t.Fatal(err)
	}
	info, err := root.Get("e2b-" + v.ID)
	if err != nil || info.Quota != DefaultVolumeQuota {
		t.Fatalf("the capsa volume behind it: %+v, %v; want one with the default quota", info, err)
	}
	if st, err := os.Stat(info.Path); err != nil || st.Mode().Perm() != 0o777 {
		t.Errorf("its data directory: %v, %v; want mode 0777, for every guest user", st.Mode(), err)
	}
	var e errorBody
	for body, want := range map[string]int{`{"name":"data"}`: 409, `{"name":"../x"}`: 400, `{"name":""}`: 400, `{`: 400} {
		if code := do(t, s, "POST", "/volumes", key, body, nil, &e); code != want {
			t.Errorf("POST /volumes %s: %d %+v; want %d", body, code, e, want)
		}
	}
	// The same name under another key is another volume.
	var o volumeInfo
	if code := do(t, s, "POST", "/volumes", otherKey, `{"name":"data"}`, nil, &o); code != http.StatusCreated || o.ID == v.ID {
		t.Errorf("POST /volumes under another key: %d %+v; want a volume of its own", code, o)
	}
	var list []volumeInfo
	if code := do(t, s, "GET", "/volumes", key, "", nil, &list); code != 200 || len(list) != 1 || list[0].ID != v.ID || list[0].Token != "" {
		t.Errorf("GET /volumes: %d %+v; want the key's one volume, without its token", code, list)
	}
	var got volumeInfo
	if code := do(t, s, "GET", "/volumes/"+v.ID, key, "", nil, &got); code != 200 || got != v {
		t.Errorf("GET /volumes/%s: %d %+v; want %+v", v.ID, code, got, v)
	}
	for _, k := range []string{otherKey} {
		if code := do(t, s, "GET", "/volumes/"+v.ID, k, "", nil, &e); code != 404 {
			t.Errorf("GET another key's volume: %d; want 404", code)
		}
		if code := do(t, s, "DELETE", "/volumes/"+v.ID, k, "", nil, &e); code != 404 {
			t.Errorf("DELETE another key's volume: %d; want 404", code)
		}
	}

	// Mounts: by name, the key's own, each path once.
	for body, field := range map[string]string{
		`{"volumeMounts":[{"name":"data","path":"data"}]}`:                            "absolute",
		`{"volumeMounts":[{"name":"data","path":"/"}]}`:                               "absolute",
		`{"volumeMounts":[{"name":"data","path":"/a"},{"name":"data","path":"/a/"}]}`: "twice",
		`{"volumeMounts":[{"name":"nope","path":"/a"}]}`:                              "no volume named",
		`{"volumeMounts":[1,2,3,4,5,6,7,8,9]}`:                                        "volumeMounts",
	} {
		if code := do(t, s, "POST", "/v2/sandboxes", key, body, nil, &e); code != 400 || !strings.Contains(e.Message, field) {
			t.Errorf("create %s: %d %+v; want 400 naming %q", body, code, e, field)
		}
	}
	k, _ := s.keys.Check(key)
	mounts, err := s.volumeMounts(k, []byte(`[{"name":"data","path":"/mnt/data/"}]`))
	if err != nil || len(mounts) != 1 || mounts[0].Path != "/mnt/data" {
		t.Errorf("volumeMounts = %+v, %v; want data at /mnt/data", mounts, err)
	}

	// A volume a sandbox that has not ended mounts (here, one being made)
	// is not removed; one an ended sandbox mounted is.
	var v2 volumeInfo
	if code := do(t, s, "POST", "/volumes", key, `{"name":"data2"}`, nil, &v2); code != http.StatusCreated {
		t.Fatalf("POST /volumes data2: %d", code)
	}
	uses := sandbox.Spec{Volumes: []sandbox.VolumeSpec{{Name: "e2b-" + v2.ID, Guest: "/d", Dir: root.Dir()}}}
	supervisortest.Exited(t, s.m.Dir(), "ended", uses, 0, "done")
	supervisortest.Creating(t, s.m.Dir(), "user", uses)
	if code := do(t, s, "DELETE", "/volumes/"+v2.ID, key, "", nil, &e); code != 409 || !strings.Contains(e.Message, "sandbox user mounts it") {
		t.Errorf("DELETE a volume a live sandbox mounts: %d %+v; want 409 naming it", code, e)
	}

	// A mounted volume is not removed; an unmounted one is, data and all.
	m, err := root.Mount("e2b-"+v.ID, nil)
	if err != nil {
		t.Fatal(err)
	}
	if code := do(t, s, "DELETE", "/volumes/"+v.ID, key, "", nil, &e); code != 409 {
		t.Errorf("DELETE a mounted volume: %d %+v; want 409", code, e)
	}
	m.Close()
	if code := do(t, s, "DELETE", "/volumes/"+v.ID, key, "", nil, nil); code != 204 {
		t.Errorf("DELETE /volumes/%s: %d; want 204", v.ID, code)
	}
	if _, err := root.Get("e2b-" + v.ID); err == nil {
		t.Error("the capsa volume outlived its API volume")
	}
	if code := do(t, s, "DELETE", "/volumes/"+v.ID, key, "", nil, &e); code != 404 {
		t.Errorf("DELETE it again: %d; want 404", code)
	}
	if b, err := os.ReadFile(filepath.Join(s.m.Dir(), VolumesFile)); err != nil || strings.Contains(string(b), v.ID) {
		t.Errorf("%s after the delete: %q, %v; want the volume gone", VolumesFile, b, err)
	}
}

// TestEgressPolicyRoundTrip: E2B's egress rules become capsa's policy and
// come back out of a record as the API wrote them.
func TestEgressPolicyRoundTrip(t *testing.T) {
	for _, c := range []struct{ allow, deny, wantDeny []string }{
		{[]string{"1.1.1.1"}, []string{"0.0.0.0/0"}, []string{"0.0.0.0/0"}},
		{nil, []string{"8.8.8.8"}, []string{"8.8.8.8"}},
		{nil, nil, nil},
	} {
		p, err := egressPolicy(nil, c.allow, c.deny)
		if err != nil {
			t.Fatal(err)
		}
		in := networkOf(sandbox.Spec{Network: &sandbox.NetworkSpec{Policy: p}}, nil)
		if in == nil || !slices.Equal(in.AllowOut, c.allow) || !slices.Equal(in.DenyOut, c.wantDeny) || !in.AllowPublicTraffic {
			t.Errorf("allowOut %q, denyOut %q: the policy %v reads back as %+v", c.allow, c.deny, p, in)
		}
	}
	if in := networkOf(sandbox.Spec{}, nil); in != nil {
		t.Errorf("no network reads back as %+v; want none", in)
	}
	off := false
	if p, err := egressPolicy(&off, nil, nil); p != nil || err != nil {
		t.Errorf("no internet access: %v, %v; want no policy (no network)", p, err)
	}
}

// TestVolumeContent: the volume file API takes the volume's token, not an
// API key, and writes, reads, lists, changes and removes files as a guest
// would; a path out of the volume is refused.
func TestVolumeContent(t *testing.T) {
	s, key := testServer(t)
	var v volumeInfo
	if code := do(t, s, "POST", "/volumes", key, `{"name":"files"}`, nil, &v); code != http.StatusCreated {
		t.Fatalf("POST /volumes: %d", code)
	}
	auth := map[string]string{"Authorization": "Bearer " + v.Token}
	base := "/volumecontent/" + v.ID
	var ce contentError
	for _, h := range []map[string]string{nil, {"Authorization": "Bearer " + strings.Repeat("x", 32)}, {"X-API-KEY": key}} {
		if code := do(t, s, "GET", base+"/path?path=/", "", "", h, &ce); code != 401 {
			t.Errorf("GET with %v: %d %+v; want 401", h, code, ce)
		}
	}
	var e volumeEntry
	if code := do(t, s, "POST", base+"/dir?path=/d/e&force=true&mode=488", "", "", auth, &e); code != 201 || e.Type != "directory" || e.Mode != 0o750 || e.UID != volumeUID {
		t.Errorf("makeDir /d/e: %d %+v; want a directory of mode 0750 shown as uid %d's", code, e, volumeUID)
	}
	if code := do(t, s, "PUT", base+"/file?path=/d/e/f.txt", "", "hello volume", auth, &e); code != 201 || e.Size != 12 || e.Path != "/d/e/f.txt" {
		t.Errorf("writeFile: %d %+v", code, e)
	}
	if code := do(t, s, "PUT", base+"/file?path=/d/e/f.txt", "", "again", auth, &e); code != 201 || e.Size != 5 {
		t.Errorf("writeFile over a file: %d %+v; want it replaced", code, e)
	}
	if code := do(t, s, "PUT", base+"/file?path=/d/e/f.txt&force=true", "", "bye", auth, &e); code != 201 || e.Size != 3 {
		t.Errorf("writeFile with force: %d %+v", code, e)
	}
	if code := do(t, s, "PUT", base+"/file?path=/nodir/f.txt", "", "x", auth, &ce); code != 404 {
		t.Errorf("writeFile where no directory is: %d %+v; want 404", code, ce)
	}
	r := httptest.NewRequest("GET", base+"/file?path=/d/e/f.txt", nil)
	r.Header.Set("Authorization", "Bearer "+v.Token)
	w := httptest.NewRecorder()
	s.ServeHTTP(w, r)
	if w.Code != 200 || w.Body.String() != "bye" {
		t.Errorf("readFile: %d %q; want bye", w.Code, w.Body.String())
	}
	var list []volumeEntry
	if code := do(t, s, "GET", base+"/dir?path=/&depth=3", "", "", auth, &list); code != 200 || len(list) != 3 {
		t.Errorf("list / depth 3: %d %+v; want /d, /d/e, /d/e/f.txt", code, list)
	}
	if code := do(t, s, "PATCH", base+"/path?path=/d/e/f.txt", "", `{"mode":384}`, auth, &e); code != 200 || e.Mode != 0o600 {
		t.Errorf("updateMetadata mode 0600: %d %+v", code, e)
	}
	for p, want := range map[string]int{"/../x": 400, "/nosuch": 404, "/d/e/f.txt/x": 400} {
		if code := do(t, s, "GET", base+"/path?path="+p, "", "", auth, &ce); code != want {
			t.Errorf("getInfo %s: %d %+v; want %d", p, code, ce, want)
		}
	}
	if code := do(t, s, "PATCH", base+"/path?path=/d", "", `{"mode":2541}`, auth, &ce); code != 400 {
		t.Errorf("a set-gid mode: %d %+v; want 400", code, ce)
	}
	if code := do(t, s, "PATCH", base+"/path?path=/d", "", `{"mode":`+strings.Repeat(" ", maxBody)+`1}`, auth, &ce); code != 400 {
		t.Errorf("a metadata body over %d bytes: %d %+v; want 400", maxBody, code, ce)
	}
	if code := do(t, s, "DELETE", base+"/path?path=/d", "", "", auth, nil); code != 204 {
		t.Errorf("remove /d: %d; want 204", code)
	}
	if code := do(t, s, "GET", base+"/path?path=/d", "", "", auth, &ce); code != 404 {
		t.Errorf("getInfo of the removed /d: %d; want 404", code)
	}
	// The volume is in use while the file API holds it: a delete waits
	// for no request, it finds the files closed once idle.
	if code := do(t, s, "DELETE", "/volumes/"+v.ID, key, "", nil, nil); code != 204 {
		t.Errorf("DELETE the volume after its file requests: %d; want 204", code)
	}
	if code := do(t, s, "GET", base+"/path?path=/", "", "", auth, &ce); code != 401 {
		t.Errorf("the file API of a deleted volume: %d; want 401", code)
	}
	if code := do(t, s, "POST", "/volumes", key, `{"name":"files2"}`, nil, &v); code != http.StatusCreated {
		t.Fatalf("POST /volumes: %d", code)
	}
	auth = map[string]string{"Authorization": "Bearer " + v.Token}
	base = "/volumecontent/" + v.ID
	big := strings.Repeat("x", 2<<20)
	s.volumeQuota = 1 << 20 // the request's bound follows the quota
	if code := do(t, s, "PUT", base+"/file?path=/big", "", big, auth, &ce); code != 507 {
		t.Errorf("a write past the volume's size: %d %+v; want 507", code, ce)
	}
	// A volume's token works no longer than its API key.
	k, _ := s.keys.Check(key)
	if err := s.keys.Remove(k.ID); err != nil {
		t.Fatal(err)
	}
	if code := do(t, s, "GET", base+"/path?path=/", "", "", auth, &ce); code != 401 {
		t.Errorf("the file API after its key was removed: %d; want 401", code)
	}
}
