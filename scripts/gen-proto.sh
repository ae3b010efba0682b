#!/usr/bin/env bash
# gen-proto.sh: regenerates the Go code of the protobuf definitions written
# in this repository (e2b/envd/*/*.proto, the E2B SDKs' envd services) with
# protoc (Debian's protobuf-compiler), protoc-gen-go and
# protoc-gen-connect-go at the versions go.mod names. The generated code is
# committed, so a build never needs this; run it (make proto) after
# changing a .proto file, and commit what it writes.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
# libprotobuf-dev: the well-known types (timestamp.proto) under /usr/include.
scripts/apt-install.sh protobuf-compiler libprotobuf-dev
bin=${CAPSA_CACHE:-$HOME/.cache/capsa}/protoc-plugins
mkdir -p "$bin"
pbver=$(go list -m -f '{{.Version}}' google.golang.org/protobuf)
cver=$(go list -m -f '{{.Version}}' connectrpc.com/connect)
GOBIN=$bin go install "google.golang.org/protobuf/cmd/protoc-gen-go@$pbver"
GOBIN=$bin go install "connectrpc.com/connect/cmd/protoc-gen-connect-go@$cver"
module=$(go list -m)
for p in e2b/envd/process/process.proto e2b/envd/filesystem/filesystem.proto; do
	PATH=$bin:$PATH protoc -I . -I /usr/include \
		--go_out=. --go_opt=module="$module" \
		--connect-go_out=. --connect-go_opt=module="$module" \
		"$p"
done
