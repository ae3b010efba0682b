// Package bearer guards capsa's HTTP servers with a bearer token (RFC
// 6750's Authorization: Bearer): a loopback port is open to every local
// user and, through the NAT's gateway, to a guest allowed everything, so
// `capsa mcp --listen` and `capsa metrics` answer only a client that
// holds the token.
package bearer

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"net/http"
	"strings"
)

// NewToken returns a fresh token: 128 random bits, in hex.
func NewToken() string {
	b := make([]byte, 16)
	rand.Read(b) // never fails (crypto/rand's contract since Go 1.24)
	return hex.EncodeToString(b)
}

// Guard serves h to requests that carry token as their bearer token and
// answers every other one 401 with hint, naming realm.
func Guard(h http.Handler, token, realm, hint string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || token == "" || subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="`+realm+`"`)
			http.Error(w, hint, http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}
