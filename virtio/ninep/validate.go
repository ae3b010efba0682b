package ninep

import (
	"encoding/binary"
	"fmt"
)

// layouts are the bodies of the 9P2000.L requests the server handles, as
// field codes: 1, 2, 4, 8 a little-endian
// integer of that many bytes; s a string (u16 length, then bytes); n a u16
// count of strings, then the strings; w Twrite's data (u32 count, then
// exactly count bytes).
//
// The device checks each request against them before the server sees it
// (p9server checks them again), so that a request whose body lies gets its
// error with its own tag, routed back to its descriptor chain. Types
// missing from the table (replies, and requests the server does not
// handle) are answered ENOSYS.
var layouts = map[byte]string{
	8:   "4",          // Tstatfs fid
	12:  "44",         // Tlopen fid flags
	14:  "4s444",      // Tlcreate fid name flags mode gid
	16:  "4ss4",       // Tsymlink fid name target gid
	18:  "4s4444",     // Tmknod dfid name mode major minor gid
	20:  "44s",        // Trename fid dfid name
	22:  "4",          // Treadlink fid
	24:  "48",         // Tgetattr fid mask
	26:  "4444488888", // Tsetattr fid valid mode uid gid size atime(2) mtime(2)
	30:  "44s",        // Txattrwalk fid newfid name
	32:  "4s84",       // Txattrcreate fid name size flags
	40:  "484",        // Treaddir fid offset count
	50:  "4",          // Tfsync fid
	52:  "414884s",    // Tlock fid type flags start length pid client
	54:  "41884s",     // Tgetlock fid type start length pid client
	70:  "44s",        // Tlink dfid fid name
	72:  "4s44",       // Tmkdir dfid name mode gid
	74:  "4s4s",       // Trenameat olddir oldname newdir newname
	76:  "4s4",        // Tunlinkat dfid name flags
	100: "4s",         // Tversion msize version
	102: "4ss4",       // Tauth afid uname aname uid
	104: "44ss4",      // Tattach fid afid uname aname uid
	108: "2",          // Tflush oldtag
	110: "44n",        // Twalk fid newfid names
	116: "484",        // Tread fid offset count
	118: "48w",        // Twrite fid offset data
	120: "4",          // Tclunk fid
	122: "4",          // Tremove fid
}

const errnoENOSYS = 38

// checkBody reports whether a request body of type typ decodes completely.
// It returns the errno to answer with when it does not.
func checkBody(typ byte, body []byte) (uint32, error) {
	layout, ok := layouts[typ]
	if !ok {
		return errnoENOSYS, fmt.Errorf("message type %d is not a request the server handles", typ)
	}
	le := binary.LittleEndian
	p := body
	need := func(n int) bool {
		if len(p) < n {
			return false
		}
		p = p[n:]
		return true
	}
	str := func() bool {
		if len(p) < 2 {
			return false
		}
		n := int(le.Uint16(p))
		return need(2 + n)
	}
	for _, f := range layout {
		ok := true
		switch f {
		case '1':
			ok = need(1)
		case '2':
			ok = need(2)
		case '4':
			ok = need(4)
		case '8':
			ok = need(8)
		case 's':
			ok = str()
		case 'n':
			if ok = len(p) >= 2; ok {
				n := int(le.Uint16(p))
				p = p[2:]
				for i := 0; i < n && ok; i++ {
					ok = str()
				}
			}
		case 'w':
			ok = len(p) >= 4 && int(le.Uint32(p)) == len(p)-4
		}
		if !ok {
			return errnoEINVAL, fmt.Errorf("message type %d: body of %d bytes is truncated or inconsistent (layout %s)", typ, len(body), layout)
		}
	}
	return 0, nil
}
