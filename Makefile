# Both targets install what they need first (idempotent), then run.
PY := .venv/bin/python
export XDG_RUNTIME_DIR ?= /tmp/tapml-xdg-$(shell id -u)

.PHONY: setup demo test lint-imports lock test-compat
setup:
	@mkdir -p $(XDG_RUNTIME_DIR) && chmod 700 $(XDG_RUNTIME_DIR)
	@bash scripts/setup.sh

demo: setup
	rm -rf stores/tiny-llama
	.venv/bin/tapml carve zoo:tiny-llama -o stores/tiny-llama
	.venv/bin/tapml inspect stores/tiny-llama
	.venv/bin/tapml replay stores/tiny-llama --target reference --json stores/tiny-llama-reference.json
	.venv/bin/tapml replay stores/tiny-llama --target wgpu:vulkan --json stores/tiny-llama-vulkan.json

# The layer contracts of pyproject.toml, on the package as it installs (scripts/layer_tree.py);
# run from the tree, since lint-imports puts the working directory first on sys.path.
lint-imports:
	@tree=$$(mktemp -d) && trap 'rm -rf "$$tree"' EXIT && \
	$(PY) scripts/layer_tree.py "$$tree" >/dev/null && \
	cd "$$tree" && PYTHONPATH="$$tree" $(CURDIR)/.venv/bin/lint-imports --config $(CURDIR)/pyproject.toml --no-cache

test: setup lint-imports
	$(PY) -m pytest -n 2 --dist loadgroup -q -rs --durations=30

# Refresh requirements.lock: the newest versions pyproject.toml's ranges allow, with their hashes; torch
# is held at LOCK_TORCH (the CPU build). Commit the refresh on its own, with the `make test` run that passed on it.
LOCK_TORCH ?= 2.13.0+cpu
lock: setup
	@mkdir -p build && echo "torch==$(LOCK_TORCH)" > build/lock-constraints.txt
	CUSTOM_COMPILE_COMMAND="make lock" .venv/bin/pip-compile -q --upgrade --extra dev --extra backends --all-build-deps \
	  --allow-unsafe --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links \
	  -c build/lock-constraints.txt -o requirements.lock pyproject.toml

# The fast and device tiers under another torch (TORCH=2.14.1), in .venv-torch-$(TORCH), never .venv;
# PYTEST_ARGS (test files, -k ...) narrows the run.
TORCH ?= 2.14.1
test-compat:
	@mkdir -p $(XDG_RUNTIME_DIR) && chmod 700 $(XDG_RUNTIME_DIR)
	@bash scripts/test_compat.sh $(TORCH) $(PYTEST_ARGS)
