#!/bin/sh
# programs.sh DIR: real programs at work in DIR (a share, or the image's
# own disk), the way a developer's tools use a workspace: git, pip into a
# venv, npm with a dependency tree, tar and cp -a, and SQLite in WAL mode.
# Each step prints one line, "STEP: ok DIGEST" or "STEP: FAILED ...";
# with STEPS (names, space-separated) only those steps run.
# A digest depends only on what the programs produced (fixed dates and
# names), so the same step on another file system must print the same line.
# npm runs on the Node.js in $NODE_DIR (a read-only share), when given.
set -u
dir=$1
mkdir -p "$dir" && cd "$dir" || exit 1
export HOME="$dir/home" TZ=UTC LC_ALL=C.UTF-8
mkdir -p "$HOME"

# step NAME FUNCTION: runs FUNCTION in a subshell in a fresh directory,
# printing its last line as the result or its output's tail on failure,
# and how long it took on standard error.
step() {
	case " ${STEPS:-$1} " in *" $1 "*) ;; *) return ;; esac
	rm -rf "$dir/$1" && mkdir -p "$dir/$1"
	t0=$(date +%s%N)
	out=$( (cd "$dir/$1" && set -e && "$2") 2>&1)
	st=$?
	echo "$1 in $dir: $(( ($(date +%s%N) - t0) / 1000000 )) ms" >&2
	if [ $st -eq 0 ]; then
		echo "$1: ok $(printf '%s\n' "$out" | tail -n 1)"
	else
		echo "$1: FAILED (exit $st): $(printf '%s\n' "$out" | tail -n 5 | tr '\n' '|')"
	fi
}

sum() { sha256sum | cut -c1-16; }

git_work() {
	export GIT_AUTHOR_NAME=capsa GIT_AUTHOR_EMAIL=test@capsa.invalid
	export GIT_COMMITTER_NAME=capsa GIT_COMMITTER_EMAIL=test@capsa.invalid
	export GIT_AUTHOR_DATE=2026-01-01T00:00:00Z GIT_COMMITTER_DATE=2026-01-01T00:00:00Z
	git init -q -b main origin
	cd origin
	seq 1 500 >numbers
	mkdir -p src/a/b/c/d/e/f/g/h
	for i in $(seq 1 12); do echo "file $i" >"src/a/b/c/d/e/f/g/h/f$i"; done
	printf '#!/bin/sh\necho hi\n' >run.sh && chmod +x run.sh
	ln -s numbers numbers.link
	git add -A && git commit -q -m one
	git mv src/a/b/c/d src/moved
	sed -i 's/^7$/seven/' numbers
	git commit -q -am two
	cd ..
	git clone -q origin clone
	cd clone
	git checkout -q -b feature
	echo feature >feature.txt
	git add feature.txt
	git mv numbers nums
	git commit -q -m feature
	git checkout -q main
	echo more >>src/moved/e/f/g/h/f1
	GIT_COMMITTER_DATE=2026-01-02T00:00:00Z git commit -q -am main-two
	git checkout -q feature
	GIT_COMMITTER_DATE=2026-01-03T00:00:00Z git rebase -q main
	git push -q origin feature
	git gc -q
	git fsck --strict --no-progress
	[ -z "$(git status --porcelain)" ] || { git status; exit 1; }
	cd ../origin
	git fsck --strict --no-progress
	git -C ../clone stash list >/dev/null
	echo "$(git rev-parse feature) $(git rev-list --count feature) $(git ls-tree -r feature | sum)"
}

