package ninep

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/capsa-sandbox/capsa/internal/strictjson"
	"slices"
	"strings"
	"time"

	"github.com/capsa-sandbox/capsa/virtio"
)

// What a snapshot keeps of a 9P session: what each of the guest's fids
// stands for (the attach it descends from, its path below the share's
// root, whether and how it was opened), so that a restored device makes
// them again on a new file server before the guest runs: the guest's
// mount and its open files go on. The device learns the paths from the
// requests it passes on (Tattach, Twalk, Tlcreate, the renames) and their
// replies, as QEMU's virtfs keeps a path for every fid.
//
// A fid cannot be made again when its file was removed (Tremove,
// Tunlinkat: an open file deleted in the guest is gone from the host too),
// when it held an extended attribute's value, or when its path no longer
// leads anywhere on the host at restore (changed there meanwhile): the
// guest's next use of such a fid gets an error, as for a file removed
// under it.

var _ virtio.Stateful = (*Device)(nil)

// sessionState is what a snapshot holds of the session.
type sessionSnapshot struct {
	Version  string              `json:"version"`
	Msize    uint32              `json:"msize"`
	Attaches []attachInfo        `json:"attaches"`
	Fids     map[uint32]*fidPath `json:"fids"`
}

// attachInfo is a Tattach's identity: uname, aname, n_uname.
type attachInfo struct {
	Uname  string `json:"uname"`
	Aname  string `json:"aname"`
	NUname uint32 `json:"n_uname"`
}

// fidPath is what one fid stands for.
type fidPath struct {
	Attach int      `json:"attach"`
	Path   []string `json:"path,omitempty"`
	Open   bool     `json:"open,omitempty"`
	Flags  uint32   `json:"flags,omitempty"` // Tlopen's
	// Lost: it cannot be made again (see above).
	Lost bool `json:"lost,omitempty"`
}

// pathOp is a request in flight that changes what fids stand for, with
// its decoded body.
type pathOp struct {
	typ byte
	f   []any // uint32, uint64, string or []string, by layout
}

// tracked are the requests whose replies change the fids' paths.
var tracked = map[byte]bool{
	tattach: true, twalk: true, tlopen: true, tlcreate: true, tclunk: true, tremove: true,
	trename: true, trenameat: true, tunlinkat: true, txattrwalk: true, txattrcreate: true,
}

const (
	tlopen    = 12
	tlcreate  = 14
	trename   = 20
	trenameat = 74
	tunlinkat = 76
	rwalk     = 111
	rlopen    = 13
	noFid     = ^uint32(0)
	maxWalk   = 16 // names in one Twalk (MAXWELEM)
	// Open flags a reopen leaves out: the file exists, and its data stay.
	openCreateFlags = 0o100 | 0o200 | 0o1000 // O_CREAT, O_EXCL, O_TRUNC
)

// decode splits a body that checkBody accepted into its fields.
func decode(typ byte, body []byte) []any {
	le := binary.LittleEndian
	var out []any
	str := func() string {
		n := int(le.Uint16(body))
		s := string(body[2 : 2+n])
		body = body[2+n:]
		return s
	}
	for _, f := range layouts[typ] {
		switch f {
		case '1':
			out, body = append(out, uint32(body[0])), body[1:]
		case '2':
			out, body = append(out, uint32(le.Uint16(body))), body[2:]
		case '4':
			out, body = append(out, le.Uint32(body)), body[4:]
		case '8':
			out, body = append(out, le.Uint64(body)), body[8:]
		case 's':
			out = append(out, str())
		case 'n':
			n := int(le.Uint16(body))
			body = body[2:]
			names := make([]string, n)
			for i := range names {
				names[i] = str()
			}
			out = append(out, names)
		case 'w':
			out = append(out, body[4:])
			body = nil
		}
	}
	return out
}

// trackPath records a request that changes the fids' paths; s.mu is held.
func (s *session) trackPath(tag uint16, typ byte, body []byte) {
	if tracked[typ] {
		s.pathOps[tag] = pathOp{typ: typ, f: decode(typ, body)}
	}
}

