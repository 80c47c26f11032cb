#!/usr/bin/env bash
# Idempotent setup for a fresh machine: project venv, CPU torch first, the package,
# and a Java runtime for TLC. Safe to run repeatedly; fast when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.kvproto-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && command -v java >/dev/null 2>&1; then
  exit 0
fi
log() { echo "[setup] $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  # CPU build first, so that nixl's torch dependency never pulls a multi-GB CUDA build.
  log "installing CPU torch"
  $PIP install --quiet "torch==2.13.0" || $PIP install --quiet torch --index-url https://download.pytorch.org/whl/cpu
fi
log "installing kvproto and its dependencies"
$PIP install --quiet -e ".[dev]"
if ! command -v java >/dev/null 2>&1; then
  log "installing a Java runtime for TLC (apt)"
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq default-jre-headless >/dev/null
  else
    log "WARNING: no java and no apt-get; TLC checks will be skipped with a clear message"
  fi
fi
rm -f "$VENV"/.kvproto-setup-*
touch "$stamp"
log "done"
