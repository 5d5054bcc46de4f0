#!/bin/sh
# go test -exec wrapper that runs the test binary in a VM on another kernel:
#   go test -exec "$PWD/vmtest/run.sh -kernel 6.1" ./maps
# The logic is in vmtest/main.go.
set -e
root=$(cd "$(dirname "$0")/.." && pwd)
# scripts/vmtest builds it (and the test harness's helper binary, which
# vmtest packs into the VM) once (VMTEST_BUILT) for VMs started side by side.
if [ -z "${VMTEST_BUILT:-}" ]; then
  mkdir -p "$root/vmtest/cache"
  (cd "$root" && go build -o vmtest/cache/vmtest ./vmtest && go build -o vmtest/cache/kerneltest-helper ./internal/kerneltest/helper)
fi
exec "$root/vmtest/cache/vmtest" "$@"
