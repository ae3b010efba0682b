package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/guestmem"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/snapshot"
	"github.com/capsa-sandbox/capsa/tlsproxy"
	"github.com/capsa-sandbox/capsa/vmm"
)

// Snapshot writes the sandbox to dir (which must not exist; see package
// snapshot for what it holds). The sandbox is paused only while its state
// is taken and its memory written, and runs on after (a sandbox paused
// before stays paused). Restore starts sandboxes from it.
//
// An image sandbox's writable root disk is captured too: reflinked where
// the host's file system can (copy-on-write), copied sparse otherwise; the
// image itself is named by digest and must still be in the image store
// at restore.
//
// Shares are carried by path: the snapshot names each share's host
// directory, and a restored guest finds its mount and open files again
// there (see package ninep: files removed or moved on the host meanwhile
// are errors for the guest), so the directory should not change between
// snapshot and restore.
//
// Limit, refused here with its reason: a sandbox with disks (a host file
// the snapshot would have to copy or trust unchanged).
func (s *Sandbox) Snapshot(ctx context.Context, dir string) error {
	return s.SnapshotWith(ctx, dir, SnapshotOptions{})
}

// SnapshotOptions choose what a snapshot records beside the sandbox.
type SnapshotOptions struct {
	// Inventory: the guest's files and the agent's processes, taken just
	// before the sandbox pauses (the guest runs meanwhile), so that
	// DiffSnapshots and DiffSince can compare it with a later state. It
	// costs a walk of the guest's file systems. A guest that cannot give
	// one (paused, an older agent, a tree beyond agent.MaxTreeEntries)
	// does not fail the snapshot: it records why instead, which a diff
	// then says.
	Inventory bool
	// Parent, when not empty, is a snapshot directory beside dir (of a
	// sandbox of the same vCPUs and memory: this one's earlier snapshot,
	// or the one it was restored from) that this snapshot is a layer
	// over: its memory file holds only the pages that differ from the
	// parent's, and restoring it needs the parent in place, unchanged
	// (package snapshot). The comparison reads both memories while the
	// sandbox is paused.
	Parent string
	// ParentOpen, when not nil, is Parent already opened, used instead
	// of opening Parent here: a chain another process lent this one
	// (snapshot.OpenLent), which it may not open itself. It stays the
	// caller's to close.
	ParentOpen *snapshot.Snapshot
	// DiskOnly: the snapshot holds the sandbox's spec and its image's
	// writable root disk (and its interception's CA), not its memory or
	// VM state (snapshot.WriteDisk): Reboot boots it again from it, and
	// Restore refuses it. The guest should have synced its disk first
	// (Guest.Sync): what its page cache held is lost. Only an image
	// sandbox has a disk to keep; no parent, fork or inventory.
	DiskOnly bool
	// Fork: the snapshot is for copies restored from it at once (Fork,
	// capsa fork), transient (snapshot.WriteOptions), in the sandbox's
	// fork chain, dir's directory, which is the sandbox's from then on
	// (every fork of the sandbox must write in the same one): no other
	// snapshot may be written there; what the sandbox wrote there is
	// removed when it ends, and the directory too if that leaves it
	// empty. snapshot.PruneChain keeps it to what the newest fork
	// snapshot needs, while no fork is under way. The first fork writes
	// the whole memory, as a base that the sandbox's memory is then
	// mapped from, copy-on-write, as a restored sandbox's is from its
	// snapshot; the host's page tables
	// then tell which pages the sandbox writes (guestmem.Memory.Dirty).
	// A later fork writes only those, as a layer over the base, found
	// without reading or comparing any page: the pause lasts about as
	// long as writing what changed since the base. Not with Parent.
	Fork bool
	// Progress, when not nil, is told of each step of the snapshot as it
	// begins and, while memory is written, how far that has come, after
	// each stretch written (as often as a page): for showing progress. It
	// is called on the snapshot's goroutine and must be quick (the
	// sandbox may be paused meanwhile): throttling is the caller's.
	Progress func(Progress)
}

// Progress is how far long work on a sandbox has come (a snapshot, a
// fork): the step under way and, where the step counts, how much of how
// much (bytes where Bytes says so, else items).
type Progress struct {
	Step  string `json:"step"`
	Done  int64  `json:"done,omitempty"`
	Total int64  `json:"total,omitempty"`
	Bytes bool   `json:"bytes,omitempty"`
}

