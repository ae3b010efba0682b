# fsprobe.py DIR: what everyday programs ask of a file system, tried in a
# fresh directory under DIR. Prints one JSON object: for each probe, "ok",
# the errno's name (ENOENT...) of the call that failed, or "bad: ..." when
# every call succeeded but the result was wrong. TestWorkspaceFidelity runs
# it on a share and on the image's own disk and compares.
import ctypes, errno, fcntl, json, mmap, os, shutil, sqlite3, stat, subprocess, sys, tempfile, time

base = tempfile.mkdtemp(prefix="probe-", dir=sys.argv[1])
os.chdir(base)
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
results = {}


def probe(fn):
    name = fn.__name__
    d = os.path.join(base, name)
    os.mkdir(d)
    cwd = os.getcwd()
    os.chdir(d)
    try:
        r = fn()
        results[name] = "ok" if r is None else "bad: " + str(r)
    except OSError as e:
        if e.errno is None:  # shutil.Error and the like carry no errno
            results[name] = "bad: %s: %s" % (type(e).__name__, e)
        else:
            results[name] = errno.errorcode.get(e.errno, str(e.errno))
        print("%s: %s" % (name, e), file=sys.stderr)
    except Exception as e:  # sqlite3 and the like
        results[name] = "bad: %s: %s %s" % (type(e).__name__, e, getattr(e, "sqlite_errorname", ""))
    finally:
        os.chdir(cwd)
    return fn


def touch(p, data=b""):
    with open(p, "wb") as f:
        f.write(data)


