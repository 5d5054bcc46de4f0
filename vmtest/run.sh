#!/bin/sh
# go test -exec wrapper that runs the test binary in a VM on another kernel:
#   go test -exec "$PWD/vmtest/run.sh -kernel 6.1" ./maps
# The logic is in vmtest/main.go.
set -e
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/vmtest/cache"
(cd "$root" && go build -o vmtest/cache/vmtest ./vmtest)
exec "$root/vmtest/cache/vmtest" "$@"