// String is p in words: its step, and how far it has come where it
// counts ("writing memory: 96.0 of 512.0 MiB").
func (p Progress) String() string {
	switch {
	case p.Total == 0:
		return p.Step
	case p.Bytes:
		return fmt.Sprintf("%s: %.1f of %.1f MiB", p.Step, float64(p.Done)/(1<<20), float64(p.Total)/(1<<20))
	}
	return fmt.Sprintf("%s: %d of %d", p.Step, p.Done, p.Total)
}

// The steps of a snapshot (SnapshotOptions.Progress).
const (
	StepInventory   = "listing the guest's files"
	StepCopyRunning = "copying memory while it runs" // a fork's first
	StepMemory      = "writing memory"               // paused
	StepRootDisk    = "copying the root disk"        // paused
	StepStartCopies = "starting copies"              // a fork's copies done starting, or failing (package supervisor)
)

func (o SnapshotOptions) progress(p Progress) {
	if o.Progress != nil {
		o.Progress(p)
	}
}

// written reports step's progress through memory of size bytes, the
// first time once something is written: a step that may be given up
// before (a pre-copy refused) says nothing.
func (o SnapshotOptions) written(step string, size uint64) guestmem.Written {
	if o.Progress == nil {
		return nil
	}
	return func(upTo int64) { o.Progress(Progress{Step: step, Done: upTo, Total: int64(size), Bytes: true}) }
}

// writing reports that step begins, through memory of size bytes, and
// returns what reports how far it has come (written).
func (o SnapshotOptions) writing(step string, size uint64) guestmem.Written {
	o.progress(Progress{Step: step, Total: int64(size), Bytes: true})
	return o.written(step, size)
}

// LastPause is how long the sandbox's last snapshot or fork kept it
// paused: what its processes lost to the pause. A fork's first, which
// copies the memory while the sandbox runs and maps it from the copy
// after the pause, also slows the guest around it: the copy takes CPU,
// and each page the guest touches first after is a fault (see
// docs/performance.md).
func (s *Sandbox) LastPause() time.Duration { return time.Duration(s.lastPause.Load()) }

// SnapshotWith is Snapshot with options.
func (s *Sandbox) SnapshotWith(ctx context.Context, dir string, o SnapshotOptions) error {
	if err := s.Snapshottable(); err != nil {
		return err
	}
	spec, err := json.Marshal(s.c.Spec)
	if err != nil {
		return fmt.Errorf("sandbox: snapshot: %w", err)
	}
	var parent *snapshot.Snapshot
	if o.DiskOnly && (o.Fork || o.Parent != "" || o.Inventory || s.rootfs == nil) {
		return errors.New("sandbox: snapshot of the disk alone: only of an image sandbox, with no parent, fork or inventory")
	}
	if o.Fork && o.Parent != "" {
		return errors.New("sandbox: snapshot: a fork snapshot's parent is the fork chain's, not one given")
	}
	switch {
	case o.ParentOpen != nil:
		if o.Parent == "" || filepath.Clean(o.Parent) != filepath.Clean(o.ParentOpen.Dir) {
			return fmt.Errorf("sandbox: snapshot: the parent opened is %s, not %q", o.ParentOpen.Dir, o.Parent)
		}
		parent = o.ParentOpen
	case o.Parent != "":
		if parent, err = snapshot.Open(o.Parent); err != nil {
			return fmt.Errorf("sandbox: snapshot: the parent: %w", err)
		}
		defer parent.Close()
	}
	var inv *Inventory
	if o.Inventory {
		o.progress(Progress{Step: StepInventory})
		inv = s.snapshotInventory(ctx)
	}
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	wasPaused := s.Paused()
	// A fork that writes the whole memory (the chain's first) writes it
	// before the pause, while the sandbox runs, and pauses only to
	// write again what changed meanwhile.
	var precopy *snapshot.MemoryCopy
	var copyTime time.Duration
	if o.Fork && !wasPaused && s.forkBase == nil && s.clearRefs != nil {
		t0 := time.Now()
		var perr error
		if precopy, perr = snapshot.PreCopy(dir, s.vm.Memory(), s.clearRefs, o.written(StepCopyRunning, s.vm.Memory().Size())); perr != nil {
			s.c.logger().Info("sandbox: fork: no memory copy while running: the pause writes it all", "err", perr)
			precopy = nil
			if errors.Is(perr, guestmem.ErrNoSoftDirty) {
				// Not asked again of this kernel.
				s.clearRefs.Close()
				s.clearRefs = nil
			}
		} else {
			defer precopy.Close()
			copyTime = time.Since(t0)
		}
	}
	start := time.Now()
	if err := s.vm.Pause(ctx); err != nil {
		return fmt.Errorf("sandbox: snapshot: %w", err)
	}
	switch {
	case o.DiskOnly:
		// Nothing of the VM: its shape, from the spec.
		m := snapshot.Manifest{Spec: spec, CPUs: s.c.CPUs, MemoryBytes: uint64(s.c.MemoryMiB) << 20, ImageDigest: s.rootfs.img.Digest}
		err = snapshot.WriteDisk(dir, m, s.snapshotFiles(nil, o))
	case o.Fork:
		err = s.writeFork(dir, spec, precopy, o)
	default:
		err = s.writeSnapshot(dir, spec, inv, parent, o)
	}
	if !wasPaused {
		// The clock was never stopped for the guest: it runs on as after
		// a short descheduling, and needs no setting.
		err = errors.Join(err, s.vm.Continue())
		s.lastPause.Store(int64(time.Since(start)))
	}
	if precopy != nil && precopy.Failed != nil {
		s.c.logger().Warn("sandbox: fork: the memory copied while running could not be finished: the pause wrote it all", "err", precopy.Failed)
	} else if precopy != nil && err == nil {
		s.c.logger().Info("sandbox: fork: memory copied while running", "copy", copyTime.Round(time.Millisecond), "clear_refs", precopy.Cleared().Round(time.Millisecond),
			"pause", time.Duration(s.lastPause.Load()).Round(time.Millisecond), "pages_written_paused", precopy.Pages)
	}
	return err
}

