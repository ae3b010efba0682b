#!/bin/bash
# run-e2e.sh NESTED DIR FILES...: runs each end-to-end test of DIR/e2e.test
# in its own nested host session (one L1 boot, about 5 s), and exits
# non-zero if any test failed or none ran, naming the failures.
#
# A test runs once. A failure of a capsa guest fails the tier, with the
# diagnostics the test prints. The only re-run is for the layer below
# capsa, and says so: L1's kernel oopses, panics or stalls, which
# capsa-nested sees on L1's console and answers by running the job again
# in a fresh L1 (--l1-retries). A guest state that L1 replaced with its own
# ("impossible state:", README "Guest stalls") is no longer re-run: its
# cause, a race in QEMU's TCG (tests/nested/qemu/fpu-clear-ignne-race.patch),
# is fixed, so seeing it again is a finding to chase, not noise.
set -u
nested=$1 dir=$2
shift 2
tests=$("$dir/e2e.test" -test.list '^Test' | grep '^Test') || { echo "run-e2e: cannot list the tests"; exit 1; }
[ -n "$tests" ] || { echo "run-e2e: FAILED: no tests listed"; exit 1; }
files=(-f "$dir/e2e.test")
for f in "$@"; do files+=(-f "$f"); done
failed="" rerun="" n=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for t in $tests; do
	n=$((n + 1))
	echo "=== run-e2e: $t"
	"$nested" --timeout 10m "${files[@]}" -- ./e2e.test -test.v -test.run "^$t\$" -test.timeout 8m 2>&1 | tee "$log"
	st=${PIPESTATUS[0]}
	grep -q '^capsa-nested: running the job again' "$log" && rerun="$rerun $t(L1-crash)"
	[ "$st" = 0 ] && continue
	failed="$failed $t"
done
[ -n "$rerun" ] && echo "run-e2e: re-run for the layer below capsa (see the logs above):$rerun"
if [ -n "$failed" ]; then
	echo "run-e2e: FAILED:$failed"
	exit 1
fi
echo "run-e2e: all $n end-to-end tests passed"
