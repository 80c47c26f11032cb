#!/usr/bin/env bash
# On a CUDA machine with no package index (the lent GPU machine): NIXL wheels carried in
# .whl/ (nixl, nixl-cu13 for its Python), torch/numpy/pytest/hypothesis already there.
# Runs the NIXL and checksum tests (the VRAM variants included), `kvproto bench transfer`
# on DRAM and on VRAM, and `bench transfer --checksum` on both; results go to $OUT (or
# ./device-out); env TESTS (test files), PYTEST_K (a -k filter), SKIP_TESTS, SKIP_CHECKSUM,
# DEVICES, TEST_TIMEOUT, BENCH_TIMEOUT: machine.txt, tests.txt, bench-<dev>.json, checksum-<dev>.json, log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
run() { python3 -c 'import sys; from kvproto.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
trun() { timeout "${BENCH_TIMEOUT:-90}" python3 -c 'import sys; from kvproto.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
{ nvidia-smi -L; nproc; uptime; python3 -c 'import torch, nixl; print(torch.__version__, torch.cuda.get_device_name(0))'; } \
  2>&1 | tee "$OUT/machine.txt"
TESTS=${TESTS:-tests/test_nixl.py tests/test_nixl_slices.py tests/test_nixl_split.py tests/test_wire.py
  tests/test_checksum.py tests/test_claim_grant.py tests/test_quarantine_nixl.py}
# shellcheck disable=SC2086  # TESTS is a list of paths
[ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m "not tlc" \
  -k "${PYTEST_K:-}" $TESTS 2>&1 \
  | grep -v '^[EWI][0-9]\{4\} ' | tail -40 | tee "$OUT/tests.txt"
for dev in ${DEVICES:-cpu cuda}; do
  trun bench transfer --json --device "$dev" \
    > "$OUT/bench-$dev.json" 2>> "$OUT/log.txt"
  echo "bench $dev rc=$?"; tail -c 400 "$OUT/bench-$dev.json"; echo
  [ -n "${SKIP_CHECKSUM:-}" ] || trun bench transfer --checksum --json --device "$dev" \
    > "$OUT/checksum-$dev.json" 2>> "$OUT/log.txt"
  echo "checksum $dev rc=$?"; tail -c 400 "$OUT/checksum-$dev.json"; echo
done
uptime | tee -a "$OUT/machine.txt"