// forkLayerRuns bounds a fork layer's runs: a copy restored from it maps
// each, and Fork and Pool may restore many in one process, all under the
// kernel's 65530 mappings.
const forkLayerRuns = 256

// writeFork writes a fork snapshot to dir (SnapshotOptions.Fork), with
// snapMu held and the VM paused, transient (no checksum, no fsync: copies
// restore from it at once and it goes before long).
//
// The fork chain is a base, the whole memory, which the memory is mapped
// from since (guestmem.Memory.Remap), and layers over it. A fork writes a
// layer of every page written since the base was mapped
// (guestmem.Memory.Dirty: the host's page tables say which, no page is
// read to find them), so each layer holds what the one before it held,
// and more. The memory is not mapped from a layer: that would cost a
// mapping per run and, for KVM, an invalidation of each, during the
// pause, to save writing the same pages again at the next fork. The base
// is written again (the first fork, a base elsewhere, the pages written
// since grown past a quarter of the memory, Dirty failing); the chain's
// first base, of memory that is the sandbox's own, is mostly written
// before the pause (precopy: SnapshotWith begins it while the sandbox
// runs, and the pause writes only what changed since). Nothing is
// removed here: copies of an earlier fork may still be restoring from
// it (PruneChain, once none is; the sandbox's end removes it all).
//
// Mapping the memory from a new base can fail half done, leaving guest
// memory unmapped: the sandbox is then stopped, not run on with pages
// missing.
func (s *Sandbox) writeFork(dir string, spec []byte, precopy *snapshot.MemoryCopy, so SnapshotOptions) error {
	chain := filepath.Dir(dir)
	if s.forkChain != chain {
		if s.forkChain != "" {
			return fmt.Errorf("sandbox: fork: the fork chain is in %s, not %s", s.forkChain, chain)
		}
		s.forkChain = chain
	}
	mem := s.vm.Memory()
	base := s.forkBase
	var runs []guestmem.Run
	if base != nil {
		var err error
		if runs, err = mem.Dirty(forkLayerRuns); err != nil {
			s.c.logger().Warn("sandbox: fork: the pages written since the last fork are not known: the whole memory is written", "err", err)
			base = nil
		}
		var n int64
		for _, r := range runs {
			n += r.Len
		}
		if uint64(n) > mem.Size()/4 {
			base = nil
		}
	}
	err := s.writeSnapshotWith(dir, spec, nil, so, func(m snapshot.Manifest, st *vmm.State, extra map[string]snapshot.Extra) error {
		o := snapshot.WriteOptions{Transient: true, Written: so.writing(StepMemory, mem.Size())}
		if base != nil {
			o.Parent, o.Runs = base, runs
		} else {
			o.PreCopy = precopy
		}
		return snapshot.WriteWith(dir, m, st, mem, extra, o)
	})
	if err != nil {
		return err
	}
	s.forkWritten = append(s.forkWritten, dir)
	if base != nil {
		return nil
	}
	// A new base: the memory is mapped from it.
	if s.forkBase != nil {
		s.forkBase.Close()
		s.forkBase = nil
	}
	snap, err := snapshot.Open(dir)
	if err != nil {
		// The snapshot is whole; the memory stays its own, and the
		// next fork writes a base again.
		s.c.logger().Warn("sandbox: fork: the memory stays its own, not mapped from the fork snapshot", "dir", dir, "err", err)
		return nil
	}
	if err := mem.Remap(snap.File(snapshot.MemoryFile)); err != nil {
		snap.Close()
		s.cancel()
		return fmt.Errorf("sandbox: fork: map the memory from its snapshot: %w: the sandbox is stopped", err)
	}
	s.forkBase = snap
	s.forkRemaps.Add(1)
	return nil
}

