#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check kvproto tests || exit 1
"$VENV/bin/mypy" || exit 1
"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit "$rc"
