#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it.
#
# With no arguments: lint, types, then the tests in three parts that together select every
# test exactly once (markers `background`, `vllm` and `nixl` split them):
#   1. the tests that start no vLLM engine and no NIXL agent test pair, spread over the
#      machine's cores (pytest-xdist; each module stays on one worker, so module-scoped
#      fixtures are built once);
#   2. the tests that do (real engines, real NIXL agents), one at a time: they share
#      engine pairs per module, and their leases assume the cores are theirs;
#   B. beside both, from the start: the `background` tests (model checking, property
#      runs: CPU-bound, no wall-clock bound), at idle CPU priority (SCHED_IDLE, else nice
#      19), so that they use only the CPU the other two leave idle. Their output goes to a
#      log file, shown when they end.
# KVPROTO_TEST_WORKERS sets the worker count of parts 1 and B (default: the machine's
# cores). With one worker, or without pytest-xdist, parts 1 and B run together in this
# process before part 2. With more than one, each TLC run in parts 1 and B gets one TLC
# worker (KVPROTO_TLC_WORKERS=1, unless set: the xdist workers already fill the cores, and
# one TLC worker spends less CPU per model). KVPROTO_DURATIONS sets how many of pass 2's
# slowest set-ups and tests its log lists (default 15; 0: all). With arguments: one pytest
# run with them, as given (`scripts/test.sh -k storm`, `scripts/test.sh tests/test_ledger.py`).
set -uo pipefail
cd "$(dirname "$0")/.."
# The suite starts hundreds of Python processes (xdist workers, CLI subprocesses, engines):
# with bytecode caching off (some machines set PYTHONDONTWRITEBYTECODE globally) each one
# compiles kvproto and pytest rewrites every test module again, about 10 s per pytest
# process. The caches (__pycache__) are ignored by git.
unset PYTHONDONTWRITEBYTECODE
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

engine_pass() {
  echo "== pass 2 of 2: tests with real vLLM engines and NIXL agents, one at a time" >&2
  # the slowest modules' set-ups and tests, for whoever reads a slow run's log
  run -m "vllm or nixl" --durations="${KVPROTO_DURATIONS:-15}"
}

workers=${KVPROTO_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
start=$SECONDS
if [ "$workers" -le 1 ] || ! "$VENV/bin/python" -c "import xdist" >/dev/null 2>&1; then
  echo "== pass 1 of 2: tests without engines or NIXL agent pairs (in one process)" >&2
  run -m "not vllm and not nixl"
  rc1=$?
  echo "== pass 1 of 2: exit $rc1 after $((SECONDS - start)) s" >&2
  engine_pass
  rc2=$?
  echo "== pass 2 of 2: exit $rc2; both passes took $((SECONDS - start)) s" >&2
  [ "$rc1" = 0 ] && [ "$rc2" = 0 ]
  exit $?
fi

xdist=(-n "$workers" --dist loadfile)
tlc_workers=${KVPROTO_TLC_WORKERS:-1}
idle=(nice -n 19)
if chrt --idle 0 true >/dev/null 2>&1; then
  idle=(chrt --idle 0)
fi
bg_log=$(mktemp "${TMPDIR:-/tmp}/kvproto-test-background.XXXXXX")
echo "== background: the background tests at idle CPU priority (${idle[*]}), on $workers" \
     "workers, beside the two passes; log: $bg_log" >&2
# its own process group (setsid), so that an interrupted run stops it with its workers
( KVPROTO_TLC_WORKERS=$tlc_workers setsid "${idle[@]}" "$VENV/bin/python" -m pytest \
    -m "background and not vllm and not nixl" "${xdist[@]}" >"$bg_log" 2>&1 &
  echo "$!" >"$bg_log.pid"; wait "$!"; echo "$?" >"$bg_log.rc" ) &
bg_pid=$!
stop_background() {
  local pg
  pg=$(cat "$bg_log.pid" 2>/dev/null) || return 0
  [ -n "$pg" ] && kill -TERM -- "-$pg" 2>/dev/null
  return 0
}
trap 'stop_background; exit 130' INT TERM
echo "== pass 1 of 2: other tests without engines or NIXL agent pairs (on $workers workers)" >&2
KVPROTO_TLC_WORKERS=$tlc_workers run -m "not background and not vllm and not nixl" "${xdist[@]}"
rc1=$?
echo "== pass 1 of 2: exit $rc1 after $((SECONDS - start)) s" >&2
engine_pass
rc2=$?
echo "== pass 2 of 2: exit $rc2 after $((SECONDS - start)) s" >&2
if [ -z "$(cat "$bg_log.rc" 2>/dev/null)" ]; then
  echo "== background: still running; waiting for it" >&2
fi
wait "$bg_pid"
rcb=$(cat "$bg_log.rc" 2>/dev/null || echo 1)
if [ "$rcb" = 5 ]; then
  echo "background pass collected no tests: treating as failure" >&2
fi
if [ "$rcb" = 0 ]; then
  tail -n 12 "$bg_log"
else
  cat "$bg_log"
fi
echo "== background: exit $rcb; all parts took $((SECONDS - start)) s" >&2
trap - INT TERM
rm -f "$bg_log" "$bg_log.rc" "$bg_log.pid"
[ "$rc1" = 0 ] && [ "$rc2" = 0 ] && [ "$rcb" = 0 ]
exit $?
