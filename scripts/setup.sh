#!/usr/bin/env bash
# Idempotent set-up: Debian packages (when root), a .venv in the repo holding exactly requirements.lock, tapml editable.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES="mesa-vulkan-drivers libvulkan1 libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri chromium clang"
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
# The environment is exactly requirements.lock (every package, every file checked against its hashes),
# plus tapml itself, editable. Redone only when the lock, pyproject.toml or this script changed.
stamp=.venv/.tapml-installed
if [ ! -f "$stamp" ] || [ requirements.lock -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  if [ ! -x .venv/bin/pip-sync ]; then
    .venv/bin/python -m pip install -q --require-hashes -r requirements.lock
  fi
  # pip-sync also removes what the lock no longer holds (tapml's editable install among them)
  .venv/bin/pip-sync -q requirements.lock
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  touch "$stamp"
fi

# onnxruntime-web for the ort-web targets: the npm package exactly as platforms/web/ort/package-lock.json pins it
# (its integrity hashes checked by npm ci), in platforms/web/ort/node_modules; redone when the lock changed.
web=platforms/web/ort
if [ ! -f "$web/node_modules/.tapml-installed" ] || [ "$web/package-lock.json" -nt "$web/node_modules/.tapml-installed" ]; then
  if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing Debian package: npm"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
  fi
  if command -v npm >/dev/null 2>&1; then
    (cd "$web" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null) && touch "$web/node_modules/.tapml-installed"
  else
    echo "warning: npm is missing, so the ort-web targets cannot run (install npm, then rerun make setup)" >&2
  fi
fi
