# Both targets install what they need first (idempotent), then run.
PY := .venv/bin/python
export XDG_RUNTIME_DIR ?= /tmp/tapml-xdg-$(shell id -u)

.PHONY: setup demo test lint-imports
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
	$(PY) -m pytest -n 2 --dist loadgroup -q -rs
