#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it.
#
# With no arguments: lint, types, then the tests in two passes that together select
# every test exactly once (markers `vllm` and `nixl` split them):
#   1. the tests that start no vLLM engine and no NIXL agent test pair, spread over the
#      machine's cores (pytest-xdist; each module stays on one worker, so module-scoped
#      fixtures are built once);
#   2. the tests that do (real engines, real NIXL agents), one at a time: they share
#      engine pairs per module, and their leases assume the cores are theirs.
# KVPROTO_TEST_WORKERS sets pass 1's worker count (default: the machine's cores; 1 runs
# it in this process); with more than one, each TLC run in pass 1 gets one TLC worker
# (KVPROTO_TLC_WORKERS=1, unless set: the xdist workers already fill the cores, and one
# TLC worker spends less CPU per model). With arguments: one pytest run with them, as given
# (`scripts/test.sh -k storm`, `scripts/test.sh tests/test_ledger.py`).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check kvproto tests || exit 1
"$VENV/bin/mypy" || exit 1

run() {
  "$VENV/bin/python" -m pytest "$@"
  local rc=$?
  if [ "$rc" = 5 ]; then
    echo "pytest collected no tests: treating as failure" >&2
    return 1
  fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  run "$@"
  exit $?
fi

workers=${KVPROTO_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
xdist=()
how="in one process"
if [ "$workers" -gt 1 ] && "$VENV/bin/python" -c "import xdist" >/dev/null 2>&1; then
  xdist=(-n "$workers" --dist loadfile)
  how="on $workers workers"
fi
start=$SECONDS
echo "== pass 1 of 2: tests without engines or NIXL agent pairs ($how)" >&2
if [ "${#xdist[@]}" -gt 0 ]; then
  KVPROTO_TLC_WORKERS=${KVPROTO_TLC_WORKERS:-1} run -m "not vllm and not nixl" "${xdist[@]}"
else
  run -m "not vllm and not nixl"
fi
rc1=$?
echo "== pass 1 of 2: exit $rc1 after $((SECONDS - start)) s" >&2
echo "== pass 2 of 2: tests with real vLLM engines and NIXL agents, one at a time" >&2
run -m "vllm or nixl"
rc2=$?
echo "== pass 2 of 2: exit $rc2; both passes took $((SECONDS - start)) s" >&2
if [ "$rc1" != 0 ] || [ "$rc2" != 0 ]; then
  exit 1
fi
exit 0