def renameat2(old, new, flags):
    # renameat2(2): 316 on x86-64.
    if libc.syscall(316, AT_FDCWD, old.encode(), AT_FDCWD, new.encode(), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@probe
def rename_file_across_dirs():
    os.mkdir("a"); os.mkdir("b"); touch("a/f", b"x")
    os.rename("a/f", "b/f")
    if open("b/f", "rb").read() != b"x" or os.path.exists("a/f"):
        return "content or old name wrong"


@probe
def rename_dir_across_dirs():
    os.makedirs("a/d/e"); os.mkdir("b"); touch("a/d/e/f", b"y")
    os.rename("a/d", "b/d")
    if open("b/d/e/f", "rb").read() != b"y":
        return "tree not moved"


@probe
def rename_replaces_file():
    os.mkdir("a"); os.mkdir("b"); touch("a/x", b"new"); touch("b/y", b"old")
    os.rename("a/x", "b/y")
    if open("b/y", "rb").read() != b"new":
        return "not replaced"


@probe
def rename_dir_over_empty_dir():
    os.makedirs("a/d"); os.makedirs("b/d"); touch("a/d/f")
    os.rename("a/d", "b/d")
    if not os.path.exists("b/d/f"):
        return "not replaced"


@probe
def rename_dir_over_nonempty_dir():
    os.makedirs("a/d"); os.makedirs("b/d"); touch("b/d/f")
    os.rename("a/d", "b/d")


@probe
def rename_noreplace_existing():
    touch("x"); touch("y")
    renameat2("x", "y", 1)  # RENAME_NOREPLACE: EEXIST


@probe
def rename_noreplace_new():
    touch("x")
    renameat2("x", "y", 1)
    if not os.path.exists("y"):
        return "not renamed"


@probe
def rename_exchange():
    touch("x", b"1"); touch("y", b"2")
    renameat2("x", "y", 2)  # RENAME_EXCHANGE
    if open("x", "rb").read() != b"2":
        return "not exchanged"


@probe
def truncate_by_path():
    touch("f", b"0123456789")
    os.truncate("f", 5)
    if os.stat("f").st_size != 5 or open("f", "rb").read() != b"01234":
        return "size %d" % os.stat("f").st_size


@probe
def truncate_extends():
    touch("f", b"ab")
    os.truncate("f", 4096)
    if open("f", "rb").read() != b"ab" + b"\0" * 4094:
        return "not zero-filled"


@probe
def ftruncate_open_file():
    with open("f", "w+b") as f:
        f.write(b"0123456789"); f.flush()
        os.ftruncate(f.fileno(), 3)
        if os.fstat(f.fileno()).st_size != 3:
            return "size"


@probe
def ftruncate_unlinked_file():
    with open("f", "w+b") as f:
        f.write(b"0123456789"); f.flush()
        os.unlink("f")
        os.ftruncate(f.fileno(), 3)
        f.seek(0)
        if f.read() != b"012":
            return "content"


@probe
def fchmod_unlinked_file():
    with open("f", "w+b") as f:
        os.unlink("f")
        os.fchmod(f.fileno(), 0o600)


@probe
def setgid_dir():
    # A project directory whose new entries take its group (cp -a and
    # tar -p keep the bit; mkdir gives it to subdirectories).
    os.mkdir("d"); os.chmod("d", 0o2775)
    if not os.stat("d").st_mode & stat.S_ISGID:
        return "setgid dropped"
    os.mkdir("d/sub")
    if not os.stat("d/sub").st_mode & stat.S_ISGID:
        return "setgid not inherited"


@probe
def listxattr_none():
    touch("f")
    names = os.listxattr("f")
    if names:
        return "listed %r" % names


@probe
def xattr_user_round_trip():
    touch("f")
    os.setxattr("f", "user.capsa", b"value")
    if os.getxattr("f", "user.capsa") != b"value":
        return "value"
    if os.listxattr("f") != ["user.capsa"]:
        return "list %r" % os.listxattr("f")
    os.removexattr("f", "user.capsa")
    if os.listxattr("f"):
        return "still listed"


def as_user(fn, uid=1000):
    # fn run by uid (and gid) in a child: its errno, or "bad" when it
    # returns something.
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups([]); os.setgid(uid); os.setuid(uid)
            if fn() is not None:
                code = 255
        except OSError as e:
            code = e.errno or 254
        os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code == 255:
        return "wrong owner seen by uid %d" % uid
    if code:
        raise OSError(code, os.strerror(code))


@probe
def user_owns_what_it_makes():
    # A user other than root makes a directory and works in it, as a
    # build run as an image's USER does.
    for p in (sys.argv[1], base, "."):
        os.chmod(p, 0o777 if p == "." else os.stat(p).st_mode | 0o711)

    def work():
        os.mkdir("u"); touch("u/f", b"x"); os.mkdir("u/d"); touch("u/d/g", b"y")
        os.rename("u/f", "u/d/f")
        for p in ("u", "u/d", "u/d/f", "u/d/g"):
            st = os.stat(p)
            if (st.st_uid, st.st_gid) != (1000, 1000):
                return p
    return as_user(work)


@probe
def chown_round_trip():
    touch("f", b"x"); os.mkdir("d")
    os.chown("f", 1234, 5678); os.chown("d", 4321, 8765)
    if (os.stat("f").st_uid, os.stat("f").st_gid, os.stat("d").st_uid, os.stat("d").st_gid) != (1234, 5678, 4321, 8765):
        return "owners not kept"
    subprocess.run(["cp", "-a", "f", "g"], check=True)
    if (os.stat("g").st_uid, os.stat("g").st_gid) != (1234, 5678):
        return "cp -a did not keep the owner"
    os.chown("f", 0, 0)
    if (os.stat("f").st_uid, os.stat("f").st_gid) != (0, 0):
        return "chown back to root not kept"


@probe
def getxattr_missing():
    touch("f")
    os.getxattr("f", "user.missing")  # ENODATA


@probe
def setxattr_trusted():
    touch("f")
    os.setxattr("f", "trusted.capsa", b"v")


@probe
def copy2_keeps_metadata():
    touch("f", b"data"); os.chmod("f", 0o640); os.utime("f", ns=(1_000_000_000, 1_500_000_000))
    shutil.copy2("f", "g")
    st = os.stat("g")
    if (stat.S_IMODE(st.st_mode), st.st_mtime_ns) != (0o640, 1_500_000_000):
        return "mode %o mtime %d" % (stat.S_IMODE(st.st_mode), st.st_mtime_ns)


@probe
def copytree():
    os.makedirs("src/a/b"); touch("src/a/b/f", b"1"); os.symlink("a/b/f", "src/l")
    shutil.copytree("src", "dst", symlinks=True)
    if os.readlink("dst/l") != "a/b/f" or open("dst/a/b/f", "rb").read() != b"1":
        return "tree differs"


@probe
def fallocate():
    fd = os.open("f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        if os.fstat(fd).st_size != 1 << 20:
            return "size"
    finally:
        os.close(fd)


@probe
def o_tmpfile():
    fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"tmp")
        # linkat(fd, "", AT_FDCWD, "named", AT_EMPTY_PATH): 265 on x86-64.
        if libc.syscall(265, fd, b"", AT_FDCWD, b"named", 0x1000) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        if open("named", "rb").read() != b"tmp":
            return "content"
    finally:
        os.close(fd)


@probe
def copy_file_range():
    touch("f", b"x" * 100000)
    src = os.open("f", os.O_RDONLY)
    dst = os.open("g", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        n = 0
        while n < 100000:
            c = os.copy_file_range(src, dst, 100000 - n)
            if c == 0:
                break
            n += c
    finally:
        os.close(src); os.close(dst)
    if open("g", "rb").read() != b"x" * 100000:
        return "content"


@probe
def stat_fields():
    touch("f", b"12345")
    os.utime("f", ns=(2_000_000_123, 3_000_000_456))
    st = os.stat("f")
    if (st.st_size, st.st_nlink, st.st_atime_ns, st.st_mtime_ns) != (5, 1, 2_000_000_123, 3_000_000_456):
        return "size %d nlink %d atime %d mtime %d" % (st.st_size, st.st_nlink, st.st_atime_ns, st.st_mtime_ns)
    if st.st_blocks == 0 or st.st_blksize == 0:
        return "blocks %d blksize %d" % (st.st_blocks, st.st_blksize)


def locked_by_child(lock, trylock):
    # A child takes the lock and holds it; the parent's try must fail.
    touch("f")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        fd = os.open("f", os.O_RDWR)
        lock(fd)
        os.write(w, b"1")
        time.sleep(30)
        os._exit(0)
    os.read(r, 1)
    fd = os.open("f", os.O_RDWR)
    try:
        trylock(fd)
        return "the lock was granted twice"
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
    finally:
        os.kill(pid, 9); os.waitpid(pid, 0); os.close(fd)


@probe
def flock_between_processes():
    return locked_by_child(lambda fd: fcntl.flock(fd, fcntl.LOCK_EX),
                           lambda fd: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))


@probe
def fcntl_lock_between_processes():
    return locked_by_child(lambda fd: fcntl.lockf(fd, fcntl.LOCK_EX),
                           lambda fd: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))


