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
# diagnostics the test prints. The tier ends with how many tests passed,
# failed and skipped; a skip not in tests/e2e/expected-skips.txt fails it,
# as does a test with no result. The only re-run is for the layer below
# capsa, is counted, and hides nothing: L1's kernel oopses, panics or
# stalls, which capsa-nested sees on L1's console and stops the session
# (--l1-retries 0); then only the tests that had not finished run again,
# in a fresh L1, while a test that finished keeps its result (a failure
# stays one), and more than one L1 crash in a run fails it. A guest state that L1 replaced with its own
# ("impossible state:", docs/testing.md, "Guest stalls") is no longer re-run: its
# cause, a race in QEMU's TCG (tests/nested/qemu/fpu-clear-ignne-race.patch),
# is fixed, so seeing it again is a finding to chase, not noise.
set -u
nested=$1 dir=$2
shift 2
batch=${E2E_BATCH:-4}
# The containerd tests run alone too: each takes 3 to 7 minutes on a slow
# host, and two in one session came near its bound.
solo='^(TestSoak|TestHostileWorkloads|TestRestoresShareMemory|TestStress|TestContainerdShim|TestContainerdCRI)$'
if [ -n "${E2E_TESTS:-}" ]; then
	tests=$E2E_TESTS # a lane's share (below)
else
	tests=$("$dir/e2e.test" -test.list '^Test' | grep '^Test') || { echo "run-e2e: cannot list the tests"; exit 1; }
fi
[ -n "$tests" ] || { echo "run-e2e: FAILED: no tests listed"; exit 1; }
me=run-e2e${E2E_LANE:+[lane $E2E_LANE]}

# Lanes: E2E_LANES L1 hosts (default 1, at most the machine's cores) run
# at once, each its share of the tests, for a machine with cores to
# spare. On the 2-core machine two lanes gained nothing (make test 27m15s
# against 26m52s in one lane, with 44 minutes of CPU against 29: two TCG
# hosts side by side each ran at about half speed). The tests go to lanes
# longest first (the durations of tests/e2e/durations.txt, 20 s for a
# test it lacks), each to the lane with the least work so far. Each lane
# is this script on its share, with its own rules; the tier adds their
# counts up, fails if any lane did, and allows one L1 crash in all, as
# one lane does. Lane 0's output streams; the others' follow it.
lanes=${E2E_LANES:-1}
[ "$lanes" -gt "$(nproc)" ] && lanes=$(nproc)
if [ -z "${E2E_LANE:-}" ] && [ "$lanes" -gt 1 ]; then
	durations=$(dirname "$0")/e2e/durations.txt
	assignment=$(for t in $tests; do
		echo "$(awk -v t="$t" '$1 == t { print $2 }' "$durations" 2>/dev/null | head -1 | grep . || echo 20) $t"
	done | sort -k1,1nr -k2 | awk -v n="$lanes" '{
		best = 0; for (i = 1; i < n; i++) if (load[i] < load[best]) best = i
		load[best] += $1; print best, $2 }')
	lanedir=$(mktemp -d)
	trap 'rm -rf "$lanedir"' EXIT
	pids=()
	for ((i = 0; i < lanes; i++)); do
		share=$(echo "$assignment" | awk -v i="$i" '$1 == i { print $2 }' | tr '\n' ' ')
		if [ "$i" = 0 ]; then
			(E2E_LANE=$i E2E_TESTS=$share bash "$0" "$nested" "$dir" "$@" 2>&1 | tee "$lanedir/$i") &
		else
			(E2E_LANE=$i E2E_TESTS=$share bash "$0" "$nested" "$dir" "$@" >"$lanedir/$i" 2>&1; true) &
		fi
		pids+=($!)
	done
	wait "${pids[@]}"
	n=0 passed=0 nfailed=0 skipped=0 crashes=0 failed=""
	sumre='([0-9]+) listed: ([0-9]+) passed, ([0-9]+) failed, ([0-9]+) skipped; L1 crashed ([0-9]+)'
	for ((i = 0; i < lanes; i++)); do
		if [ "$i" != 0 ]; then
			echo "=== run-e2e: the output of lane $i"
			cat "$lanedir/$i"
		fi
		sum=$(grep -E "^run-e2e\\[lane $i\\]: [0-9]+ listed: " "$lanedir/$i" || true)
		if [[ $sum =~ $sumre ]]; then
			n=$((n + BASH_REMATCH[1])) passed=$((passed + BASH_REMATCH[2])) nfailed=$((nfailed + BASH_REMATCH[3]))
			skipped=$((skipped + BASH_REMATCH[4])) crashes=$((crashes + BASH_REMATCH[5]))
		else
			failed="$failed lane-$i(no-summary)"
		fi
		f=$(grep -E "^run-e2e\\[lane $i\\]: FAILED:" "$lanedir/$i" | sed 's/^[^:]*: FAILED://' || true)
		[ -n "$f" ] && failed="$failed$f"
	done
	echo "run-e2e: $n listed in $lanes lanes: $passed passed, $nfailed failed, $skipped skipped; L1 crashed $crashes time(s)"
	[ "$crashes" -gt 1 ] && failed="$failed (L1 crashed $crashes times in all lanes: more than once in one run)"
	if [ -n "$failed" ] || [ "$n" -ne "$(echo $tests | wc -w)" ]; then
		echo "run-e2e: FAILED:${failed:- (tests of a lane went uncounted)}"
		exit 1
	fi
	echo "run-e2e: all $n end-to-end tests passed"
	exit 0
