#!/bin/bash
# run-e2e.sh NESTED DIR FILES...: runs the end-to-end tests of DIR/e2e.test
# in nested host sessions (one L1 boot each, about 5 s), and exits non-zero
# if any test failed or none ran, naming the failures.
#
# Tests run E2E_BATCH at a time (default 4) in one session, which spares
# most of the L1 boots; the ones that measure the host process (its
# descriptors, goroutines, memory) run alone, so no other test's leftovers
# count against them.
#
# A test runs once. A failure of a capsa guest fails the tier, with the
# diagnostics the test prints. The only re-run is for the layer below
# capsa, and says so: L1's kernel oopses, panics or stalls, which
# capsa-nested sees on L1's console and answers by running the job again
# in a fresh L1 (--l1-retries). A guest state that L1 replaced with its own
# ("impossible state:", docs/testing.md, "Guest stalls") is no longer re-run: its
# cause, a race in QEMU's TCG (tests/nested/qemu/fpu-clear-ignne-race.patch),
# is fixed, so seeing it again is a finding to chase, not noise.
set -u
nested=$1 dir=$2
shift 2
batch=${E2E_BATCH:-4}
solo='^(TestSoak|TestHostileWorkloads|TestRestoresShareMemory|TestStress)$'
tests=$("$dir/e2e.test" -test.list '^Test' | grep '^Test') || { echo "run-e2e: cannot list the tests"; exit 1; }
[ -n "$tests" ] || { echo "run-e2e: FAILED: no tests listed"; exit 1; }
# A file given as SRC[:NAME]@REGEX goes only to the sessions running a
# test that REGEX matches (the MCP client's Node bundle, 135 MB, is for
# TestMCP alone and would slow every other session's L1 boot).
files=(-f "$dir/e2e.test")
only_files=() only_res=()
for f in "$@"; do
	if [[ $f == *@* ]]; then
		only_files+=("${f%@*}")
		only_res+=("${f##*@}")
	else
		files+=(-f "$f")
	fi
done
failed="" rerun="" n=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# run NAMES...: one session running the named tests.
run() {
	local re
	re=$(IFS='|'; echo "$*")
	local session=("${files[@]}") i t
	for i in "${!only_files[@]}"; do
		for t in "$@"; do
			if [[ $t =~ ${only_res[$i]} ]]; then
				session+=(-f "${only_files[$i]}")
				break
			fi
		done
	done
	echo "=== run-e2e: $*"
	"$nested" --timeout 30m "${session[@]}" -- ./e2e.test -test.v -test.run "^($re)\$" -test.timeout 25m 2>&1 | tee "$log"
	local st=${PIPESTATUS[0]}
	grep -q '^capsa-nested: running the job again' "$log" && rerun="$rerun $*(L1-crash)"
	[ "$st" = 0 ] && return
	# The tests that said they failed; if none did (a panic, a timeout),
	# every test of the session is named.
	local named
	named=$(sed -n 's/^--- FAIL: \(Test[A-Za-z0-9_]*\).*/\1/p' "$log" | tr '\n' ' ')
	failed="$failed ${named:-$*}"
}

group=()
for t in $tests; do
	n=$((n + 1))
	if [[ $t =~ $solo ]]; then
		run "$t"
		continue
	fi
	group+=("$t")
	if [ ${#group[@]} -ge "$batch" ]; then
		run "${group[@]}"
		group=()
	fi
done
[ ${#group[@]} -gt 0 ] && run "${group[@]}"
[ -n "$rerun" ] && echo "run-e2e: re-run for the layer below capsa (see the logs above):$rerun"
if [ -n "$failed" ]; then
	echo "run-e2e: FAILED:$failed"
	exit 1
fi
echo "run-e2e: all $n end-to-end tests passed"