// Snapshottable says why the sandbox cannot be snapshotted, if it cannot:
// a sandbox with disks, or with virtio-fs shares.
func (s *Sandbox) Snapshottable() error {
	if len(s.c.Disks) > 0 {
		return errors.New("sandbox: snapshot: a sandbox with disks cannot be snapshotted: the snapshot would depend on the disk files staying unchanged")
	}
	if s.c.ShareFS == ShareFSVirtioFS && len(s.c.Shares) > 0 {
		return errors.New("sandbox: snapshot: a sandbox with virtio-fs shares cannot be snapshotted yet: the guest's FUSE node ids name files this VMM holds open (use --share-fs 9p)")
	}
	return nil
}

func (s *Sandbox) writeSnapshot(dir string, spec []byte, inv *Inventory, parent *snapshot.Snapshot, o SnapshotOptions) error {
	return s.writeSnapshotWith(dir, spec, inv, o, func(m snapshot.Manifest, st *vmm.State, extra map[string]snapshot.Extra) error {
		mem := s.vm.Memory()
		return snapshot.WriteWith(dir, m, st, mem, extra, snapshot.WriteOptions{Parent: parent, Written: o.writing(StepMemory, mem.Size())})
	})
}

// writeSnapshotWith takes the paused VM's state and gathers the
// snapshot's manifest and files, which write then writes.
func (s *Sandbox) writeSnapshotWith(dir string, spec []byte, inv *Inventory, o SnapshotOptions, write func(snapshot.Manifest, *vmm.State, map[string]snapshot.Extra) error) error {
	st, err := s.vm.State()
	if err != nil {
		return fmt.Errorf("sandbox: snapshot: %w", err)
	}
	m := snapshot.Manifest{Spec: spec, CPUModel: st.CPUModel(), CPUs: st.CPUs, MemoryBytes: st.MemoryBytes}
	s.mu.Lock()
	if s.main != nil {
		m.MainProcess = s.main.ID
	}
	s.mu.Unlock()
	if s.rootfs != nil {
		m.ImageDigest = s.rootfs.img.Digest
	}
	return write(m, st, s.snapshotFiles(inv, o))
}

// snapshotFiles are the files a snapshot holds beside the VM's state and
// memory: an image sandbox's writable root disk, the interception's CA,
// the inventory.
func (s *Sandbox) snapshotFiles(inv *Inventory, o SnapshotOptions) map[string]snapshot.Extra {
	extra := map[string]snapshot.Extra{}
	if r := s.rootfs; r != nil {
		extra[snapshot.RootDiskFile] = func(path string) (string, error) {
			o.progress(Progress{Step: StepRootDisk})
			// Only its size is recorded: a checksum would read the
			// whole disk, which a reflink spares.
			return "", snapshot.CloneFile(r.upperPath, path)
		}
	}
	if in := s.net.interception(); in != nil {
		// The guest trusts this CA: a restore needs it, key and all.
		extra[snapshotCAFile] = func(path string) (string, error) {
			b, err := in.ca.MarshalPEM()
			if err != nil {
				return "", err
			}
			return "", os.WriteFile(path, b, 0o600)
		}
	}
	if inv != nil {
		extra[InventoryFile] = writeInventory(inv)
	}
	return extra
}

