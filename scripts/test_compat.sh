#!/usr/bin/env bash
# `make test-compat TORCH=VERSION`: the fast and device tiers under another torch, in a second
# environment (.venv-torch-VERSION; the main .venv is never touched). Everything but torch comes from
# requirements.lock; torch VERSION and what it needs come from the package index as a user would get them.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${1:?usage: scripts/test_compat.sh TORCH_VERSION}
venv=.venv-torch-$torch
PY=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv"
fi
stamp=$venv/.tapml-installed
if [ ! -f "$stamp" ] || [ requirements.lock -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  without_torch=$(mktemp) && trap 'rm -f "$without_torch"' EXIT
  awk '/^torch==/ {skip = 1; next} /^[^ #]/ {skip = 0} !skip' requirements.lock > "$without_torch"
  "$venv/bin/python" -m pip install -q "torch==$torch"
  "$venv/bin/python" -m pip install -q --require-hashes -r "$without_torch"
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
  "$venv/bin/python" -m pip check
  touch "$stamp"
fi
installed=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
echo "torch $installed in $venv"
start=$(date +%s)
"$venv/bin/python" -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m "not browser and not slow" "${@:2}"
echo "fast and device tiers under torch $installed: passed in $(( $(date +%s) - start )) s"