// applyPath updates the fids' paths for the reply msg to request tag;
// s.mu is held.
func (s *session) applyPath(tag uint16, msg []byte) {
	op, ok := s.pathOps[tag]
	if !ok {
		return
	}
	delete(s.pathOps, tag)
	f := op.f
	u32 := func(i int) uint32 { return f[i].(uint32) }
	str := func(i int) string { return f[i].(string) }
	if op.typ == tclunk || op.typ == tremove {
		// Released whatever the reply.
		p := s.paths[u32(0)]
		delete(s.paths, u32(0))
		if op.typ == tremove && msg[4] == op.typ+1 && p != nil && !p.Lost {
			s.lose(p.Attach, p.Path)
		}
		return
	}
	if msg[4] != op.typ+1 {
		return // refused: nothing changed
	}
	live := func(fid uint32) *fidPath {
		if p := s.paths[fid]; p != nil && !p.Lost {
			return p
		}
		return nil
	}
	switch op.typ {
	case tattach:
		a := attachInfo{Uname: str(2), Aname: str(3), NUname: u32(4)}
		i := slices.Index(s.attaches, a)
		if i < 0 {
			i = len(s.attaches)
			s.attaches = append(s.attaches, a)
		}
		s.paths[u32(0)] = &fidPath{Attach: i}
	case twalk:
		names := f[2].([]string)
		if len(msg) < headerLen+2 || int(binary.LittleEndian.Uint16(msg[headerLen:])) != len(names) {
			return // a partial walk leaves newfid as it was
		}
		np := &fidPath{Lost: true}
		if base := live(u32(0)); base != nil {
			np = &fidPath{Attach: base.Attach, Path: walkPath(base.Path, names)}
		}
		s.paths[u32(1)] = np
	case tlopen:
		if p := live(u32(0)); p != nil {
			p.Open, p.Flags = true, u32(1)
		}
	case tlcreate:
		if p := live(u32(0)); p != nil {
			p.Path = append(slices.Clone(p.Path), str(1))
			p.Open, p.Flags = true, u32(2)
		}
	case trename:
		if p, d := live(u32(0)), live(u32(1)); p != nil && d != nil && p.Attach == d.Attach {
			s.move(p.Attach, p.Path, append(slices.Clone(d.Path), str(2)))
		}
	case trenameat:
		if o, n := live(u32(0)), live(u32(2)); o != nil && n != nil && o.Attach == n.Attach {
			s.move(o.Attach, append(slices.Clone(o.Path), str(1)), append(slices.Clone(n.Path), str(3)))
		}
	case tunlinkat:
		if d := live(u32(0)); d != nil {
			s.lose(d.Attach, append(slices.Clone(d.Path), str(1)))
		}
	case txattrwalk:
		s.paths[u32(1)] = &fidPath{Lost: true}
	case txattrcreate:
		if p := s.paths[u32(0)]; p != nil {
			p.Lost = true
		}
	}
}

// walkPath is base with names walked: ".." goes up, but not above the
// share's root (where the file server stops too).
func walkPath(base, names []string) []string {
	p := slices.Clone(base)
	for _, n := range names {
		switch n {
		case "..":
			if len(p) > 0 {
				p = p[:len(p)-1]
			}
		case ".", "":
		default:
			p = append(p, n)
		}
	}
	return p
}

// under reports whether path is at or below prefix.
func under(path, prefix []string) bool {
	return len(path) >= len(prefix) && slices.Equal(path[:len(prefix)], prefix)
}

// move gives every fid at or below from (on attach a) the path below to.
func (s *session) move(a int, from, to []string) {
	for _, p := range s.paths {
		if !p.Lost && p.Attach == a && under(p.Path, from) {
			p.Path = append(slices.Clone(to), p.Path[len(from):]...)
		}
	}
}

// lose marks every fid at or below path (on attach a) lost: its file is
// gone.
func (s *session) lose(a int, path []string) {
	for _, p := range s.paths {
		if p.Attach == a && under(p.Path, path) {
			p.Lost = true
		}
	}
}