// RestoreOptions are what a restored sandbox gets that its snapshot does
// not hold, and what may safely differ from the snapshotted sandbox.
type RestoreOptions struct {
	Logger  *slog.Logger
	Console io.Writer
	// Stdout and Stderr receive the main process's output from the
	// restore on (what it wrote before is not replayed).
	Stdout, Stderr io.Writer
	// VsockSocket serves the guest's vsock ports on a Unix socket
	// (Builder.VsockSocket); the snapshot's own is not reused.
	VsockSocket string
	// Settings are the restored sandbox's host-facing settings, from
	// whoever restores it, never from the snapshot, whose manifest anyone
	// who can write a file can edit (RestoredSpec says what a restore
	// takes from each). nil: none, the safe default: no shares or volumes
	// (a snapshot that has one is refused, naming what to give), a NIC
	// that reaches nothing (deny-all) where the snapshot has one, no hub
	// grants, no limits. Fork gives its source's own.
	Settings *Spec
	// Hostname, when not empty, renames the guest (a fork's copies each
	// get their own).
	Hostname string
	// Identity, when not empty, is the restored sandbox's name in the
	// hub (HubSpec.Identity): a restore or a fork is not the sandbox it
	// was taken from, and must not publish as it.
	Identity string
	// Secrets are the values of the snapshot's secrets, by name: a
	// snapshot holds none (Fork passes the sandbox's own).
	Secrets map[string]string
	// NetAudit receives the audit log of intercepted requests
	// (Workload.NetAudit).
	NetAudit io.Writer
	// BeforeRun is called once the VM is restored and before its vCPUs
	// run again (Workload.BeforeRun): a restored guest's memory is the
	// snapshot's, as hostile as any input, from its first instruction.
	BeforeRun func(*Sandbox) error
}

// Restore starts a sandbox from the snapshot in dir: the guest goes on
// from where it was, its processes running (the main process among them,
// for Wait), its files as they were, its clocks set to the host's, its
// random number generator reseeded. The guest's memory is mapped from the
// snapshot copy-on-write, so the restore does not read it and sandboxes
// restored from one snapshot share its pages until they write them.
//
// Open connections did not survive: vsock connections are reset (the
// agent is reached afresh), network flows are reset by a new NAT with the
// same addresses.
func Restore(ctx context.Context, dir string, o RestoreOptions) (*Sandbox, error) {
	start := time.Now()
	var marks []vmm.Mark // steps before the VM is made, for its timeline
	mark := func(what string) { marks = append(marks, vmm.Mark{What: what, At: time.Since(start)}) }
	snap, err := snapshot.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: restore: %w", err)
	}
	defer snap.Close() // the memory stays mapped, the root disk copied
	if snap.Manifest.DiskOnly {
		return nil, fmt.Errorf("sandbox: restore: snapshot %s: %w (sandbox.Reboot)", dir, snapshot.ErrDiskOnly)
	}
	mark("sandbox: snapshot opened and checked (manifest, state, files)")
	w, err := restoredWorkload("restore", dir, snap, o)
	if err != nil {
		return nil, err
	}
	if w.c.CPUs != snap.Manifest.CPUs || uint64(w.c.MemoryMiB)<<20 != snap.Manifest.MemoryBytes {
		return nil, fmt.Errorf("sandbox: restore: snapshot %s: its spec says %d vCPUs and %d MiB, its state %d and %d bytes", dir, w.c.CPUs, w.c.MemoryMiB, snap.Manifest.CPUs, snap.Manifest.MemoryBytes)
	}
	var root *rootfs
	if w.c.Image != nil {
		if root, err = restoreRootfs(w.c, snap); err != nil {
			return nil, fmt.Errorf("sandbox: restore: %w", err)
		}
		mark("sandbox: writable root disk copied")
	}
	w.c.start = start
	s, err := startVM(ctx, w.c, root, snap, o.Hostname)
	if err != nil {
		return nil, err
	}
	for _, m := range marks {
		s.vm.MarkAt(m.What, m.At)
	}
	if err := s.resumeErr; err != nil {
		err = fmt.Errorf("sandbox: restore: %w", s.vmErr(err))
		s.Close()
		return nil, err
	}
	var main *agent.Process
	if id := snap.Manifest.MainProcess; id != 0 {
		if main, err = s.client.Attach(ctx, id, agent.AttachOptions{Stdout: o.Stdout, Stderr: o.Stderr, NoReplay: true}); err != nil {
			err = fmt.Errorf("sandbox: restore: the main process: %w", s.vmErr(err))
			s.Close()
			return nil, err
		}
	}
	if in := s.net.interception(); in != nil && w.c.installCA {
		if err := installCA(ctx, s.client, in.ca); err != nil {
			err = fmt.Errorf("sandbox: restore: %w", s.vmErr(err))
			s.Close()
			return nil, err
		}
	}
	s.vm.Mark("sandbox: restored, the main process attached")
	s.running(main)
	return s, nil
}

