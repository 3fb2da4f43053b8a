"""Fuzzing of every user-facing parser: stores, model and target specs, --tol and --inject.

Each input either works or gives a TapmlError (exit 2) — never another exception, a hang or
unbounded memory. The number of inputs tried is printed in the run's summary.
"""

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tapml.carving import CarveStore
from tapml.judging.compare import Tolerances
from tapml.errors import TapmlError
from tapml.driving.inject import parse_faults
from tapml.frontends.models import load_model
from tapml.platforms.reference import ReferencePlatform
from tapml.driving.replay import replay
from tapml.driving.targets import check_target

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False)
                           | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def base_store(carved):
    return carved("zoo:mlp")


def _damage(store: Path, data) -> None:
    shard = sorted((store / "shards").iterdir())[0]
    manifest = store / "manifest.json"
    kind = data.draw(st.sampled_from(["truncate-manifest", "flip-manifest", "truncate-shard", "flip-shard",
                                      "huge-header", "field", "case-field", "tensor-shape"]))
    if kind in ("truncate-manifest", "truncate-shard"):
        path = manifest if kind == "truncate-manifest" else shard
        raw = path.read_bytes()
        path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    elif kind in ("flip-manifest", "flip-shard"):
        path = manifest if kind == "flip-manifest" else shard
        raw = bytearray(path.read_bytes())
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        path.write_bytes(bytes(raw))
    elif kind == "huge-header":
        raw = shard.read_bytes()
        shard.write_bytes(struct.pack("<Q", data.draw(st.integers(2**20, 2**64 - 1))) + raw[8:])
    else:
        m = json.loads(manifest.read_text())
        if kind == "field":
            m[data.draw(st.sampled_from(sorted(m)))] = data.draw(json_values)
        elif kind == "case-field":
            case = data.draw(st.sampled_from(m["cases"]))
            case[data.draw(st.sampled_from(sorted(case)))] = data.draw(json_values)
        else:
            info = m["tensors"][data.draw(st.sampled_from(sorted(m["tensors"])))]
            info[data.draw(st.sampled_from(["shape", "dtype", "shard"]))] = data.draw(
                st.lists(st.integers(0, 2**40), max_size=4) | st.text(max_size=10) | json_values)
        manifest.write_text(json.dumps(m))


def test_fuzzed_stores_open_or_fail_clearly(base_store, figure):
    outcomes = {"refused": 0, "opened": 0}

    @FUZZ
    @given(st.data())
    def check(data):
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "s"
            shutil.copytree(base_store, store)
            _damage(store, data)
            try:
                s = CarveStore(store)
            except TapmlError as e:
                assert str(e)
                outcomes["refused"] += 1
                return
            outcomes["opened"] += 1
            try:
                result = replay(s, ReferencePlatform(), "reference")
            except TapmlError:
                return
            assert len(result["cases"]) == len(s.cases)
            assert all(v["status"] in ("pass", "mismatch", "unsupported", "error") for v in result["cases"])

    check()
    total = outcomes["refused"] + outcomes["opened"]
    figure("fuzzed stores tried", total)
    assert total >= 100 and outcomes["refused"] > 0


def test_fuzzed_specs_and_options_fail_clearly(figure):
    tried = 0

    @FUZZ
    @given(st.text(max_size=40), st.sampled_from(["model", "target", "tol", "inject"]))
    def check(text, which):
        nonlocal tried
        tried += 1
        try:
            if which == "model":
                if text.startswith(("zoo:", "hf:")) or text.endswith((".py", ".pt2")) or ".py:" in text:
                    return  # valid-looking specs load real models; covered elsewhere
                load_model(text)
            elif which == "target":
                check_target(text)
            elif which == "tol":
                Tolerances.parse([text])
            else:
                parse_faults([text])
        except TapmlError as e:
            assert str(e)

    check()
    figure("fuzzed specs and options tried", tried)
    assert tried >= 100