// SaveState implements virtio.Stateful: the session's version, msize and
// what each of the guest's fids stands for. No request may be in flight
// (the machine's gate is closed).
func (d *Device) SaveState() (json.RawMessage, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.sess
	if s == nil {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := len(s.pending) + len(s.internal); n > 0 {
		return nil, fmt.Errorf("virtio-9p %s: save state: %d requests in flight", d.tag, n)
	}
	st := sessionSnapshot{Version: s.version, Msize: s.serverMsize, Attaches: s.attaches, Fids: s.paths}
	b, err := json.Marshal(st)
	if err != nil {
		return nil, fmt.Errorf("virtio-9p %s: save state: %w", d.tag, err)
	}
	return b, nil
}

// check refuses a saved session that no device could have had.
func (st *sessionSnapshot) check() error {
	switch {
	case st.Msize != 0 && (st.Msize < MinMessage || st.Msize > MaxMessage):
		return fmt.Errorf("msize %d", st.Msize)
	case st.Msize != 0 && !strings.HasPrefix(st.Version, "9P2000.L"):
		return fmt.Errorf("version %q", st.Version)
	case len(st.Fids) > MaxFids:
		return fmt.Errorf("%d fids, at most %d", len(st.Fids), MaxFids)
	case len(st.Attaches) > len(st.Fids)+1:
		return fmt.Errorf("%d attaches for %d fids", len(st.Attaches), len(st.Fids))
	}
	for fid, p := range st.Fids {
		if p == nil || fid == noFid {
			return fmt.Errorf("fid %d", fid)
		}
		if p.Lost {
			continue
		}
		if p.Attach < 0 || p.Attach >= len(st.Attaches) {
			return fmt.Errorf("fid %d: attach %d of %d", fid, p.Attach, len(st.Attaches))
		}
		if len(p.Path) > 4096 {
			return fmt.Errorf("fid %d: a path of %d names", fid, len(p.Path))
		}
		for _, n := range p.Path {
			if n == "" || n == "." || n == ".." || len(n) > 255 || strings.ContainsAny(n, "/\x00") {
				return fmt.Errorf("fid %d: path name %q", fid, n)
			}
		}
	}
	return nil
}

// RestoreState implements virtio.Stateful: on the new session of a device
// just started on its restored queue, before the guest runs, it settles
// the version and makes each of the guest's fids again (attach, walk,
// open), so the guest's mount and open files go on. A fid that cannot be
// made again stays unknown to the server: the guest's next use of it gets
// an error. The state is untrusted: checked first, and every path is
// walked by the file server, which keeps it inside the share.
func (d *Device) RestoreState(raw json.RawMessage) error {
	if virtio.NoState(raw) {
		return nil
	}
	var st sessionSnapshot
	if err := strictjson.Decode(raw, &st); err != nil {
		return fmt.Errorf("virtio-9p %s: restore: %w", d.tag, err)
	}
	if err := st.check(); err != nil {
		return fmt.Errorf("virtio-9p %s: restore: %w", d.tag, err)
	}
	if st.Msize == 0 {
		return nil // the guest never spoke 9P
	}
	d.mu.Lock()
	s := d.sess
	d.mu.Unlock()
	if s == nil {
		return fmt.Errorf("virtio-9p %s: restore: the device is not running", d.tag)
	}
	lost, err := s.replay(&st)
	if err != nil {
		return fmt.Errorf("virtio-9p %s: restore: %w", d.tag, err)
	}
	if lost > 0 {
		d.log.Warn("virtio-9p: some of the guest's files could not be found again after the restore (removed, or changed on the host)", "fids", lost)
	}
	return nil
}

// replay makes st's fids on the session's new server and returns how many
// could not be made.
func (s *session) replay(st *sessionSnapshot) (lost int, err error) {
	le := binary.LittleEndian
	var tag uint16
	rt := func(typ byte, body []byte) ([]byte, error) {
		tag++
		return s.roundTrip(typ, tag, body)
	}
	str := func(b []byte, v string) []byte { return append(le.AppendUint16(b, uint16(len(v))), v...) }
	r, err := rt(tversion, str(le.AppendUint32(nil, st.Msize), st.Version))
	if err != nil {
		return 0, err
	}
	if r[4] != rversion {
		return 0, fmt.Errorf("the file server refused version %s", st.Version)
	}
	// A temporary fid per attach the fids descend from, numbered below
	// NOFID where the guest has none.
	next := noFid - 1
	tmp := map[int]uint32{}
	fids := make([]uint32, 0, len(st.Fids))
	for fid, p := range st.Fids {
		fids = append(fids, fid)
		if _, ok := tmp[p.Attach]; ok || p.Lost {
			continue
		}
		for st.Fids[next] != nil {
			next--
		}
		a := st.Attaches[p.Attach]
		body := str(str(le.AppendUint32(le.AppendUint32(nil, next), noFid), a.Uname), a.Aname)
		r, err := rt(tattach, le.AppendUint32(body, a.NUname))
		if err != nil {
			return 0, err
		}
		if r[4] != tattach+1 {
			return 0, fmt.Errorf("the file server refused the guest's attach (%s, %q)", a.Uname, a.Aname)
		}
		tmp[p.Attach] = next
		next--
	}
	slices.Sort(fids)
	for _, fid := range fids {
		p := st.Fids[fid]
		if p.Lost {
			lost++
			continue
		}
		ok, err := s.remake(rt, tmp[p.Attach], fid, p)
		if err != nil {
			return lost, err
		}
		if !ok {
			lost++
		}
	}
	for _, t := range tmp {
		if _, err := rt(tclunk, le.AppendUint32(nil, t)); err != nil {
			return lost, err
		}
	}
	return lost, nil
}

// remake walks from the attach's fid to fid's path and opens it as the
// guest had; false if the file server could not.
func (s *session) remake(rt func(byte, []byte) ([]byte, error), from, fid uint32, p *fidPath) (bool, error) {
	le := binary.LittleEndian
	names := p.Path
	for first := true; first || len(names) > 0; first = false {
		n := min(len(names), maxWalk)
		src := fid
		if first {
			src = from
		}
		body := le.AppendUint16(le.AppendUint32(le.AppendUint32(nil, src), fid), uint16(n))
		for _, name := range names[:n] {
			body = append(le.AppendUint16(body, uint16(len(name))), name...)
		}
		r, err := rt(twalk, body)
		if err != nil {
			return false, err
		}
		if r[4] != rwalk || len(r) < headerLen+2 || int(le.Uint16(r[headerLen:])) != n {
			if !first {
				rt(tclunk, le.AppendUint32(nil, fid))
			}
			return false, nil
		}
		names = names[n:]
	}
	if p.Open {
		r, err := rt(tlopen, le.AppendUint32(le.AppendUint32(nil, fid), p.Flags&^openCreateFlags))
		if err != nil {
			return false, err
		}
		if r[4] != rlopen {
			rt(tclunk, le.AppendUint32(nil, fid))
			return false, nil
		}
	}
	return true, nil
}

// roundTrip sends the device's own request to the server and waits for
// its reply, through the same checks and bookkeeping as the guest's.
func (s *session) roundTrip(typ byte, tag uint16, body []byte) ([]byte, error) {
	ch := make(chan []byte, 1)
	msg := message(typ, tag, body)
	if _, _, reply, err := s.admitMsg(msg, tag, nil, ch); err != nil || reply != nil {
		if err == nil {
			return reply, nil
		}
		return nil, err
	}
	select {
	case s.requests <- msg:
	case <-s.done:
		return nil, errors.New("the session ended")
	}
	select {
	case r := <-ch:
		return r, nil
	case <-s.done:
		return nil, errors.New("the session ended")
	case <-time.After(closeTimeout):
		return nil, fmt.Errorf("the file server did not answer within %v", closeTimeout)
	}
}
