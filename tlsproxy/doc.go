// Package tlsproxy intercepts a sandbox's TLS connections to named hosts
// in its NAT, so that secrets can be used by the guest without ever
// entering it. Its starting point is Proxy.Intercept, which package
// netstack calls for every guest TCP connection once the policy has
// allowed it and the host side is connected (netstack.Config.Intercept).
//
// # Interception
//
// A connection to port 443 is looked at: its first bytes are read as a TLS
// ClientHello by crypto/tls itself, and if it names (SNI) a host the proxy
// intercepts (Config.Intercept, every secret's hosts and every header
// rule's), the proxy first completes a TLS handshake of its own with the
// real server, over the host connection the NAT made, verifying its
// certificate for that name against the host's trust store
// (Config.RootCAs): a certificate that does not verify refuses the guest's
// connection, nothing is relayed. Then it answers the guest with a
// certificate for the name, minted by the sandbox's CA (a cache of
// Config.MaxCerts), and serves HTTP on the connection with net/http
// (HTTP/1.1, or HTTP/2 when the guest offered it and the server chose it),
// relaying each request upstream with net/http/httputil's ReverseProxy.
// Every other connection, and any whose first bytes are not a ClientHello
// to intercept, is handed back to the NAT with those bytes, to relay
// untouched: the guest sees the real server's certificate there.
//
// # Requests
//
// A request whose Host (HTTP/2's :authority) is not the TLS server name
// is refused with 421 (no domain fronting behind an intercepted name). A
// request carrying a secret's placeholder, in its URL or a header value
// (Basic credentials decoded), to a host the secret is not for is refused
// with 403. Otherwise the placeholders of the secrets for that host are
// replaced by their values in the URL and header values (and in the body
// for a secret with Body, buffered up to Config.MaxBody, Content-Length
// fixed; a larger body is refused with 413). Bodies to other hosts are
// not looked at: a placeholder there goes as it is and tells the host
// nothing.
//
// # Header rules
//
// A HeaderRule (Config.Headers; SetHeaders replaces them while the proxy
// runs) sets headers on every request to the hosts it matches, after the
// secrets' substitution, replacing the guest's: for a host the rule of
// its exact name, else the one with the longest matching wildcard, never
// two merged. Headers that frame the request or name its host cannot be
// set. Nothing of the answer is looked at for them: unlike a secret's, a
// rule's value reaches the guest if the host echoes it. The audit record
// names the headers set (Record.Headers), not their values. A rule's host
// must be one the CA may name (CA.Permits): SetHeaders cannot widen what
// a sandbox's CA vouches for.
//
// # Responses
//
// A response from a host that receives secrets has their values replaced
// by the placeholders in its header values, trailers and body (whole,
// Content-Length fixed, up to Config.MaxBody; streamed beyond, holding
// back one value's length so a value split across reads is still found).
// The guest's Accept-Encoding is dropped on those requests so that the
// answer comes plain (or gzip, which the transport decodes); an answer
// still encoded otherwise is refused with 502, and protocol upgrades
// (WebSocket) to such hosts are refused with 403: neither could be checked.
// Error messages are scrubbed the same way. So a secret's value never
// reaches the guest, even from an upstream that echoes it back.
//
// # Audit and bounds
//
// Every intercepted request, and every intercepted connection refused, is
// a Record (Config.Audit; AuditLog keeps them): time, host, method, path,
// status, bytes, the secrets substituted, whether and why it was refused;
// never a value. A certificate is minted only once the real server has
// proved the name, and kept: a guest cannot make the host mint for names
// nobody serves. The proxy holds at most Config.MaxConns intercepted
// connections (more are refused), Config.MaxCerts certificates, headers of
// Config.MaxHeaderBytes, 16 HTTP/2 streams a connection, 4 upstream
// connections per guest connection, and Config.BodyBudget of buffered
// bodies at once.
//
// What it does not protect: a guest may use a secret against its hosts
// for as long as it runs (it cannot read it, but it can send requests
// with it), and a client that pins certificates refuses the interception.
package tlsproxy