pip_work() {
	mkdir -p pkg/src/capsapkg/data
	cat >pkg/pyproject.toml <<'EOF'
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "capsapkg"
version = "1.2.3"

[project.scripts]
capsapkg-hello = "capsapkg:main"

[tool.setuptools.package-data]
capsapkg = ["data/*.txt"]
EOF
	printf 'import importlib.resources\ndef main():\n    print(importlib.resources.files("capsapkg").joinpath("data/greeting.txt").read_text().strip())\n' >pkg/src/capsapkg/__init__.py
	echo "hello from a package" >pkg/src/capsapkg/data/greeting.txt
	python3 -m venv venv
	# Built in an isolated environment from a local wheelhouse (Debian's
	# setuptools and wheel), in a temporary directory in the workspace.
	mkdir tmp
	TMPDIR=$PWD/tmp venv/bin/pip install -q --no-index --find-links /usr/share/python-wheels ./pkg
	got=$(venv/bin/capsapkg-hello)
	[ "$got" = "hello from a package" ] || { echo "capsapkg-hello printed $got"; exit 1; }
	venv/bin/pip check >/dev/null
	ver=$(venv/bin/python -c 'import importlib.metadata as m; print(m.version("capsapkg"))')
	venv/bin/pip uninstall -q -y capsapkg
	! venv/bin/python -c 'import capsapkg' 2>/dev/null
	echo "$got $ver"
}

npm_work() {
	[ -n "${NODE_DIR:-}" ] || { echo "no NODE_DIR"; exit 1; }
	node=$NODE_DIR/node
	npm() { "$node" "$NODE_DIR/node_modules/npm/bin/npm-cli.js" --offline --no-audit --no-fund --no-update-notifier --loglevel=error "$@"; }
	export npm_config_cache="$PWD/cache"
	mkdir -p src/c src/b src/a/node_modules/capsa-c tgz app
	echo '{"name":"capsa-c","version":"1.0.0","main":"index.js"}' >src/c/package.json
	echo 'module.exports = () => "c1";' >src/c/index.js
	echo '{"name":"capsa-b","version":"1.0.0","main":"index.js","dependencies":{"capsa-c":"^1.0.0"}}' >src/b/package.json
	echo 'module.exports = () => "b" + require("capsa-c")();' >src/b/index.js
	# a bundles capsa-c 2, which npm must nest under it.
	echo '{"name":"capsa-a","version":"2.0.0","main":"index.js","dependencies":{"capsa-b":"^1.0.0","capsa-c":"^2.0.0"},"bundleDependencies":["capsa-c"]}' >src/a/package.json
	echo 'module.exports = () => "a" + require("capsa-c")() + require("capsa-b")();' >src/a/index.js
	echo '{"name":"capsa-c","version":"2.0.0","main":"index.js"}' >src/a/node_modules/capsa-c/package.json
	echo 'module.exports = () => "c2";' >src/a/node_modules/capsa-c/index.js
	for p in c b a; do (cd tgz && npm pack ../src/$p >/dev/null); done
	cd app
	echo '{"name":"app","version":"1.0.0","private":true}' >package.json
	npm install ../tgz/capsa-c-1.0.0.tgz ../tgz/capsa-b-1.0.0.tgz ../tgz/capsa-a-2.0.0.tgz >/dev/null
	first=$("$node" -e 'console.log(require("capsa-a")())')
	[ "$first" = "ac2bc1" ] || { echo "require(capsa-a)() = $first"; exit 1; }
	# A clean install from the lock file, as CI does.
	npm ci >/dev/null
	again=$("$node" -e 'console.log(require("capsa-a")())')
	tree=$(npm ls --all --parseable | sed "s|^$PWD||" | sort | sum)
	echo "$again $tree $(find node_modules -type f ! -name '.package-lock.json' | sort | sum)"
}

# manifest DIR: every entry of DIR with its type, mode, size, mtime (to
# the second, or to the nanosecond with "ns"), content and link target,
# and which entries are one inode.
manifest() {
	python3 - "$@" <<'EOF'
import hashlib, os, stat, sys
root, ns = sys.argv[1], len(sys.argv) > 2
inodes, lines = {}, []
for d, dirs, files in os.walk(root):
    dirs.sort()
    for name in sorted(dirs + files):
        p = os.path.join(d, name)
        st = os.lstat(p)
        rel = os.path.relpath(p, root)
        what = ""
        if stat.S_ISREG(st.st_mode):
            what = hashlib.sha256(open(p, "rb").read()).hexdigest()[:16]
            if st.st_nlink > 1:
                what += " link-group " + inodes.setdefault(st.st_ino, rel)
        elif stat.S_ISLNK(st.st_mode):
            what = "-> " + os.readlink(p)
        t = st.st_mtime_ns if ns else st.st_mtime_ns // 10**9
        if stat.S_ISLNK(st.st_mode):
            t = 0
        lines.append(f"{rel} {oct(st.st_mode)} {st.st_size if not stat.S_ISDIR(st.st_mode) else 0} {t} {what}")
print(hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], len(lines))
EOF
}

