package sandbox

import (
	"strings"
	"testing"
)

func TestParseShare(t *testing.T) {
	for spec, want := range map[string]ShareSpec{
		"/srv/data:/data":        {"/srv/data", "/data", ReadWrite},
		"/srv/data:/data:ro":     {"/srv/data", "/data", ReadOnly},
		"/srv/data:/data:rw":     {"/srv/data", "/data", ReadWrite},
		"rel/dir:/mnt/x":         {"rel/dir", "/mnt/x", ReadWrite},
		"/a:b/c:/mnt/with:colon": {"/a:b/c", "/mnt/with:colon", ReadWrite},
	} {
		h, g, m, err := ParseShare(spec)
		if err != nil || (ShareSpec{h, g, m}) != want {
			t.Errorf("ParseShare(%q) = %q %q %v, %v; want %+v", spec, h, g, m, err, want)
		}
	}
	for _, bad := range []string{"", "/data", ":/data", "/srv:data", "/srv/data:ro"} {
		if _, _, _, err := ParseShare(bad); err == nil || !strings.Contains(err.Error(), "HOST:GUEST") {
			t.Errorf("ParseShare(%q): %v, want an error naming the syntax", bad, err)
		}
	}
}

func TestShareChecks(t *testing.T) {
	dir := t.TempDir()
	b := New().Share(dir, "/data/../work/", ReadOnly)
	if err := b.Err(); err != nil || len(b.c.Shares) != 1 || b.c.Shares[0].Guest != "/work" {
		t.Fatalf("share: %v %+v", err, b.c.Shares)
	}
	for _, tc := range []struct {
		host, guest, want string
		mode              ShareMode
	}{
		{dir + "/missing", "/x", "no such file or directory", ReadWrite},
		{"", "/x", "empty host path", ReadWrite},
		{dir, "x", "must be absolute", ReadWrite},
		{dir, "/", "guest's root", ReadWrite},
		{dir, "/dev/shm", "inside /dev", ReadWrite},
		{dir, "/x\x00y", "NUL", ReadWrite},
		{dir, "/x", "unknown mode", ShareMode(7)},
		{dir, "/work", "already shared", ReadWrite},
	} {
		err := New().Share(dir, "/work", ReadOnly).Share(tc.host, tc.guest, tc.mode).Err()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Share(%q, %q): %v, want %q", tc.host, tc.guest, err, tc.want)
		}
	}
	b = New()
	for i := range MaxShares + 1 {
		b.Share(dir, "/s/"+string(rune('a'+i)), ReadOnly)
	}
	if err := b.Err(); err == nil || !strings.Contains(err.Error(), "at most 16") {
		t.Errorf("17 shares: %v", err)
	}
}

func TestShareArgEscapesThePath(t *testing.T) {
	got := shareArg(2, ShareSpec{Guest: "/my data/\"q\"", Mode: ReadOnly}, ShareFS9P)
	if got != "capsa.share=capsa2,ro,%2Fmy%20data%2F%22q%22" && got != "capsa.share=capsa2,ro,/my%20data/%22q%22" {
		t.Errorf("shareArg = %q", got)
	}
	if strings.ContainsAny(got, " \"") {
		t.Errorf("shareArg %q holds a space or quote", got)
	}
	if got := shareArg(0, ShareSpec{Guest: "/w", Mode: ReadWrite}, ShareFSVirtioFS); got != "capsa.virtiofs=capsa0,rw,%2Fw" {
		t.Errorf("shareArg over virtio-fs = %q", got)
	}
}

func TestShareFS(t *testing.T) {
	dir := t.TempDir()
	for _, kind := range []string{"", ShareFS9P, ShareFSVirtioFS} {
		b := New().Share(dir, "/w", ReadWrite).ShareFS(kind)
		if err := b.Err(); err != nil {
			t.Errorf("ShareFS(%q): %v", kind, err)
		}
		if want := map[string]string{ShareFSVirtioFS: ShareFSVirtioFS}[kind]; b.c.ShareFS != want {
			t.Errorf("ShareFS(%q) recorded %q, want %q", kind, b.c.ShareFS, want)
		}
		// The spec comes back through FromSpec.
		spec := b.c.Spec
		spec.Main.Argv = []string{"true"}
		if got, err := FromSpec(spec).Spec(); err != nil || got.ShareFS != b.c.ShareFS {
			t.Errorf("ShareFS(%q) after FromSpec: %q, %v", kind, got.ShareFS, err)
		}
	}
	if err := New().ShareFS("nfs").Err(); err == nil || !strings.Contains(err.Error(), `share transport "nfs"`) {
		t.Errorf("ShareFS(nfs): %v, want an error naming it", err)
	}
}
