package e2b

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"time"
)

// portKey keys the guest port a proxied request goes to, in its context.
type portKey struct{}

// proxyPort serves a request for a port of the sandbox other than envd's
// (sandbox.getHost(port)): it goes to that TCP port on the guest's
// loopback, through the agent (no network device needed), unbuffered both
// ways, so streamed answers, server-sent events and websockets pass.
func (s *Server) proxyPort(w http.ResponseWriter, r *http.Request, g *guest, port int) {
	if port <= 0 || port > 65535 {
		envdError(w, http.StatusBadRequest, "E2b-Sandbox-Port: want a port from 1 to 65535")
		return
	}
	if g.traffic != "" && !tokenMatches(r.Header.Get("E2b-Traffic-Access-Token"), g.traffic) {
		envdError(w, http.StatusForbidden, fmt.Sprintf("sandbox %s takes no public traffic: give its E2b-Traffic-Access-Token", g.name))
		return
	}
	g.portProxy(s).ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), portKey{}, port)))
}

// portProxy is the guest's reverse proxy to its ports, made once.
func (g *guest) portProxy(s *Server) *httputil.ReverseProxy {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.proxy != nil {
		return g.proxy
	}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			_, p, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			port, err := strconv.Atoi(p)
			if err != nil {
				return nil, err
			}
			return g.h.DialPort(ctx, port)
		},
		MaxIdleConnsPerHost: 8,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}
	g.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			port, _ := pr.In.Context().Value(portKey{}).(int)
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
			pr.Out.Host = pr.In.Host
			// What routed the request is the server's, not the guest's.
			for _, h := range []string{"E2b-Sandbox-Id", "E2b-Sandbox-Port", "X-Access-Token", "E2b-Traffic-Access-Token"} {
				pr.Out.Header.Del(h)
			}
			pr.SetXForwarded()
		},
		Transport:     tr,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			port, _ := r.Context().Value(portKey{}).(int)
			s.log.Debug("e2b: port proxy", "sandbox", g.name, "port", port, "err", err)
			envdError(w, http.StatusBadGateway, fmt.Sprintf("port %d of sandbox %s: %v", port, g.name, err))
		},
	}
	return g.proxy
}
