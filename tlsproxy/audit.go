package tlsproxy

import (
	"io"
	"time"

	"github.com/capsa-sandbox/capsa/internal/auditlog"
)

// Record is one line of the audit log: an intercepted request, or an
// intercepted connection refused before any request (Method empty). It
// never holds a secret's value: Path is the guest's own (placeholders,
// not values), errors are scrubbed.
type Record struct {
	Time time.Time `json:"time"`
	// Kind is "http": the NAT's flows share the log (netstack.Flow).
	Kind          string   `json:"kind"`
	Host          string   `json:"host"` // the TLS server name
	Method        string   `json:"method,omitempty"`
	Path          string   `json:"path,omitempty"` // without the query
	Proto         string   `json:"proto,omitempty"`
	Status        int      `json:"status,omitempty"`
	RequestBytes  int64    `json:"request_bytes"`  // body bytes from the guest
	ResponseBytes int64    `json:"response_bytes"` // body bytes to the guest
	Substituted   []string `json:"substituted,omitempty"`
	Headers       []string `json:"headers_set,omitempty"` // the names a header rule set, never the values
	Blocked       bool     `json:"blocked,omitempty"`
	Reason        string   `json:"reason,omitempty"`
}

// maxAuditPath bounds Record.Path: a guest cannot make the log's lines
// long.
const maxAuditPath = 512

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// AuditLog keeps the last records in memory and writes each as a JSON line
// to a writer, if it has one (a write error is dropped: the log must never
// stop the proxy). Its Add is a Config.Audit.
type AuditLog = auditlog.Log[Record]

// NewAuditLog keeps the last keep records and writes every record to w
// (nil: none).
func NewAuditLog(keep int, w io.Writer) *AuditLog { return auditlog.New[Record](keep, w) }
