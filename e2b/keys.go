package e2b

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/capsa-sandbox/capsa/supervisor"
)

// Keys are the API keys of a state directory: made and removed by `capsa
// serve key`, checked by every control request (X-API-KEY). Only each
// key's SHA-256 is kept, in KeysFile (0600), so the file cannot give a
// key away; a key is shown once, when it is made.
type Keys struct {
	f jsonFile[Key]
}

// Key is a kept API key: never the key itself.
type Key struct {
	ID      string    `json:"id"`
	Name    string    `json:"name,omitempty"`
	Prefix  string    `json:"prefix"` // its first characters, to tell keys apart
	Hash    string    `json:"sha256"`
	Created time.Time `json:"created"`
	// All: the key reaches every sandbox and snapshot of the state
	// directory (those the CLI made too); otherwise only those made with
	// it.
	All bool `json:"all,omitempty"`
}

// reaches reports whether the key may see and act on the sandbox rec.
func (k Key) reaches(rec *supervisor.Record) bool {
	return k.All || rec.Labels[labelKey] == k.ID
}

// reachesSnapshot reports whether the key may see and use a snapshot that
// the key o names made (made: through the API at all).
func (k Key) reachesSnapshot(o snapOwner, made bool) bool {
	return k.All || made && o.Key == k.ID
}

// KeysFile is where a state directory's API keys are kept.
const KeysFile = "e2b-keys.json"

// maxKeys bounds the keys of a state directory; maxKeyName a key's name.
const (
	maxKeys    = 1000
	maxKeyName = 64
)

// OpenKeys opens the API keys kept in the state directory dir.
func OpenKeys(dir string) (*Keys, error) {
	k := &Keys{f: jsonFile[Key]{path: filepath.Join(dir, KeysFile), what: "API keys"}}
	if _, err := k.f.load(); err != nil {
		return nil, err
	}
	return k, nil
}

// Create makes a key named name (optional, unique) and returns it, shaped
// as E2B's are (e2b_ and 40 hex digits), with what is kept of it; with
// all it reaches every sandbox of the state directory (Key.All).
func (k *Keys) Create(name string, all bool) (string, Key, error) {
	if len(name) > maxKeyName || strings.ContainsFunc(name, func(r rune) bool { return r < ' ' || r == 0x7f }) {
		return "", Key{}, fmt.Errorf("e2b: key name %q: want at most %d printable characters", name, maxKeyName)
	}
	raw := make([]byte, 20)
	rand.Read(raw)
	secret := "e2b_" + hex.EncodeToString(raw)
	sum := sha256.Sum256([]byte(secret))
	kept := Key{ID: newID(12), Name: name, Prefix: secret[:10], Hash: hex.EncodeToString(sum[:]), Created: time.Now().UTC().Truncate(time.Second), All: all}
	err := k.f.change(func(keys []Key) ([]Key, error) {
		if len(keys) >= maxKeys {
			return nil, fmt.Errorf("e2b: %d API keys exist already", len(keys))
		}
		for _, o := range keys {
			if name != "" && o.Name == name {
				return nil, fmt.Errorf("e2b: an API key named %q exists already", name)
			}
		}
		return append(keys, kept), nil
	})
	if err != nil {
		return "", Key{}, err
	}
	return secret, kept, nil
}

// List returns the kept keys.
func (k *Keys) List() ([]Key, error) {
	return k.f.list()
}

// Remove removes the key whose ID or name is idOrName.
func (k *Keys) Remove(idOrName string) error {
	return k.f.change(func(keys []Key) ([]Key, error) {
		i := slices.IndexFunc(keys, func(o Key) bool { return o.ID == idOrName || o.Name != "" && o.Name == idOrName })
		if i < 0 {
			return nil, fmt.Errorf("e2b: no API key with ID or name %q", idOrName)
		}
		return slices.Delete(keys, i, i+1), nil
	})
}

// Check returns the kept key secret is, if it is one.
func (k *Keys) Check(secret string) (Key, bool) {
	if secret == "" || len(secret) > 256 {
		return Key{}, false
	}
	keys, err := k.f.load()
	if err != nil {
		return Key{}, false
	}
	sum := sha256.Sum256([]byte(secret))
	got := hex.EncodeToString(sum[:])
	for _, o := range keys {
		if subtle.ConstantTimeCompare([]byte(got), []byte(o.Hash)) == 1 {
			return o, true
		}
	}
	return Key{}, false
}
