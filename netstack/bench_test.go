package netstack

import (
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"
)

const benchChunk = 64 << 10

func benchListener(b *testing.B, serve func(net.Conn)) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
	return loopbackPort(b, l.Addr())
}

// BenchmarkTCPGuestToHost measures bulk TCP throughput from the guest stack
// through the NAT to a host socket.
func BenchmarkTCPGuestToHost(b *testing.B) {
	done := make(chan int64, 1)
	port := benchListener(b, func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		done <- n
	})
	g := newTestNAT(b, Config{Policy: AllowAll(), Logger: slog.New(slog.DiscardHandler)})
	c, err := g.dialTCP(testCtx(b, time.Minute), gatewayPort(g, port))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, benchChunk)
	b.SetBytes(benchChunk)
	b.ResetTimer()
	for range b.N {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	c.CloseWrite()
	if n := <-done; n != int64(b.N)*benchChunk {
		b.Fatalf("host received %d bytes, want %d", n, int64(b.N)*benchChunk)
	}
}

// BenchmarkTCPHostToGuest measures bulk TCP throughput from a host socket
// through the NAT to the guest stack.
func BenchmarkTCPHostToGuest(b *testing.B) {
	port := benchListener(b, func(c net.Conn) {
		var n uint64
		if err := binary.Read(c, binary.BigEndian, &n); err != nil {
			return
		}
		buf := make([]byte, benchChunk)
		for ; n > 0; n-- {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
	g := newTestNAT(b, Config{Policy: AllowAll(), Logger: slog.New(slog.DiscardHandler)})
	c, err := g.dialTCP(testCtx(b, time.Minute), gatewayPort(g, port))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	b.SetBytes(benchChunk)
	b.ResetTimer()
	if err := binary.Write(c, binary.BigEndian, uint64(b.N)); err != nil {
		b.Fatal(err)
	}
	n, err := io.CopyN(io.Discard, c, int64(b.N)*benchChunk)
	if err != nil {
		b.Fatalf("after %d bytes: %v", n, err)
	}
}

// BenchmarkTCPConnect measures guest connection setup (SYN, host dial,
// handshake, one byte echoed, close) through the NAT.
func BenchmarkTCPConnect(b *testing.B) {
	port := benchListener(b, func(c net.Conn) { io.Copy(c, c) })
	g := newTestNAT(b, Config{Policy: AllowAll(), Logger: slog.New(slog.DiscardHandler)})
	ctx := testCtx(b, 5*time.Minute)
	addr := gatewayPort(g, port)
	one := make([]byte, 1)
	b.ResetTimer()
	for range b.N {
		c, err := g.dialTCP(ctx, addr)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.Write(one); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, one); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conns/s")
}