tree_work() {
	python3 - <<'EOF'
import os
os.makedirs("tree/empty/dir")
for i in range(80):
    d = f"tree/d{i % 7}/s{i % 3}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/f{i}", "wb") as f:
        f.write(bytes((i * j) % 251 for j in range(i * 97 % 70000)))
    os.chmod(f"{d}/f{i}", [0o644, 0o600, 0o755, 0o640][i % 4])
    os.utime(f"{d}/f{i}", ns=(1700000000_123456789 + i, 1700000000_987654321 + i * 1000))
os.symlink("d1/s1/f1", "tree/link")
os.symlink("nowhere", "tree/dangling")
os.link("tree/d0/s0/f0", "tree/hard")
os.mkfifo("tree/fifo")
os.chmod("tree/d2", 0o1777)
with open("tree/sparse", "wb") as f:
    f.seek(1 << 20)
    f.write(b"end")
for p in ["tree/link", "tree/dangling", "tree/fifo", "tree/sparse"]:
    os.utime(p, ns=(1700000000_000000003, 1700000000_000000004), follow_symlinks=False)
for d, _, _ in os.walk("tree", topdown=False):
    os.utime(d, ns=(1700000000_000000001, 1700000000_000000002))
EOF
	want=$(manifest tree ns)
	cp -a tree copy
	[ "$(manifest copy ns)" = "$want" ] || { echo "cp -a changed the tree"; exit 1; }
	tar --sort=name --format=gnu --owner=0 --group=0 --numeric-owner -cf tree.tar tree
	mkdir x
	tar -xpf tree.tar -C x
	[ "$(manifest x/tree)" = "$(manifest tree)" ] || { echo "tar round trip changed the tree"; exit 1; }
	# A tree moved across directories and back, and copied into itself's
	# sibling after a rename.
	mkdir -p moved/into
	mv copy moved/into/copy
	mv moved/into/copy copy2
	[ "$(manifest copy2 ns)" = "$want" ] || { echo "mv changed the tree"; exit 1; }
	echo "$want $(sum <tree.tar)"
}

sqlite_work() {
	# Waiting up to 10 s for a lock, as applications configure it.
	sqlite3() { command sqlite3 -cmd '.timeout 10000' "$@"; }
	[ "$(sqlite3 db 'PRAGMA journal_mode=WAL;')" = wal ]
	sqlite3 db 'CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT NOT NULL);'
	# A reader in another process, reading while the writer commits.
	(for i in $(seq 1 30); do sqlite3 db 'SELECT count(*) FROM t;' >/dev/null || exit 1; done) &
	reader=$!
	for b in $(seq 0 19); do
		sqlite3 db "BEGIN; WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM n WHERE i < 100)
			INSERT INTO t(v) SELECT printf('row %d of batch %d', i, $b) FROM n; COMMIT;"
	done
	wait $reader
	[ "$(sqlite3 db 'PRAGMA integrity_check;')" = ok ]
	sqlite3 db 'PRAGMA wal_checkpoint(TRUNCATE);' >/dev/null
	sqlite3 db "UPDATE t SET v = v || '!' WHERE id % 3 = 0; DELETE FROM t WHERE id % 7 = 0; VACUUM;"
	echo "$(sqlite3 db 'PRAGMA journal_mode;') $(sqlite3 db 'SELECT count(*), sum(length(v)) FROM t;')"
}

step git git_work
step pip pip_work
step npm npm_work
step tar-cp tree_work
step sqlite sqlite_work
