#!/bin/sh
# Runs each Go test binary given, verbosely, and exits non-zero if any failed,
# naming them. Used inside the nested KVM host.
failed=""
for t in "$@"; do
	echo "=== test binary $t"
	"./$t" -test.v -test.timeout 15m || failed="$failed $t"
done
if [ -n "$failed" ]; then
	echo "FAILED test binaries:$failed"
	exit 1
fi
echo "all test binaries passed: $*"
