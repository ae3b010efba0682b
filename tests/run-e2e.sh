#!/bin/bash
# run-e2e.sh NESTED DIR FILES...: runs each end-to-end test of DIR/e2e.test
# in its own nested host session (one L1 boot, about 5 s), and exits
# non-zero if any test failed or none ran, naming the failures.
#
# A test runs once. A failure of a capsa guest fails the tier, with the
# diagnostics the test prints. The only re-runs are for the layer below
# capsa, and each says so:
#   - L1's kernel oopses, panics or stalls: capsa-nested sees it on L1's
#     console and runs the job again in a fresh L1 (--l1-retries);
#   - L1 replaced the guest vCPU's state with its own (the VM's state shows
#     "impossible state:", a CR3 outside the guest's memory that no guest
#     can load: QEMU TCG's emulated SVM, README "Guest stalls"): run again,
#     at most L1_STATE_RERUNS times (default 2).
set -u
nested=$1 dir=$2
shift 2
reruns=${L1_STATE_RERUNS:-2}
tests=$("$dir/e2e.test" -test.list '^Test' | grep '^Test') || { echo "run-e2e: cannot list the tests"; exit 1; }
[ -n "$tests" ] || { echo "run-e2e: FAILED: no tests listed"; exit 1; }
files=(-f "$dir/e2e.test")
for f in "$@"; do files+=(-f "$f"); done
failed="" rerun="" n=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for t in $tests; do
	n=$((n + 1))
	for a in $(seq 0 "$reruns"); do
		echo "=== run-e2e: $t"
		"$nested" --timeout 10m "${files[@]}" -- ./e2e.test -test.v -test.run "^$t\$" -test.timeout 8m 2>&1 | tee "$log"
		st=${PIPESTATUS[0]}
		grep -q '^capsa-nested: running the job again' "$log" && rerun="$rerun $t(L1-crash)"
		[ "$st" = 0 ] && continue 2
		if grep -q 'impossible state:' "$log" && [ "$a" -lt "$reruns" ]; then
			echo "run-e2e: RE-RUN $t: L1 replaced the guest's vCPU state (impossible state above), not capsa's doing"
			rerun="$rerun $t(L1-state)"
			continue
		fi
		break
	done
	failed="$failed $t"
done
[ -n "$rerun" ] && echo "run-e2e: re-run for the layer below capsa (see the logs above):$rerun"
if [ -n "$failed" ]; then
	echo "run-e2e: FAILED:$failed"
	exit 1
fi
echo "run-e2e: all $n end-to-end tests passed"
