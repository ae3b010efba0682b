package tlsproxy

import (
	"container/list"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"
)

// CA lifetimes. The CA outlives any snapshot a sandbox is likely to be
// restored from; a leaf is minted again when it nears its end.
const (
	caLifetime   = 10 * 365 * 24 * time.Hour
	leafLifetime = 7 * 24 * time.Hour
	leafRenew    = 24 * time.Hour
	// clockSlack backdates certificates, for a guest whose clock lags.
	clockSlack = 24 * time.Hour
)

// CA is a sandbox's certificate authority: it signs the certificates the
// proxy shows the guest for intercepted names. Its key stays in the host
// process; the guest gets only CertPEM. MarshalPEM exists for snapshots,
// so that a restored guest's trust store still holds.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA makes a CA (ECDSA P-256) whose certificates can only name the
// given domains and their subdomains (x509 name constraints, so that even
// its key would vouch for nothing else), given as Config.Intercept
// patterns.
func NewCA(patterns []string) (*CA, error) {
	var permitted []string
	for _, s := range patterns {
		p, err := parsePattern(s)
		if err != nil {
			return nil, fmt.Errorf("tlsproxy: CA: %w", err)
		}
		permitted = append(permitted, p.domain)
	}
	if len(permitted) == 0 {
		return nil, errors.New("tlsproxy: CA: no domains to intercept")
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: CA key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:                serial,
		Subject:                     pkix.Name{CommonName: "capsa sandbox CA " + hex.EncodeToString(serial.Bytes()[:4]), Organization: []string{"capsa"}},
		NotBefore:                   now.Add(-clockSlack),
		NotAfter:                    now.Add(caLifetime),
		KeyUsage:                    x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid:       true,
		IsCA:                        true,
		MaxPathLenZero:              true,
		PermittedDNSDomainsCritical: true,
		PermittedDNSDomains:         permitted,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: CA certificate: %w", err)
	}
	return &CA{cert: cert, key: key}, nil
}

// CertPEM is the CA's certificate, what the guest trusts.
func (ca *CA) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.cert.Raw})
}

// Certificate is the CA's certificate.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// Permits says whether the CA may name the hosts of the host pattern s
// (example.com, *.example.com): its name constraints hold a domain that
// is the pattern's or one above it. A CA without constraints (none made
// here) permits everything.
func (ca *CA) Permits(s string) bool {
	p, err := parsePattern(s)
	return err == nil && ca.permits(p)
}

// CheckHosts refuses the first of the host patterns the CA may not name
// (Permits): ErrOutsideCA, naming it and the CA's domains.
func (ca *CA) CheckHosts(patterns ...string) error {
	for _, h := range patterns {
		if !ca.Permits(h) {
			return ca.outside(h)
		}
	}
	return nil
}

// outside is CheckHosts' error for host pattern h.
func (ca *CA) outside(h string) error {
	return fmt.Errorf("host %s: %w (%s)", h, ErrOutsideCA, strings.Join(ca.cert.PermittedDNSDomains, ", "))
}

func (ca *CA) permits(p pattern) bool {
	if len(ca.cert.PermittedDNSDomains) == 0 {
		return true
	}
	for _, d := range ca.cert.PermittedDNSDomains {
		d = strings.ToLower(strings.TrimPrefix(d, "."))
		if p.domain == d || strings.HasSuffix(p.domain, "."+d) {
			return true
		}
	}
	return false
}

// MarshalPEM is the certificate and the private key, for ParseCA. Whoever
// holds it can mint certificates the guest trusts (for the CA's domains):
// keep it as private as the guest's memory.
func (ca *CA) MarshalPEM() ([]byte, error) {
	kb, err := x509.MarshalECPrivateKey(ca.key)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: CA key: %w", err)
	}
	return append(ca.CertPEM(), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})...), nil
}

// ParseCA reads what MarshalPEM wrote, checking that the key is the
// certificate's and that it is a CA's.
func ParseCA(b []byte) (*CA, error) {
	var ca CA
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		var err error
		switch blk.Type {
		case "CERTIFICATE":
			ca.cert, err = x509.ParseCertificate(blk.Bytes)
		case "EC PRIVATE KEY":
			ca.key, err = x509.ParseECPrivateKey(blk.Bytes)
		}
		if err != nil {
			return nil, fmt.Errorf("tlsproxy: CA: %w", err)
		}
	}
	switch {
	case ca.cert == nil || ca.key == nil:
		return nil, errors.New("tlsproxy: CA: want a CERTIFICATE and an EC PRIVATE KEY block")
	case !ca.cert.IsCA:
		return nil, errors.New("tlsproxy: CA: the certificate is not a CA's")
	case !ca.key.PublicKey.Equal(ca.cert.PublicKey):
		return nil, errors.New("tlsproxy: CA: the key is not the certificate's")
	}
	return &ca, nil
}

func randomSerial() (*big.Int, error) {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: serial number: %w", err)
	}
	return n.Add(n, big.NewInt(1<<32)), nil // at least 5 bytes, never 0
}

// leafCache mints the certificates shown to the guest, one per name, all
// with one key, and keeps the last max of them (least recently used goes
// first), so a guest naming endless hosts costs signatures, not memory.
type leafCache struct {
	ca  *CA
	key *ecdsa.PrivateKey
	max int

	mu     sync.Mutex
	lru    *list.List // of *leaf, most recent first
	byName map[string]*list.Element
	minted uint64
}

type leaf struct {
	name string
	cert *tls.Certificate
	end  time.Time
}

func newLeafCache(ca *CA, max int) (*leafCache, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: leaf key: %w", err)
	}
	return &leafCache{ca: ca, key: key, max: max, lru: list.New(), byName: map[string]*list.Element{}}, nil
}

// get returns the certificate for name (a checked, lower-case host
// name), minting it if it is not cached or nears its end.
func (c *leafCache) get(name string, now time.Time) (*tls.Certificate, error) {
	c.mu.Lock()
	if e, ok := c.byName[name]; ok {
		l := e.Value.(*leaf)
		if l.end.Sub(now) > leafRenew {
			c.lru.MoveToFront(e)
			c.mu.Unlock()
			return l.cert, nil
		}
		c.lru.Remove(e)
		delete(c.byName, name)
	}
	c.mu.Unlock()

	l, err := c.mint(name, now)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.minted++
	if e, ok := c.byName[name]; ok { // minted meanwhile by another connection
		c.lru.Remove(e)
	}
	c.byName[name] = c.lru.PushFront(l)
	for c.lru.Len() > c.max {
		old := c.lru.Remove(c.lru.Back()).(*leaf)
		delete(c.byName, old.name)
	}
	return l.cert, nil
}

func (c *leafCache) mint(name string, now time.Time) (*leaf, error) {
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	end := now.Add(leafLifetime)
	if end.After(c.ca.cert.NotAfter) {
		end = c.ca.cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		DNSNames:     []string{name},
		NotBefore:    now.Add(-clockSlack),
		NotAfter:     end,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.ca.cert, &c.key.PublicKey, c.ca.key)
	if err != nil {
		return nil, fmt.Errorf("tlsproxy: certificate for %s: %w", name, err)
	}
	return &leaf{name: name, end: end, cert: &tls.Certificate{
		Certificate: [][]byte{der, c.ca.cert.Raw},
		PrivateKey:  c.key,
	}}, nil
}

// stats reports how many certificates are cached and were minted.
func (c *leafCache) stats() (cached int, minted uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len(), c.minted
}
