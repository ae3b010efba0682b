#!/bin/sh
# run-test-binaries.sh DIR: runs each Go test binary in DIR (*.test),
# verbosely, and exits non-zero if any failed, naming them, or if DIR holds
# none (a tier that runs nothing must not pass). It ends with how many
# tests (subtests too) passed, failed and skipped; a skip not listed in
# DIR/expected-skips.txt ("Name: why" lines) fails it. Used in the nested
# KVM host.
dir=$1
failed="" ran="" passed=0 skipped=0 nfailed=0
log=/tmp/run-test-binaries.$$
for t in "$dir"/*.test; do
	[ -x "$t" ] || continue
	echo "=== test binary $t"
	ran="$ran $(basename "$t")"
	{ "./$t" -test.v -test.timeout 15m; echo $? >"$log.status"; } 2>&1 | tee "$log"
	[ "$(cat "$log.status")" = 0 ] || failed="$failed $(basename "$t")"
	passed=$((passed + $(grep -c '^ *--- PASS: ' "$log")))
	nfailed=$((nfailed + $(grep -c '^ *--- FAIL: ' "$log")))
	for s in $(sed -n 's/^ *--- SKIP: \([^ ]*\) .*/\1/p' "$log"); do
		skipped=$((skipped + 1))
		grep -q "^$s:" "$dir/expected-skips.txt" 2>/dev/null || failed="$failed $s(skipped,not-expected)"
	done
done
rm -f "$log" "$log.status"
echo "tests: $passed passed, $nfailed failed, $skipped skipped"
if [ -z "$ran" ]; then
	echo "FAILED: no test binaries in $dir"
	exit 1
fi
if [ -n "$failed" ]; then
	echo "FAILED:$failed"
	exit 1
fi
echo "all test binaries passed:$ran"
