// Package strictjson decodes untrusted JSON that must be exactly one value
// of the expected shape: Decode refuses unknown fields and anything after
// the value. The agent protocol, snapshots, saved device state and asset
// manifests all read JSON this way.
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
)

// Decode decodes b into v, refusing fields v does not have and data
// after the value.
func Decode(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if d.More() {
		return errors.New("data after the JSON value")
	}
	return nil
}
