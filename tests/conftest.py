"""Shared fixtures: carved stores of zoo models, made once per test process."""

import os
import warnings

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="session")
def carved(tmp_path_factory):
    """``carved("zoo:mlp")`` -> path of a store carved from that spec (cached per session)."""
    from tapml.carving import carve
    cache = {}

    def get(spec: str, **kwargs):
        key = (spec, tuple(sorted(kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(spec.replace(":", "_").replace("/", "_"))
            carve(spec, path / "store", **kwargs)
            cache[key] = path / "store"
        return cache[key]

    return get