// Reboot starts a sandbox afresh from the files of the snapshot in dir:
// its image with a copy of its writable root disk, booted, and its main
// process started again, with the restore's settings (RestoreOptions,
// whose Settings, Secrets, Identity and outputs mean what they mean to
// Restore). The snapshot's memory is not read, so nothing that ran
// survives: the disk is as the guest had written it back by the
// snapshot, what its page cache still held is lost, as after a power cut
// (ext4's journal recovers the file system at the boot). E2B calls this a
// resume without memory. Only an image sandbox has a disk of its own to
// boot from; the snapshot itself is left as it is.
func Reboot(ctx context.Context, dir string, o RestoreOptions) (*Sandbox, error) {
	snap, err := snapshot.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: reboot: %w", err)
	}
	defer snap.Close()
	// The guest's disk trusts the snapshot's CA already (restoredWorkload
	// gives it): a new one would be added beside it at every reboot.
	w, err := restoredWorkload("reboot", dir, snap, o)
	if err != nil {
		return nil, err
	}
	if w.c.Image == nil {
		return nil, fmt.Errorf("sandbox: reboot: snapshot %s: not of an image sandbox: it has no disk of its own to boot from", dir)
	}
	w.Stdout(o.Stdout).Stderr(o.Stderr)
	root, err := restoreRootfs(w.c, snap)
	if err != nil {
		return nil, fmt.Errorf("sandbox: reboot: %w", err)
	}
	return w.boot(ctx, root)
}

// restoredWorkload is the workload of a sandbox started from snap (in
// dir) with o, for Restore and Reboot (op, in errors): the spec the
// snapshot and o's settings give (restoredSpec), o's socket, identity,
// secrets, audit log, logger, console and BeforeRun, and the snapshot's
// interception CA, checked.
func restoredWorkload(op, dir string, snap *snapshot.Snapshot, o RestoreOptions) (*Workload, error) {
	spec, err := restoredSpec(snap, o.Settings)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %s: snapshot %s: %w", op, dir, err)
	}
	spec.VsockSocket = o.VsockSocket
	if o.Identity != "" {
		if spec.Hub == nil {
			spec.Hub = &HubSpec{}
		}
		spec.Hub.Identity = o.Identity
	}
	w := FromSpec(spec).Secrets(o.Secrets).NetAudit(o.NetAudit)
	w.c.log, w.c.console, w.c.beforeRun = o.Logger, o.Console, o.BeforeRun
	if err := w.snapshotCA(snap); err != nil {
		return nil, fmt.Errorf("sandbox: %s: snapshot %s: %w", op, dir, err)
	}
	if err := w.c.err(); err != nil {
		return nil, fmt.Errorf("sandbox: %s: %w", op, err)
	}
	return w, nil
}

// snapshotCA gives w the interception CA snap holds, where w's network
// intercepts: the guest trusts that one.
func (w *Workload) snapshotCA(snap *snapshot.Snapshot) error {
	n := w.c.Network
	if n == nil || !n.intercepts() {
		return nil
	}
	b, err := snap.ReadFile(snapshotCAFile, 1<<20)
	if errors.Is(err, fs.ErrNotExist) && !snapshotIntercepts(snap) {
		// Taken without interception: the guest trusts no CA of
		// capsa's yet. The restore makes one and installs it
		// (w.c.installCA) once the guest runs.
		w.c.installCA = true
		return nil
	}
	if err == nil {
		w.c.ca, err = tlsproxy.ParseCA(b)
	}
	if err != nil {
		return fmt.Errorf("the interception's CA: %w", err)
	}
	return nil
}

// CheckSnapshotCA checks that header rules of these hosts fit a sandbox
// restored or booted again from the snapshot in dir: its guest trusts the
// snapshot's interception CA, which may name only the hosts it was made
// for (tlsproxy.ErrOutsideCA otherwise). A snapshot without a CA takes
// any: its restore makes one.
func CheckSnapshotCA(dir string, rules []HeaderSpec) error {
	snap, err := snapshot.Open(dir)
	if err != nil {
		return err
	}
	defer snap.Close()
	b, err := snap.ReadFile(snapshotCAFile, 1<<20)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var ca *tlsproxy.CA
	if err == nil {
		ca, err = tlsproxy.ParseCA(b)
	}
	if err != nil {
		return fmt.Errorf("snapshot %s: the interception's CA: %w", dir, err)
	}
	for _, r := range rules {
		if err := ca.CheckHosts(r.Host); err != nil {
			return fmt.Errorf("header rule: %w", err)
		}
	}
	return nil
}

