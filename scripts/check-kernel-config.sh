#!/usr/bin/env bash
# check-kernel-config.sh FRAGMENT DOTCONFIG
# Fails if any option the fragment sets (or unsets) did not end up that way in
# the resolved .config, naming each one.
set -euo pipefail
frag=$1 dot=$2
bad=0
while IFS= read -r line; do
	if [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.*)$ ]]; then
		opt=${BASH_REMATCH[1]} want=${BASH_REMATCH[2]}
		got=$(grep -E "^$opt=" "$dot" | head -1 | cut -d= -f2- || true)
		if [ "$got" != "$want" ]; then
			echo "kernel config: $opt wanted $want, got ${got:-not set}" >&2
			bad=1
		fi
	elif [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
		opt=${BASH_REMATCH[1]}
		if grep -qE "^$opt=" "$dot"; then
			echo "kernel config: $opt wanted unset, got $(grep -E "^$opt=" "$dot")" >&2
			bad=1
		fi
	fi
done <"$frag"
exit $bad
