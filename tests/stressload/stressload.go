// Package stressload is the heavy guest workload of `make stress`, shared by
// the guest program that runs it and the host test that checks it: a 9P
// tree hash, a large file copied over 9P, and TCP traffic to the host
// through the VMM's network. The same code runs under capsa (executed by
// the agent in a sandbox) and under QEMU's microvm (as the test init), so
// that their failure rates compare the VMMs and nothing else.
//
// Every result is a line "capsa-stress: KEY VALUE..." on the guest's
// output; the host recomputes each value from what it knows and calls any
// difference wrong output.
package stressload

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Prefix starts every result line.
const Prefix = "capsa-stress: "

// Config says what a guest run does. Its text form (String, Parse) fits
// on a kernel command line: "work=9p+net,dir=/mnt,addr=10.0.2.2:4000,bytes=16777216".
type Config struct {
	Work  []string // "9p", "net"
	Dir   string   // the share's mount point: Dir/tree is hashed, Dir/big.bin copied to Dir/out.bin
	Addr  string   // the host's TCP server, as the guest reaches it
	Bytes int64    // bytes each way over TCP
}

func (c Config) String() string {
	return fmt.Sprintf("work=%s,dir=%s,addr=%s,bytes=%d", strings.Join(c.Work, "+"), c.Dir, c.Addr, c.Bytes)
}

// Parse reads a Config's text form.
func Parse(s string) (Config, error) {
	var c Config
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return c, fmt.Errorf("stressload: %q is not KEY=VALUE", kv)
		}
		switch k {
		case "work":
			c.Work = strings.Split(v, "+")
		case "dir":
			c.Dir = v
		case "addr":
			c.Addr = v
		case "bytes":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				return c, fmt.Errorf("stressload: bytes=%q", v)
			}
			c.Bytes = n
		default:
			return c, fmt.Errorf("stressload: unknown key %q", k)
		}
	}
	return c, nil
}

// Run does the work in the guest and prints a result line for each part,
// then "capsa-stress: done". It stops at the first error.
func Run(c Config, out io.Writer) error {
	for _, w := range c.Work {
		start := time.Now()
		var line string
		switch w {
		case "9p":
			sum, files, size, err := HashTree(filepath.Join(c.Dir, "tree"))
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "%shash %s files %d bytes %d (%v)\n", Prefix, sum, files, size, time.Since(start).Round(time.Millisecond))
			start = time.Now()
			sum, err = copyFile(filepath.Join(c.Dir, "big.bin"), filepath.Join(c.Dir, "out.bin"))
			if err != nil {
				return err
			}
			line = "copy " + sum
		case "net":
			sent, acked, recv, err := netClient(c.Addr, c.Bytes)
			if err != nil {
				return err
			}
			line = fmt.Sprintf("net sent %s acked %s recv %s", sent, acked, recv)
		case "":
		default:
			return fmt.Errorf("stressload: unknown work %q", w)
		}
		if line != "" {
			fmt.Fprintf(out, "%s%s (%v)\n", Prefix, line, time.Since(start).Round(time.Millisecond))
		}
	}
	fmt.Fprintf(out, "%sdone\n", Prefix)
	return nil
}

// HashTree hashes every regular file under dir, in lexical order of their
// relative paths: the SHA-256 of "path\x00sha256(content)\n" lines.
func HashTree(dir string) (sum string, files int, size int64, err error) {
	var paths []string
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			rel, _ := filepath.Rel(dir, p)
			paths = append(paths, rel)
		}
		return nil
	})
	if err != nil {
		return "", 0, 0, fmt.Errorf("hash %s: %w", dir, err)
	}
	slices.Sort(paths)
	total := sha256.New()
	for _, rel := range paths {
		f, err := os.Open(filepath.Join(dir, rel))
		if err != nil {
			return "", 0, 0, err
		}
		h := sha256.New()
		n, err := io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", 0, 0, fmt.Errorf("hash %s: %w", rel, err)
		}
		size += n
		fmt.Fprintf(total, "%s\x00%x\n", rel, h.Sum(nil))
	}
	return hex.EncodeToString(total.Sum(nil)), len(paths), size, nil
}