// snapshotIntercepts says whether snap's own spec intercepted TLS (then
// it must hold its CA).
func snapshotIntercepts(snap *snapshot.Snapshot) bool {
	var saved Spec
	return json.Unmarshal(snap.Manifest.Spec, &saved) != nil || (saved.Network != nil && saved.Network.intercepts())
}

// Settings returns what the builder holds as a restore's host-facing
// settings (RestoreOptions.Settings) and its secrets' values, or what is
// wrong with them: a restore's are built and checked by the same methods
// as a boot's.
func (b *Builder) Settings() (*Spec, map[string]string, error) {
	w := &Workload{c: b.c}
	s, err := w.Spec()
	if err != nil {
		return nil, nil, err
	}
	return &s, w.SecretValues(), nil
}

// RestoredSpec is the description of a sandbox restored from the snapshot
// in dir with settings (RestoreOptions.Settings; nil: none): what the
// snapshot's guest already is, from its manifest, and every host-facing
// setting from settings, never from the file. From the snapshot: vCPUs,
// memory, the environment, the main process, the image (its reference
// and arguments, not its store), the guest paths that have a share or a
// volume, whether there is a NIC, the secrets' placeholders. From
// settings: each share's host directory and mode and each volume's name,
// by guest path; the network's policy, published ports, DNS server,
// secrets' hosts (of the snapshot's secrets, by name), interception and
// upstream CAs; hub grants; limits, CPU quota, timeouts and output limit;
// the image store; the kernel and initramfs a reboot boots (Reboot; a
// restore runs the snapshot's). Settings that do not fit the snapshot (a share it has
// none on, a network it has no NIC for) are refused, naming what.
func RestoredSpec(dir string, settings *Spec) (Spec, error) {
	snap, err := snapshot.Open(dir)
	if err != nil {
		return Spec{}, err
	}
	defer snap.Close()
	if snap.Manifest.DiskOnly {
		return Spec{}, fmt.Errorf("snapshot %s: %w (it is a sandbox's suspension without memory: capsa resume boots it)", dir, snapshot.ErrDiskOnly)
	}
	spec, err := restoredSpec(snap, settings)
	if err != nil {
		return Spec{}, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return spec, nil
}

func restoredSpec(snap *snapshot.Snapshot, settings *Spec) (Spec, error) {
	var saved Spec
	if err := json.Unmarshal(snap.Manifest.Spec, &saved); err != nil {
		return Spec{}, fmt.Errorf("spec: %w", err)
	}
	if len(saved.Disks) > 0 || (saved.Image != nil) != (snap.Manifest.ImageDigest != "") {
		return Spec{}, errors.New("its spec has disks or an image it does not carry")
	}
	r := settings
	if r == nil {
		r = &Spec{}
	}
	spec := Spec{
		CPUs: saved.CPUs, MemoryMiB: saved.MemoryMiB, Env: saved.Env, Main: saved.Main,
		Kernel: r.Kernel, Initrd: r.Initrd, // files of the host's, for a reboot
		CPUQuota: r.CPUQuota, Limits: r.Limits, ReadyTimeout: r.ReadyTimeout, Watchdog: r.Watchdog, OutputLimit: r.OutputLimit,
	}
	if r.Hub != nil {
		h := *r.Hub
		spec.Hub = &h
	}
	if saved.Image != nil {
		img := ImageSpec{Ref: saved.Image.Ref, Args: saved.Image.Args, Entrypoint: saved.Image.Entrypoint, RootfsSize: saved.Image.RootfsSize}
		if r.Image != nil {
			img.Store = r.Image.Store
		}
		spec.Image = &img
	}
	// Shares and volumes, each by the guest path the snapshot has it on.
	var err error
	shareGuest := func(sh ShareSpec) string { return sh.Guest }
	if spec.Shares, err = byGuestPath(saved.Shares, r.Shares, shareGuest, "share", "give its host directory (-v HOST:%s)"); err != nil {
		return Spec{}, err
	}
	volumeGuest := func(v VolumeSpec) string { return v.Guest }
	if spec.Volumes, err = byGuestPath(saved.Volumes, r.Volumes, volumeGuest, "volume", "give one (-v NAME:%s)"); err != nil {
		return Spec{}, err
	}
	// Whom the guest sees owning a volume's files is the guest's shape:
	// a restorer who names no owner gets the snapshot's.
	for i, v := range spec.Volumes {
		if j := slices.IndexFunc(saved.Volumes, func(s VolumeSpec) bool { return s.Guest == v.Guest }); j >= 0 && v.UID == 0 && v.GID == 0 {
			spec.Volumes[i].UID, spec.Volumes[i].GID = saved.Volumes[j].UID, saved.Volumes[j].GID
		}
	}
	switch {
	case saved.Network == nil && r.Network != nil:
		return Spec{}, errors.New("it was taken without a network: a restore cannot add one")
	case saved.Network != nil && r.Network == nil:
		spec.Network = &NetworkSpec{Policy: netstack.DenyAll()}
	case saved.Network != nil:
		n := *r.Network
		// The guest holds the snapshot's placeholders; where each
		// secret may go is the restorer's to say.
		n.Secrets = nil
		for _, sec := range r.Network.Secrets {
			i := slices.IndexFunc(saved.Network.Secrets, func(s SecretSpec) bool { return s.Name == sec.Name })
			if i < 0 {
				return Spec{}, fmt.Errorf("it has no secret %s", sec.Name)
			}
			sec.Placeholder = saved.Network.Secrets[i].Placeholder
			n.Secrets = append(n.Secrets, sec)
		}
		spec.Network = &n
	}
	return spec, nil
}

// byGuestPath is given, the restorer's shares or volumes (kind), in the
// order the snapshot saved has them, matched by guest path: each the
// snapshot has must be given (else the error says how, give with the
// guest path for its %s), and none it lacks can be.
func byGuestPath[T any](saved, given []T, guest func(T) string, kind, give string) ([]T, error) {
	var out []T
	for _, sv := range saved {
		i := slices.IndexFunc(given, func(g T) bool { return guest(g) == guest(sv) })
		if i < 0 {
			return nil, fmt.Errorf("it has a %s on %s: "+give, kind, guest(sv), guest(sv))
		}
		out = append(out, given[i])
	}
	for _, g := range given {
		if !slices.ContainsFunc(saved, func(sv T) bool { return guest(sv) == guest(g) }) {
			return nil, fmt.Errorf("it has no %s on %s: a restore cannot add one", kind, guest(g))
		}
	}
	return out, nil
}

// restoreRootfs gives a restored image sandbox the snapshot's image, from
// the image store, and a copy of its writable root disk of its own.
func restoreRootfs(c config, snap *snapshot.Snapshot) (*rootfs, error) {
	digest := snap.Manifest.ImageDigest
	store, err := openImageStore(c)
	if err != nil {
		return nil, err
	}
	img, err := store.Get(digest)
	if err != nil {
		return nil, fmt.Errorf("the snapshot's image %s (%s): %w", c.Image.Ref, digest, err)
	}
	return newRootfs(c, store, img, func(path string) error {
		return snapshot.CloneFrom(snap.File(snapshot.RootDiskFile), path)
	})
}

// awaitAgent tells the restored guest it runs again (its clock, a fresh
// seed for its random numbers, hostname if not empty) and marks the
// sandbox ready once the agent has taken it, asking again until timeout:
// a restored agent does not announce itself again. An error from the
// agent itself (not a lost connection) is kept in resumeErr.
func (s *Sandbox) awaitAgent(timeout time.Duration, hostname string) {
	seed := make([]byte, 64)
	rand.Read(seed)
	deadline := time.Now().Add(timeout)
	for attempt := 1; time.Now().Before(deadline); attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := s.client.Resumed(ctx, agent.Resumed{TimeNs: time.Now().UnixNano(), Seed: seed, Hostname: hostname})
		cancel()
		var re *agent.RemoteError
		if err == nil || errors.As(err, &re) {
			s.vm.Mark("agent: first answer (resumed: clock, seed, hostname set)")
			s.resumeErr = err
			s.markReady()
			return
		}
		if attempt <= 3 { // the timeline shows what a restore waited on
			s.vm.Mark(fmt.Sprintf("agent: no answer to attempt %d: %v", attempt, err))
		}
		// Unanswered while the guest settles after the transport reset
		// (the timeline shows each attempt): asked again soon, then
		// less often.
		wait := 10 * time.Millisecond
		if attempt > 20 {
			wait = 100 * time.Millisecond
		}
		select {
		case <-s.vmDone:
			return
		case <-time.After(wait):
		}
	}
}