fi
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
failed="" rerun="" n=0 passed=0 skipped=0 nfailed=0 crashes=0
log=$(mktemp) digest=$(mktemp)
trap 'rm -f "$log" "$digest"' EXIT
# The skips expected on this machine: "TestName: why" lines (# comments),
# none on the nested host. A skip not listed fails the tier.
expected_skips=$(dirname "$0")/e2e/expected-skips.txt

# failure_digest TEST: TEST's own lines in this session's log (its t.Log
# and t.Error lines, the first line of each, cut at 400 characters; not the
# files a failed test dumps), so that the end of the tier's output says why
# each test failed, however long the dumps above it are.
failure_digest() {
	echo "--- $1:"
	awk -v t="$1" '
		/^=== (RUN|CONT|NAME) / { cur = $3; next }
		/^(---|===) / { next }
		(cur == t || index(cur, t "/") == 1) && /^ +[A-Za-z0-9_]+_test\.go:[0-9]+: / && !/(console|supervisor)\.log:$/ {
			print substr($0, 1, 400); if (++n >= 40) { print "    (more in the log above)"; exit }
		}' "$log"
}

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
	echo "=== $me: $*"
	# --l1-retries 0: an L1 crash is handled here, so that only the tests
	# it cut short run again.
	# The bounds catch a hang, not a slow host: a session of four tests
	# took up to 13 minutes on the slowest machine seen (2026-12-05).
	"$nested" --timeout 45m --l1-retries 0 "${session[@]}" -- ./e2e.test -test.v -test.run "^($re)\$" -test.timeout 40m 2>&1 | tee "$log"
	local st=${PIPESTATUS[0]}
	local crashed=0 left=() result
	if grep -q 'the nested L1 host kernel crashed' "$log"; then
		crashed=1 crashes=$((crashes + 1))
	fi
	for t in "$@"; do
		if grep -q "^--- FAIL: $t " "$log"; then
			result=failed
		elif grep -q "^--- SKIP: $t " "$log"; then
			result=skipped
		elif grep -q "^--- PASS: $t " "$log"; then
			result=passed
		else
			result=none # a panic, a timeout, a session that never ran it
		fi
		case $result in
		passed) passed=$((passed + 1)) ;;
		skipped)
			skipped=$((skipped + 1))
			if ! grep -q "^$t:" "$expected_skips" 2>/dev/null; then
				nfailed=$((nfailed + 1))
				failed="$failed $t(skipped,not-expected)"
			fi ;;
		failed)
			nfailed=$((nfailed + 1)) failed="$failed $t"
			failure_digest "$t" >>"$digest" ;;
		none)
			if [ "$crashed" = 1 ]; then
				left+=("$t") # cut short by L1's crash, not by capsa
			else
				nfailed=$((nfailed + 1)) failed="$failed $t(no-result)"
			fi ;;
		esac
	done
	if [ "$crashed" = 1 ]; then
		# A test that finished keeps its result (a failure stays one);
		# those L1's crash cut short run again, once more at most in
		# the whole run.
		rerun="$rerun ${left[*]:-(none)}(L1 crashed during: $*; its console tail is above)"
		if [ ${#left[@]} -gt 0 ] && [ "$crashes" -le 1 ]; then
			run "${left[@]}"
		else
			for t in "${left[@]}"; do
				nfailed=$((nfailed + 1)) failed="$failed $t(no-result,L1-crashed)"
			done
		fi
		return
	fi
	if [ "$st" != 0 ] && ! grep -q '^--- FAIL: ' "$log"; then
		# The session failed with no test saying so: name them all.
		case "$failed" in *"(no-result)"*) ;; *) nfailed=$((nfailed + 1)) failed="$failed $*(session-exit-$st)" ;; esac
	fi
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
echo "$me: $n listed: $passed passed, $nfailed failed, $skipped skipped; L1 crashed $crashes time(s)"
[ -n "$rerun" ] && echo "$me: re-run for the layer below capsa:$rerun"
if [ "$crashes" -gt 1 ]; then
	failed="$failed (L1 crashed $crashes times: more than once in one run)"
fi
if [ -n "$failed" ]; then
	if [ -s "$digest" ]; then
		echo "$me: what each failed test logged (its own lines; the full output is above):"
		cat "$digest"
	fi
	echo "$me: FAILED:$failed"
	exit 1
fi
echo "$me: all $n end-to-end tests passed"
