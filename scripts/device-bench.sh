#!/usr/bin/env bash
# On a CUDA machine with no package index (the lent GPU machine): NIXL wheels carried in
# .whl/ (nixl, nixl-cu13 for its Python), torch/numpy/pytest/hypothesis already there.
# Runs the NIXL tests (the VRAM variants included) and `kvproto bench transfer` on DRAM and
# on VRAM; results go to $OUT (or ./device-out).
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
{ nvidia-smi -L; nproc; python3 -c 'import torch, nixl; print(torch.__version__, torch.cuda.get_device_name(0))'; } \
  2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_nixl.py tests/test_wire.py 2>&1 \
  | grep -v '^[EWI][0-9]\{4\} ' | tail -15 | tee "$OUT/tests.txt"
for dev in ${DEVICES:-cpu cuda}; do
  run bench transfer --json --device "$dev" > "$OUT/bench-$dev.json" 2> "$OUT/bench-$dev.err"
  echo "bench $dev rc=$?"; tail -c 600 "$OUT/bench-$dev.json"; echo
done
