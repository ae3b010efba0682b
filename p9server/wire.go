package p9server

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/hugelgupf/p9/p9"
)

// The 9P2000.L messages this server answers, by type number (a reply's is
// its request's plus one): Linux's include/net/9p/9p.h (enum p9_msg_t).
const (
	msgRlerror     = 7
	msgTstatfs     = 8
	msgTlopen      = 12
	msgTlcreate    = 14
	msgTsymlink    = 16
	msgTmknod      = 18
	msgTrename     = 20
	msgTreadlink   = 22
	msgTgetattr    = 24
	msgTsetattr    = 26
	msgTxattrwalk  = 30
	msgTxattrcreat = 32
	msgTreaddir    = 40
	msgTfsync      = 50
	msgTlock       = 52
	msgTgetlock    = 54
	msgTlink       = 70
	msgTmkdir      = 72
	msgTrenameat   = 74
	msgTunlinkat   = 76
	msgTversion    = 100
	msgTauth       = 102
	msgTattach     = 104
	msgTflush      = 108
	msgTwalk       = 110
	msgTread       = 116
	msgTwrite      = 118
	msgTclunk      = 120
	msgTremove     = 122
)

const (
	headerLen = 7 // size[4] type[1] tag[2]
	qidLen    = 13
	// maxWalk is the most names one Twalk may carry (MAXWELEM).
	maxWalk = 16
	// NoTag is the tag of a Tversion; NoFid stands for no fid (an
	// attach's afid).
	NoTag = 0xffff
	NoFid = ^uint32(0)
)

// errShort is the decoder's error for a message that ends early or
// carries more than its fields.
var errShort = errors.New("9P message shorter or longer than its fields")

// decoder reads a message body's fields, little-endian, and remembers
// the first error: every read past the end gives zeros.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) take(n int) []byte {
	if d.err != nil || n < 0 || len(d.b) < n {
		d.err = errShort
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *decoder) u16() uint16 {
	if v := d.take(2); v != nil {
		return binary.LittleEndian.Uint16(v)
	}
	return 0
}

func (d *decoder) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}

func (d *decoder) u64() uint64 {
	if v := d.take(8); v != nil {
		return binary.LittleEndian.Uint64(v)
	}
	return 0
}

// str reads a string: size[2] then its bytes, which are never copied
// out of the message unless they are kept.
func (d *decoder) str() string {
	n := d.u16()
	return string(d.take(int(n)))
}

// end reports the first error, or errShort if bytes are left over.
func (d *decoder) end() error {
	if d.err == nil && len(d.b) != 0 {
		d.err = errShort
	}
	return d.err
}

// encoder builds a reply: its header first, the size filled in by done.
type encoder struct{ b []byte }

func newReply(typ uint8, tag uint16, room int) *encoder {
	e := &encoder{b: make([]byte, headerLen, headerLen+room)}
	e.b[4] = typ
	binary.LittleEndian.PutUint16(e.b[5:], tag)
	return e
}

func (e *encoder) u8(v uint8)   { e.b = append(e.b, v) }
func (e *encoder) u16(v uint16) { e.b = binary.LittleEndian.AppendUint16(e.b, v) }
func (e *encoder) u32(v uint32) { e.b = binary.LittleEndian.AppendUint32(e.b, v) }
func (e *encoder) u64(v uint64) { e.b = binary.LittleEndian.AppendUint64(e.b, v) }

// str writes s (callers keep it under 64 KiB).
func (e *encoder) str(s string) {
	e.u16(uint16(len(s)))
	e.b = append(e.b, s...)
}

func (e *encoder) qid(q p9.QID) {
	e.u8(uint8(q.Type))
	e.u32(q.Version)
	e.u64(q.Path)
}

func (e *encoder) done() []byte {
	binary.LittleEndian.PutUint32(e.b, uint32(len(e.b)))
	return e.b
}

// errorReply is an Rlerror: ecode[4].
func errorReply(tag uint16, errno uint32) []byte {
	e := newReply(msgRlerror, tag, 4)
	e.u32(errno)
	return e.done()
}

// header splits a message into its type, tag and body, checking that its
// size field is its length.
func header(msg []byte) (typ uint8, tag uint16, body []byte, err error) {
	if len(msg) < headerLen {
		return 0, 0, nil, fmt.Errorf("9P message of %d bytes: shorter than its header", len(msg))
	}
	if n := binary.LittleEndian.Uint32(msg); n != uint32(len(msg)) {
		return 0, 0, nil, fmt.Errorf("9P message of %d bytes says it has %d", len(msg), n)
	}
	return msg[4], binary.LittleEndian.Uint16(msg[5:]), msg[headerLen:], nil
}

// The getattr request and valid masks (P9_GETATTR_*).
const (
	getMode        = 0x1
	getNLink       = 0x2
	getUID         = 0x4
	getGID         = 0x8
	getRDev        = 0x10
	getATime       = 0x20
	getMTime       = 0x40
	getCTime       = 0x80
	getINo         = 0x100
	getSize        = 0x200
	getBlocks      = 0x400
	getBTime       = 0x800
	getGen         = 0x1000
	getDataVersion = 0x2000
)

func attrMask(v uint64) p9.AttrMask {
	return p9.AttrMask{
		Mode: v&getMode != 0, NLink: v&getNLink != 0, UID: v&getUID != 0, GID: v&getGID != 0,
		RDev: v&getRDev != 0, ATime: v&getATime != 0, MTime: v&getMTime != 0, CTime: v&getCTime != 0,
		INo: v&getINo != 0, Size: v&getSize != 0, Blocks: v&getBlocks != 0, BTime: v&getBTime != 0,
		Gen: v&getGen != 0, DataVersion: v&getDataVersion != 0,
	}
}

func attrBits(m p9.AttrMask) uint64 {
	var v uint64
	for _, f := range []struct {
		set bool
		bit uint64
	}{
		{m.Mode, getMode}, {m.NLink, getNLink}, {m.UID, getUID}, {m.GID, getGID}, {m.RDev, getRDev},
		{m.ATime, getATime}, {m.MTime, getMTime}, {m.CTime, getCTime}, {m.INo, getINo}, {m.Size, getSize},
		{m.Blocks, getBlocks}, {m.BTime, getBTime}, {m.Gen, getGen}, {m.DataVersion, getDataVersion},
	} {
		if f.set {
			v |= f.bit
		}
	}
	return v
}

// The setattr valid mask (P9_ATTR_*).
const (
	setMode     = 0x1
	setUID      = 0x2
	setGID      = 0x4
	setSize     = 0x8
	setATime    = 0x10
	setMTime    = 0x20
	setCTime    = 0x40
	setATimeSet = 0x80
	setMTimeSet = 0x100
)

func setAttrMask(v uint32) p9.SetAttrMask {
	return p9.SetAttrMask{
		Permissions: v&setMode != 0, UID: v&setUID != 0, GID: v&setGID != 0, Size: v&setSize != 0,
		ATime: v&setATime != 0, MTime: v&setMTime != 0, CTime: v&setCTime != 0,
		ATimeNotSystemTime: v&setATimeSet != 0, MTimeNotSystemTime: v&setMTimeSet != 0,
	}
}

// direntLen is an Rreaddir entry's size: qid[13] offset[8] type[1]
// name[s].
func direntLen(name string) int { return qidLen + 8 + 1 + 2 + len(name) }

// fitsString says whether s can be a 9P string.
func fitsString(s string) bool { return len(s) <= math.MaxUint16 }
