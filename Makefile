# Both targets install what they need first (idempotent), then run.
PY := .venv/bin/python
export XDG_RUNTIME_DIR ?= /tmp/tapml-xdg-$(shell id -u)

.PHONY: setup demo test
setup:
	@mkdir -p $(XDG_RUNTIME_DIR) && chmod 700 $(XDG_RUNTIME_DIR)
	@bash scripts/setup.sh

demo: setup
	rm -rf stores/tiny-llama
	.venv/bin/tapml carve zoo:tiny-llama -o stores/tiny-llama
	.venv/bin/tapml inspect stores/tiny-llama
	.venv/bin/tapml replay stores/tiny-llama --target reference --json stores/tiny-llama-reference.json
	.venv/bin/tapml replay stores/tiny-llama --target wgpu:vulkan --json stores/tiny-llama-vulkan.json

test: setup
	$(PY) -m pytest -n 2 --dist loadgroup -q -rs
