// Command capsa-agent is the guest side of a capsa sandbox. The kernel runs
// it as /init (PID 1): it mounts proc, sys, dev and tmp, sets the hostname,
// brings up loopback, signals the VMM's boot marker, then starts itself
// again as the agent server, a child, and reaps every orphan while it runs.
// The server listens on vsock port 1024 and, once listening, connects to the
// host's port 1023 to say it is ready.
//
// When the agent stops (or is asked to shut down), init syncs and reboots:
// without ACPI a reboot is how a capsa guest ends.
//
// Run as capsa (/usr/local/bin/capsa in every guest: a link in the
// initramfs, this binary bound there in an image), it is the guest's
// command for the host's key-value store and mailbox: `capsa kv ...` and
// `capsa mailbox ...` (package hub/proto).
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/internal/bootmark"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == agent.ContainerExecArg {
		// The agent entering a container for a process (agent.Container).
		os.Exit(agent.ContainerExec())
	}
	if filepath.Base(os.Args[0]) == "capsa" {
		os.Exit(runGuestCommand(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if len(os.Args) > 1 && os.Args[1] == "serve" {
		// Started through /proc/self/exe, the server would be named
		// "exe" in ps and /proc/PID/comm; keep its own name.
		os.WriteFile("/proc/self/comm", []byte("capsa-agent"), 0)
		os.Exit(serve(log))
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "capsa-agent: run as the guest's /init, or `capsa-agent serve`")
		os.Exit(2)
	}
	initMachine(log)
}

type mount struct {
	src, dst, fstype string
	flags            uintptr
	data             string
}

// baseMounts come first: finding an image's disks needs /sys and /dev,
// and they move into the image's root.
var baseMounts = []mount{
	{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
	{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
	{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
}

// mounts are the rest of what every sandbox has; an image keeps its own
// /tmp (on its writable layer), as under Docker.
var mounts = []mount{
	{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"},
	{"tmpfs", "/dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
	{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
}

var tmpMount = mount{"tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"}

func mountAll(log *slog.Logger, ms []mount) {
	for _, m := range ms {
		os.MkdirAll(m.dst, 0o755)
		if err := unix.Mount(m.src, m.dst, m.fstype, m.flags, m.data); err != nil {
			log.Warn("mount", "target", m.dst, "err", err)
		}
	}
}

func initMachine(log *slog.Logger) {
	// The kernel starts init with almost no environment; commands are
	// looked up with this PATH (u-root's busybox links live in /bbin).
	os.Setenv("PATH", agent.DefaultPath)
	os.Setenv("HOME", "/root")
	mountAll(log, baseMounts)
	hostname := "capsa"
	var shares []string
	imageRoot := false
	if cmdline, err := os.ReadFile("/proc/cmdline"); err == nil {
		for _, f := range strings.Fields(string(cmdline)) {
			if v, ok := strings.CutPrefix(f, "capsa.hostname="); ok && v != "" {
				hostname = v
			}
			if v, ok := strings.CutPrefix(f, "capsa.share="); ok {
				shares = append(shares, v)
			}
			if v, ok := strings.CutPrefix(f, "capsa.virtiofs="); ok {
				shares = append(shares, "virtiofs:"+v)
			}
			if f == "capsa.root=image" {
				imageRoot = true
			}
		}
	}
	if imageRoot {
		// Without its image the sandbox cannot run what it was asked
		// to: end the boot, and the host reports the console.
		if err := switchToImage(); err != nil {
			log.Error("image root", "err", err)
			reboot()
		}
		mountAll(log, mounts)
		if err := writeHosts(hostname); err != nil {
			log.Warn("/etc/hosts", "err", err)
		}
		if err := bindGuestCommand(); err != nil {
			log.Warn("the guest's capsa command", "err", err)
		}
	} else {
		mountAll(log, append(mounts, tmpMount))
		os.MkdirAll("/root", 0o700)
	}
	// A share that cannot be mounted ends the boot: the host reports the
	// console, which says why, rather than run a sandbox without it.
	for _, sh := range shares {
		if err := mountShare(sh); err != nil {
			log.Error("share", "err", err)
			reboot()
		}
	}
	if err := unix.Sethostname([]byte(hostname)); err != nil {
		log.Warn("sethostname", "err", err)
	}
	if err := loopbackUp(); err != nil {
		log.Warn("loopback", "err", err)
	}
	// With a network, the kernel configured the NIC from ip= and lists
	// the name server in /proc/net/pnp, in resolv.conf's format.
	if pnp, err := os.ReadFile("/proc/net/pnp"); err == nil && strings.Contains(string(pnp), "nameserver") {
		os.MkdirAll("/etc", 0o755)
		if err := os.WriteFile("/etc/resolv.conf", pnp, 0o644); err != nil {
			log.Warn("resolv.conf", "err", err)
		}
	}
	if err := bootmark.Signal(); err != nil {
		log.Warn("boot marker", "err", err)
	}
	// /proc/self/exe reaches this program even when it is outside the
	// root (after switchToImage): it is a magic link, not a path.
	cmd := exec.Command("/proc/self/exe", "serve")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Start(); err != nil {
		log.Error("start agent", "err", err)
		reboot()
	}
	// Reap every child: the agent, and the orphans its processes leave.
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, 0, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil || pid == cmd.Process.Pid {
			if err == nil && !(ws.Exited() && ws.ExitStatus() == 0) {
				log.Error("agent stopped", "status", ws)
			}
			reboot()
		}
	}
}

// diskBySerial finds the block device whose virtio serial is serial.
func diskBySerial(serial string) (string, error) {
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		b, err := os.ReadFile("/sys/block/" + e.Name() + "/serial")
		if err == nil && strings.TrimSpace(string(b)) == serial {
			return "/dev/" + e.Name(), nil
		}
	}
	return "", fmt.Errorf("no disk with serial %s", serial)
}

// switchToImage makes the image the root: its EROFS disk read-only under
// an overlayfs whose writable layer is the ext4 disk, with /proc, /sys and
// /dev moved in. This process (PID 1) and the agent it starts stay
// capsa's own, running from the initramfs, now outside the root.
func switchToImage() error {
	img, err := diskBySerial("capsa-image")
	if err != nil {
		return err
	}
	upper, err := diskBySerial("capsa-upper")
	if err != nil {
		return err
	}
	const lower, upperMnt, root = "/.capsa/lower", "/.capsa/upper", "/.capsa/root"
	for _, d := range []string{lower, upperMnt, root} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount(img, lower, "erofs", unix.MS_RDONLY, ""); err != nil {
		return fmt.Errorf("mount the image %s: %w", img, err)
	}
	if err := unix.Mount(upper, upperMnt, "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount the writable layer %s: %w", upper, err)
	}
	for _, d := range []string{upperMnt + "/upper", upperMnt + "/work"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	// xino=on: inode numbers carry which layer they come from, so that
	// every st_ino is unique and readdir's d_ino agrees with it (with
	// "auto", overlayfs turns xino off for an EROFS lower layer without a
	// UUID, and a directory that another was renamed into listed the upper
	// disk's raw inode numbers). redirect_dir=on: a directory of the image
	// can be renamed (without it rename(2) fails with EXDEV, and a program
	// that does not fall back to copying, Python's os.rename, fails).
	opts := "lowerdir=" + lower + ",upperdir=" + upperMnt + "/upper,workdir=" + upperMnt + "/work,xino=on,redirect_dir=on"
	if err := unix.Mount("overlay", root, "overlay", 0, opts); err != nil {
		return fmt.Errorf("mount the overlay: %w", err)
	}
	for _, d := range []string{"/proc", "/sys", "/dev"} {
		if err := os.MkdirAll(root+d, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(d, root+d, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s into the image: %w", d, err)
		}
	}
	for _, d := range []struct {
		path string
		mode os.FileMode
	}{{"/tmp", 0o1777}, {"/run", 0o755}, {"/etc", 0o755}, {"/root", 0o700}} {
		if _, err := os.Lstat(root + d.path); os.IsNotExist(err) {
			if err := os.Mkdir(root+d.path, d.mode); err != nil {
				return err
			}
			os.Chmod(root+d.path, d.mode)
		}
	}
	if err := unix.Chdir(root); err != nil {
		return err
	}
	if err := unix.Mount(root, "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the image to /: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot into the image: %w", err)
	}
	return unix.Chdir("/")
}

// writeHosts gives an image the /etc/hosts a container has.
func writeHosts(hostname string) error {
	return os.WriteFile("/etc/hosts", []byte("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t"+hostname+"\n"), 0o644)
}

// mountShare mounts a share named on the kernel command line as
// TAG,ro|rw,PATH (PATH escaped as a URL path): a virtio-9p share, or a
// virtio-fs one where the spec starts "virtiofs:" (capsa.virtiofs=).
func mountShare(spec string) error {
	fstype := "9p"
	if v, ok := strings.CutPrefix(spec, "virtiofs:"); ok {
		fstype, spec = "virtiofs", v
	}
	parts := strings.SplitN(spec, ",", 3)
	if len(parts) != 3 || (parts[1] != "ro" && parts[1] != "rw") {
		return fmt.Errorf("capsa.share=%s: want TAG,ro|rw,PATH", spec)
	}
	tag, dir := parts[0], parts[2]
	dir, err := url.PathUnescape(dir)
	if err != nil || !strings.HasPrefix(dir, "/") {
		return fmt.Errorf("capsa.share=%s: bad guest path", spec)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("share %s: %w", tag, err)
	}
	var flags uintptr = unix.MS_NODEV
	if parts[1] == "ro" {
		flags |= unix.MS_RDONLY
	}
	if fstype == "virtiofs" {
		// The server says how long names and attributes stay valid
		// (package fusefs); the guest checks permissions itself
		// (virtio-fs mounts with default_permissions).
		if err := unix.Mount(tag, dir, "virtiofs", flags, ""); err != nil {
			return fmt.Errorf("mount virtio-fs share %s on %s: %w", tag, dir, err)
		}
		return nil
	}
	// access=client: the guest kernel checks permissions, as on a local
	// filesystem; the host enforces confinement and read-only itself.
	// cache=readahead: reads go through the page cache with readahead of
	// up to msize per request (with cache=none, Linux 6.12 reads a user
	// buffer one 4 KiB page per Tread); writes still go straight to the
	// host, metadata is never cached, and a file the host changes is read
	// afresh at its next open (p9fs versions QIDs by mtime and size).
	opts := "trans=virtio,version=9p2000.L,access=client,cache=readahead,msize=" + shareMsize
	if err := unix.Mount(tag, dir, "9p", flags, opts); err != nil {
		return fmt.Errorf("mount share %s on %s: %w", tag, dir, err)
	}
	return nil
}

// shareMsize is the 9P message size: the largest Linux's virtio transport
// takes (125 pages), for the fewest round trips per read or write; the
// readahead window is one message. Each round trip costs the guest a few
// exits (notify, interrupt, acknowledge), which dominate under nested
// virtualization: going from 256 KiB to this raised a 16 MiB cold read
// from about 30 to 36 MB/s in the nested host.
const shareMsize = "512000"

// loopbackUp sets IFF_UP on lo.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

func reboot() {
	unix.Sync()
	unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	select {}
}

// announceReady tells the host the agent listens, by connecting to its
// ready port. A connect can time out in the guest before the host ever
// sees it (Linux gives up on a vsock connect after 2 s, and a loaded or
// nested guest may not get its request out by then), so it is tried again
// until the host has heard it; a host that does not listen (a raw VM)
// refuses at once, and then it stops.
func announceReady(log *slog.Logger) {
	for attempt, wait := 1, 100*time.Millisecond; ; attempt++ {
		c, err := vsock.Dial(vsock.Host, agent.ReadyPort, nil)
		if err == nil {
			c.Write([]byte(agent.Version + "\n"))
			c.Close()
			return
		}
		if errors.Is(err, unix.ECONNREFUSED) || errors.Is(err, unix.ECONNRESET) || attempt == 20 {
			log.Debug("ready announcement not taken", "attempt", attempt, "err", err)
			return
		}
		time.Sleep(wait)
		wait = min(2*wait, 2*time.Second)
	}
}

// serve runs the agent server.
func serve(log *slog.Logger) int {
	l, err := vsock.Listen(agent.Port, nil)
	if err != nil {
		log.Error("listen", "port", agent.Port, "err", err)
		return 1
	}
	if err := agent.ProtectFromOOM(); err != nil {
		log.Warn("serve: exempting the server from the OOM killer", "err", err)
	}
	go announceReady(log)
	srv := &agent.Server{Log: log, ExecCgroups: agent.ExecCgroups, Shutdown: func() {
		time.Sleep(10 * time.Millisecond) // let the reply reach the host
		os.Exit(0)                        // init reboots when the agent exits
	}}
	if err := srv.Serve(context.Background(), l); err != nil {
		log.Error("serve", "err", err)
		return 1
	}
	return 0
}
