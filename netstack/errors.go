package netstack

import (
	"errors"
	"fmt"

	"gvisor.dev/gvisor/pkg/tcpip"
)

var (
	// ErrClosed is returned once the Stack is closed.
	ErrClosed = errors.New("netstack: stack closed")
	// ErrMalformedFrame wraps the reason a frame from the guest was rejected
	// as unparsable. It is informational (for counters); the frame is
	// dropped and the stack carries on.
	ErrMalformedFrame = errors.New("netstack: malformed frame")
)

// tcpipError is a gVisor tcpip.Error converted at the package boundary.
type tcpipError struct {
	op  string
	err tcpip.Error
}

func (e *tcpipError) Error() string { return "netstack: " + e.op + ": " + e.err.String() }

// tcpipErr converts a tcpip.Error to a Go error naming the operation; nil
// stays nil. It is the only place tcpip errors become Go errors.
func tcpipErr(op string, err tcpip.Error) error {
	if err == nil {
		return nil
	}
	return &tcpipError{op: op, err: err}
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrMalformedFrame}, args...)...)
}