@probe
def mmap_shared_write():
    touch("f", b"\0" * 4096)
    with open("f", "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[0:5] = b"hello"
        m.flush(); m.close()
    if open("f", "rb").read(5) != b"hello":
        return "write not seen"


@probe
def readdir_ino_matches_stat():
    os.makedirs("p/moved"); os.mkdir("q"); touch("p/f")
    os.rename("p/moved", "q/moved")
    os.rename("q", "p/q")
    for root in ("p", "p/q"):
        for e in os.scandir(root):
            st = os.stat(e.path, follow_symlinks=False)
            if e.inode() != st.st_ino:
                return "%s: readdir %d, stat %d" % (e.path, e.inode(), st.st_ino)


@probe
def dnotify():
    fd = os.open(".", os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_NOTIFY, fcntl.DN_CREATE)
    finally:
        os.close(fd)


@probe
def links_and_special_files():
    touch("f", b"data")
    os.link("f", "h"); os.symlink("f", "s"); os.mkfifo("p")
    os.chmod("f", 0o600); os.utime("f", (1, 2))
    if os.stat("h").st_nlink != 2 or os.readlink("s") != "f" or not stat.S_ISFIFO(os.lstat("p").st_mode):
        return "links"
    fd = os.open("f", os.O_RDONLY); os.unlink("f"); os.unlink("h")
    try:
        if os.read(fd, 4) != b"data":
            return "read after unlink"
    finally:
        os.close(fd)


@probe
def sqlite_wal():
    db = sqlite3.connect("t.db")
    if db.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
        return "journal mode not wal"
    db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
    with db:
        db.executemany("INSERT INTO t (v) VALUES (?)", [("row %d" % i,) for i in range(500)])
    other = sqlite3.connect("t.db")
    n = other.execute("SELECT count(*) FROM t").fetchone()[0]
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    other.close(); db.close()
    if n != 500:
        return "the second connection saw %d rows" % n


@probe
def many_small_files():
    for i in range(200):
        touch("f%03d" % i, b"%d" % i)
    for i in range(200):
        os.rename("f%03d" % i, "g%03d" % i)
    if sorted(os.listdir(".")) != ["g%03d" % i for i in range(200)]:
        return "listing"
    for i in range(200):
        if os.stat("g%03d" % i).st_size != len(b"%d" % i):
            return "size"
        os.unlink("g%03d" % i)


@probe
def deep_tree_walk():
    p = "."
    for i in range(40):
        p = os.path.join(p, "d")
        os.mkdir(p)
        touch(os.path.join(p, "f"))
    dirs = files = 0
    for root, ds, fs in os.walk("."):
        dirs += len(ds); files += len(fs)
    if (dirs, files) != (40, 40):
        return "walked %d dirs, %d files" % (dirs, files)
    shutil.rmtree("d")


print(json.dumps(results, sort_keys=True))
shutil.rmtree(base)
