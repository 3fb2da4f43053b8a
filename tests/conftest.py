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


@pytest.fixture(scope="session")
def mlp(carved):
    """The CarveStore of zoo:mlp: the smallest real model, for tests about everything but the model."""
    from tapml.carving import CarveStore
    return CarveStore(carved("zoo:mlp"))


@pytest.fixture(scope="session")
def gen_store(tmp_path_factory):
    """A zoo:tiny-llama generation store (prompt 5, 2 decode steps), carved once per test process."""
    from tapml.carving.generation import carve_generation
    path = tmp_path_factory.mktemp("gen") / "store"
    carve_generation("zoo:tiny-llama", path, tokens=2, prompt_len=5)
    return path


@pytest.fixture
def figure(record_property):
    """``figure("fuzz inputs tried", 400)``: a number printed in the run's summary (works under xdist)."""
    return lambda name, value: record_property(f"figure:{name}", value)


def pytest_terminal_summary(terminalreporter):
    figures = [(name[7:], value) for reports in terminalreporter.stats.values() for r in reports
               if getattr(r, "when", None) == "call"
               for name, value in getattr(r, "user_properties", []) if str(name).startswith("figure:")]
    if figures:
        terminalreporter.section("tapml figures")
        for name, value in figures:
            terminalreporter.line(f"{name}: {value}")
