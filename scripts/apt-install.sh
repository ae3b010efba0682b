#!/usr/bin/env bash
# apt-install.sh PKG...: installs Debian packages that are missing, running
# `apt-get update` once per machine first (apt knows no packages before it).
set -euo pipefail
missing=()
for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
((${#missing[@]})) || exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
stamp=/var/lib/apt/periodic/capsa-update-stamp
if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +720)" ]; then
	$sudo apt-get update -qq
	$sudo mkdir -p "$(dirname "$stamp")" && $sudo touch "$stamp"
fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
