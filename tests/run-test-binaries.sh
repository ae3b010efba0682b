#!/bin/sh
# run-test-binaries.sh DIR: runs each Go test binary in DIR (*.test),
# verbosely, and exits non-zero if any failed, naming them, or if DIR holds
# none (a tier that runs nothing must not pass). Used in the nested KVM host.
dir=$1
failed="" ran=""
for t in "$dir"/*.test; do
	[ -x "$t" ] || continue
	echo "=== test binary $t"
	ran="$ran $(basename "$t")"
	"./$t" -test.v -test.timeout 15m || failed="$failed $(basename "$t")"
done
if [ -z "$ran" ]; then
	echo "FAILED: no test binaries in $dir"
	exit 1
fi
if [ -n "$failed" ]; then
	echo "FAILED test binaries:$failed"
	exit 1
fi
echo "all test binaries passed:$ran"
