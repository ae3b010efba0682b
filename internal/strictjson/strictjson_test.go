package strictjson

import "testing"

func TestDecode(t *testing.T) {
	type T struct{ A int }
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{`{"A":1}`, true},
		{`{"A":1,"B":2}`, false},
		{`{"A":1} {"A":2}`, false},
		{`{"A":`, false},
	} {
		var v T
		if err := Decode([]byte(tc.in), &v); (err == nil) != tc.ok {
			t.Errorf("Decode(%s) = %v, want ok %v", tc.in, err, tc.ok)
		}
	}
}