// copyFile copies src to dst in 1 MiB writes and returns the data's hash.
func copyFile(src, dst string) (string, error) {
	in, err := os.Open(src)
	if err != nil {
		return "", err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	buf := make([]byte, 1<<20)
	if _, err := io.CopyBuffer(io.MultiWriter(out, h), in, buf); err != nil {
		out.Close()
		return "", fmt.Errorf("copy %s to %s: %w", src, dst, err)
	}
	if err := out.Close(); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Pattern returns n deterministic pseudo-random bytes for seed.
func Pattern(seed uint64, n int64) io.Reader {
	return io.LimitReader(&xorshift{s: seed*0x9e3779b97f4a7c15 | 1}, n)
}

// xorshift is a xorshift64 stream of bytes: the same bytes whatever sizes
// they are read in.
type xorshift struct {
	s    uint64
	left []byte // the unread end of the last block
	blk  [8]byte
}

func (x *xorshift) next() {
	x.s ^= x.s << 13
	x.s ^= x.s >> 7
	x.s ^= x.s << 17
}

func (x *xorshift) Read(p []byte) (int, error) {
	n := copy(p, x.left)
	x.left = x.left[n:]
	for ; n+8 <= len(p); n += 8 {
		x.next()
		binary.LittleEndian.PutUint64(p[n:], x.s)
	}
	if n < len(p) {
		x.next()
		binary.LittleEndian.PutUint64(x.blk[:], x.s)
		k := copy(p[n:], x.blk[:])
		x.left = x.blk[k:]
		n += k
	}
	return n, nil
}

// PatternSum is the hex SHA-256 of Pattern(seed, n).
func PatternSum(seed uint64, n int64) string {
	h := sha256.New()
	io.CopyBuffer(h, Pattern(seed, n), make([]byte, 1<<20))
	return hex.EncodeToString(h.Sum(nil))
}

// Seeds of the two directions of the TCP exchange.
const (
	SeedToHost  = 1
	SeedToGuest = 2
)

// netClient sends n bytes to the host (after an 8-byte length), reads the
// host's 32-byte hash of what it received, then reads the host's n bytes to
// EOF. It returns the hashes of what it sent, what the host acknowledged
// and what it received.
func netClient(addr string, n int64) (sent, acked, recv string, err error) {
	c, err := net.DialTimeout("tcp", addr, time.Minute)
	if err != nil {
		return "", "", "", err
	}
	defer c.Close()
	w := bufio.NewWriterSize(c, 256<<10)
	binary.Write(w, binary.BigEndian, n)
	h := sha256.New()
	if _, err := io.CopyBuffer(io.MultiWriter(w, h), Pattern(SeedToHost, n), make([]byte, 256<<10)); err != nil {
		return "", "", "", fmt.Errorf("net send: %w", err)
	}
	if err := w.Flush(); err != nil {
		return "", "", "", fmt.Errorf("net send: %w", err)
	}
	ack := make([]byte, sha256.Size)
	if _, err := io.ReadFull(c, ack); err != nil {
		return "", "", "", fmt.Errorf("net ack: %w", err)
	}
	rh := sha256.New()
	got, err := io.CopyBuffer(rh, c, make([]byte, 256<<10))
	if err != nil {
		return "", "", "", fmt.Errorf("net receive: %w", err)
	}
	if got != n {
		return "", "", "", fmt.Errorf("net receive: %d bytes, want %d", got, n)
	}
	return hex.EncodeToString(h.Sum(nil)), hex.EncodeToString(ack), hex.EncodeToString(rh.Sum(nil)), nil
}

// ServeConn is the host end of one guest's TCP exchange: it reads the
// length and the data, answers with the data's hash, then sends the same
// number of bytes of its own pattern and closes the connection.
func ServeConn(c net.Conn, limit int64) error {
	defer c.Close()
	var n int64
	if err := binary.Read(c, binary.BigEndian, &n); err != nil {
		return fmt.Errorf("read length: %w", err)
	}
	if n < 0 || n > limit {
		return fmt.Errorf("length %d out of range", n)
	}
	h := sha256.New()
	if _, err := io.CopyN(h, c, n); err != nil {
		return fmt.Errorf("read data: %w", err)
	}
	if _, err := c.Write(h.Sum(nil)); err != nil {
		return err
	}
	_, err := io.CopyBuffer(c, Pattern(SeedToGuest, n), make([]byte, 256<<10))
	return err
}

// Results collects the result lines of a guest's output: the value after
// each key ("hash", "copy", "net", "done").
func Results(output string) map[string]string {
	r := map[string]string{}
	for _, line := range strings.Split(output, "\n") {
		line = strings.TrimRight(line, "\r")
		i := strings.Index(line, Prefix)
		if i < 0 {
			continue
		}
		k, v, _ := strings.Cut(line[i+len(Prefix):], " ")
		r[k] = v
	}
	return r
}

// Check compares a guest's results with what the host expects for c; src
// is the host directory shared as c.Dir. It returns nil when every part
// of the work reported the right values.
func Check(c Config, output, src string) error {
	r := Results(output)
	var errs []error
	for _, w := range c.Work {
		switch w {
		case "9p":
			sum, files, size, err := HashTree(filepath.Join(src, "tree"))
			if err != nil {
				return err
			}
			want := fmt.Sprintf("%s files %d bytes %d", sum, files, size)
			if got, ok := r["hash"]; !ok || !strings.HasPrefix(got, want) {
				errs = append(errs, fmt.Errorf("hash = %q, want %q", got, want))
			}
			in, err1 := os.ReadFile(filepath.Join(src, "big.bin"))
			out, err2 := os.ReadFile(filepath.Join(src, "out.bin"))
			if err := errors.Join(err1, err2); err != nil {
				errs = append(errs, err)
				break
			}
			ws := sha256.Sum256(in)
			if got := r["copy"]; !strings.HasPrefix(got, hex.EncodeToString(ws[:])) {
				errs = append(errs, fmt.Errorf("copy = %q, want %x", got, ws))
			}
			if string(in) != string(out) {
				errs = append(errs, fmt.Errorf("out.bin (%d bytes) differs from big.bin (%d bytes)", len(out), len(in)))
			}
		case "net":
			sent := PatternSum(SeedToHost, c.Bytes)
			want := fmt.Sprintf("sent %s acked %s recv %s", sent, sent, PatternSum(SeedToGuest, c.Bytes))
			if got, ok := r["net"]; !ok || !strings.HasPrefix(got, want) {
				errs = append(errs, fmt.Errorf("net = %q, want %q", got, want))
			}
		}
	}
	if _, ok := r["done"]; !ok {
		errs = append(errs, errors.New("the guest did not report done"))
	}
	return errors.Join(errs...)
}
