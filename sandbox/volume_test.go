package sandbox

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/capsa-sandbox/capsa/ratelimit"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/volume"
)

func TestVolumeSpecRoundTrip(t *testing.T) {
	vdir := t.TempDir()
	r, err := volume.Open(vdir)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"shared", "cache"} {
		if _, err := r.Create(n, 0); err != nil {
			t.Fatal(err)
		}
	}
	s, err := New().Share(t.TempDir(), "/data", ReadOnly).
		VolumeIn(vdir, "shared", "/shared/", ReadWrite).
		VolumeOwned(vdir, "cache", "/cache", ReadOnly, 1000, 100).
		Run("true").Spec()
	if err != nil {
		t.Fatalf("Spec() = %v", err)
	}
	want := []VolumeSpec{{Name: "shared", Guest: "/shared", Mode: ReadWrite, Dir: vdir}, {Name: "cache", Guest: "/cache", Mode: ReadOnly, Dir: vdir, UID: 1000, GID: 100}}
	if !reflect.DeepEqual(s.Volumes, want) {
		t.Fatalf("Spec().Volumes = %+v, want %+v", s.Volumes, want)
	}
	got, err := roundTrip(t, s)
	if err != nil || !reflect.DeepEqual(got, s) {
		t.Fatalf("FromSpec(JSON(spec)).Spec() = %+v, %v; want %+v", got, err, s)
	}
	// The tags follow the shares': share 0, then volumes 1 and 2.
	if a := volumeArg(1+1, s.Volumes[1]); a != "capsa.share=capsa2,ro,%2Fcache" && a != "capsa.share=capsa2,ro,/cache" {
		t.Errorf("volumeArg(2, cache) = %q", a)
	}
}

func TestVolumeErrors(t *testing.T) {
	vdir := t.TempDir()
	r, err := volume.Open(vdir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Create("v", 0); err != nil {
		t.Fatal(err)
	}
	share := t.TempDir()
	for _, tc := range []struct {
		name, guest string
		mode        ShareMode
		want        string
	}{
		{"missing", "/m", ReadWrite, "no such volume (make it with: capsa volume create missing)"},
		{"a.b/c", "/m", ReadWrite, "a host directory to share needs a slash"},
		{".", "/m", ReadWrite, "volume name"},
		{"v", "rel", ReadWrite, "must be absolute"},
		{"v", "/proc/x", ReadWrite, "inside /proc"},
		{"v", "/data", ReadWrite, "guest path /data is already shared from"},
		{"v", "/m", ShareMode(9), "unknown mode"},
	} {
		err := New().Share(share, "/data", ReadWrite).VolumeIn(vdir, tc.name, tc.guest, tc.mode).Err()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("VolumeIn(%q, %q) = %v, want %q", tc.name, tc.guest, err, tc.want)
		}
	}
	// A share onto a volume's mount point, and too many of both.
	err = New().VolumeIn(vdir, "v", "/m", ReadWrite).Share(share, "/m", ReadOnly).Err()
	if err == nil || !strings.Contains(err.Error(), "already volume v's") {
		t.Errorf("Share onto volume v's path = %v, want it refused", err)
	}
	b := New()
	for i := range MaxShares - 1 {
		b.Share(share, "/s/"+string(rune('a'+i)), ReadOnly)
	}
	b.VolumeIn(vdir, "v", "/v1", ReadWrite)
	if err := b.Err(); err != nil {
		t.Fatalf("%d shares and a volume = %v", MaxShares-1, err)
	}
	if err := b.VolumeIn(vdir, "v", "/v2", ReadWrite).Err(); err == nil || !strings.Contains(err.Error(), "at most 16 shares and volumes") {
		t.Errorf("%d shares and two volumes = %v, want the limit", MaxShares-1, err)
	}
}

// TestVolumeDevicesHoldTheVolume: a sandbox's volume devices keep the
// volume in use until they are closed.
func TestVolumeDevicesHoldTheVolume(t *testing.T) {
	vdir := t.TempDir()
	r, err := volume.Open(vdir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Create("v", 1<<20); err != nil {
		t.Fatal(err)
	}
	devs, err := volumeDevices([]VolumeSpec{{Name: "v", Guest: "/v", Dir: vdir}, {Name: "v", Guest: "/w", Mode: ReadOnly, Dir: vdir}}, 3, newLimiters(ratelimit.Limits{}), nil)
	if err != nil {
		t.Fatalf("volumeDevices = %v", err)
	}
	if devs[0].Tag() != "capsa3" || devs[1].Tag() != "capsa4" {
		t.Errorf("tags = %s, %s; want capsa3, capsa4", devs[0].Tag(), devs[1].Tag())
	}
	if info, err := r.Get("v"); err != nil || !info.InUse {
		t.Errorf("Get(v) with devices = %+v, %v; want in use", info, err)
	}
	for _, d := range devs {
		if err := d.Close(); err != nil {
			t.Errorf("Close() = %v", err)
		}
	}
	if err := r.Remove("v", false); err != nil {
		t.Errorf("Remove(v) after the devices closed = %v", err)
	}
	if _, err := volumeDevices([]VolumeSpec{{Name: "v", Guest: "/v", Dir: vdir}}, 0, newLimiters(ratelimit.Limits{}), nil); err == nil || !strings.Contains(err.Error(), "no such volume") {
		t.Errorf("volumeDevices of a removed volume = %v", err)
	}
}

// TestRestoreKeepsVolumeOwners: whom the guest sees owning a volume's
// files is the snapshot's unless the restorer names another; the volume
// itself is the restorer's.
func TestRestoreKeepsVolumeOwners(t *testing.T) {
	saved := Spec{CPUs: 1, MemoryMiB: 256, Volumes: []VolumeSpec{{Name: "a", Guest: "/data", Mode: ReadWrite, UID: 1000, GID: 1000}, {Name: "b", Guest: "/other", Mode: ReadWrite}}}
	b, err := json.Marshal(saved)
	if err != nil {
		t.Fatal(err)
	}
	snap := &snapshot.Snapshot{Manifest: snapshot.Manifest{Spec: b}}
	got, err := restoredSpec(snap, &Spec{Volumes: []VolumeSpec{{Name: "a2", Guest: "/data", Mode: ReadWrite}, {Name: "b2", Guest: "/other", Mode: ReadWrite, UID: 7, GID: 8}}})
	if err != nil {
		t.Fatal(err)
	}
	want := []VolumeSpec{{Name: "a2", Guest: "/data", Mode: ReadWrite, UID: 1000, GID: 1000}, {Name: "b2", Guest: "/other", Mode: ReadWrite, UID: 7, GID: 8}}
	if !reflect.DeepEqual(got.Volumes, want) {
		t.Errorf("restored volumes = %+v; want %+v", got.Volumes, want)
	}
}
