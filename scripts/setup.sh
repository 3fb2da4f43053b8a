#!/usr/bin/env bash
# Idempotent set-up: Debian packages (when root), a .venv in the repo, tapml installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES="mesa-vulkan-drivers libvulkan1 libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri chromium"
missing=""
for p in $DEB_PACKAGES; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing Debian packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
  else
    echo "warning: missing Debian packages:$missing (run as root or install them with apt-get)" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.tapml-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch pinned first: an open range pulls the CUDA build (GBs).
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
