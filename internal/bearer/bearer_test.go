package bearer

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestGuard(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("in")) })
	tok := NewToken()
	if len(tok) != 32 || tok == NewToken() {
		t.Fatalf("NewToken = %q; want 32 hex digits, new each time", tok)
	}
	g := Guard(ok, tok, "test", "want the token")
	for _, tc := range []struct {
		header string
		code   int
	}{
		{"Bearer " + tok, 200},
		{"", 401},
		{"Bearer", 401},
		{"Bearer " + tok + "x", 401},
		{"Basic " + tok, 401},
		{"bearer " + tok, 401},
	} {
		r := httptest.NewRequest("GET", "/", nil)
		if tc.header != "" {
			r.Header.Set("Authorization", tc.header)
		}
		w := httptest.NewRecorder()
		g.ServeHTTP(w, r)
		if w.Code != tc.code || (tc.code == 401 && w.Header().Get("WWW-Authenticate") != `Bearer realm="test"`) {
			t.Errorf("Authorization %q: %d %q; want %d", tc.header, w.Code, w.Header(), tc.code)
		}
	}
	if w := httptest.NewRecorder(); true {
		r := httptest.NewRequest("GET", "/", nil)
		r.Header.Set("Authorization", "Bearer ")
		Guard(ok, "", "test", "").ServeHTTP(w, r)
		if w.Code != 401 {
			t.Errorf("an empty token guards nothing open: %d", w.Code)
		}
	}
}
