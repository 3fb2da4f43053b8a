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


# --- the manifest's schema: a wrong-typed value anywhere is refused, naming its path ------------

#: Fields whose content the manifest leaves open (encoded arguments, the model's config): not walked.
_OPEN_FIELDS = {"args", "kwargs", "hf_config"}
#: Objects keyed by names (tensors, graph inputs, refs): their keys are data, not fields.
_NAMED = {"tensors", "program_inputs", "model_outputs", "prefill_state", "state", "inputs"}
_WRONG = [None, True, 7, 12.9, "x", [], {}]


def _json_type(value) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(value), "null")


def _declared_paths(value, loc=()):
    """``(loc, value)`` of every place of a manifest whose type its schema declares."""
    if loc:
        yield loc, value
    if loc and loc[-1] in _OPEN_FIELDS:
        return
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from _declared_paths(item, loc + (key,))


def _pattern(loc) -> tuple:
    return tuple("*" if isinstance(k, int) or (i and loc[i - 1] in _NAMED) else k for i, k in enumerate(loc))


def _through(value, locs: list[tuple], named: bool = False):
    """``value`` with only what the places at ``locs`` (relative to it) go through: a list's items up
    to the last they index, the entries they name of an object keyed by names (``named``); the
    fields of an object and what no place goes into are kept whole, so the schema still holds."""
    locs = [loc for loc in locs if loc]
    if not locs:
        return value
    under = {}
    for loc in locs:
        under.setdefault(loc[0], []).append(loc[1:])
    if isinstance(value, list):
        return [_through(item, under.get(i, [])) for i, item in enumerate(value[:max(under) + 1])]
    return {key: _through(item, under.get(key, []), key in _NAMED) for key, item in value.items()
            if key in under or not named}


def _put(document: dict, loc: tuple, value):
    """Put ``value`` at ``loc`` of ``document``; returns what was there."""
    parent = document
    for key in loc[:-1]:
        parent = parent[key]
    kept, parent[loc[-1]] = parent[loc[-1]], value
    return kept


def _refused_at(manifest: dict, loc: tuple, wrong):
    """Put ``wrong`` at ``loc``, check the manifest, put the value back; the SchemaError refusing it."""
    from tapml.carving.manifest import check_manifest
    from tapml.schema import SchemaError
    kept = _put(manifest, loc, wrong)
    try:
        with pytest.raises(SchemaError) as e:
            check_manifest(manifest)
    finally:
        _put(manifest, loc, kept)
    return e.value


def _is_wrong(loc: tuple, value, wrong) -> bool:
    """Whether the schema must refuse ``wrong`` in place of ``value`` at ``loc``: another JSON type
    (but a node's ``case`` may be null, and ``format_version`` is refused by its own rule, before
    the schema)."""
    return (_json_type(wrong) != _json_type(value) and loc != ("format_version",)
            and not (wrong is None and loc[-1] == "case"))


def test_wrong_typed_manifest_fields_are_refused_naming_their_path(gen_store, tmp_path, figure):
    """Every field kind of a real generation store's manifest (the first place of each, by its path
    with indices and names generalized), given a value of each other JSON type, is refused with the
    field's path; then values of fuzzed JSON at random places; and on the command line, exit 2
    naming the manifest and the path."""
    from typer.testing import CliRunner

    from tapml.carving.manifest import check_manifest
    from tapml.cli import app
    from tapml.schema import field_path
    manifest = json.loads((gen_store / "manifest.json").read_text())
    check_manifest(manifest)
    places = list(_declared_paths(manifest))
    first = {}
    for loc, value in places:
        first.setdefault(_pattern(loc), (loc, value))
    # what the first places go through, so that each check reads a small manifest (a wrong type stops
    # it at the schema, before the references that this cut breaks)
    manifest = _through(manifest, [loc for loc, _ in first.values()])
    places = list(_declared_paths(manifest))
    tried = 0
    for loc, value in first.values():
        for wrong in (w for w in _WRONG if _is_wrong(loc, value, w)):
            e = _refused_at(manifest, loc, wrong)
            assert e.path == field_path(loc) and str(e).startswith(f"{e.path} is {wrong!r}: "), (loc, wrong, str(e))
            tried += 1
    kinds = {p[-1] for p in first if isinstance(p[-1], str)}
    assert {"token", "reference_tokens", "alias", "shard", "view", "stride", "instances", "output_meta", "multi",
            "prefill_state", "max_cache_len", "logits", "steps", "graph", "kind"} <= kinds, kinds

    @FUZZ
    @given(st.sampled_from(places), json_values)
    def fuzzed(place, wrong):
        nonlocal tried
        loc, value = place
        if not _is_wrong(loc, value, wrong):
            return
        assert _refused_at(manifest, loc, wrong).path == field_path(loc)
        tried += 1

    fuzzed()
    figure("wrong-typed manifest fields refused", tried)

    store = tmp_path / "store"
    shutil.copytree(gen_store, store)
    name = next(n for n in manifest["tensors"] if not n.isidentifier())
    for loc, wrong, expected in [
            (("generation", "steps", 1, "token"), 12.9, "generation.steps[1].token is 12.9: input should be a valid integer"),
            (("tensors", name, "shape", 0), "2", f"tensors[{name!r}].shape[0] is '2': input should be a valid integer")]:
        edited = json.loads((gen_store / "manifest.json").read_text())
        _put(edited, loc, wrong)
        (store / "manifest.json").write_text(json.dumps(edited))
        r = CliRunner().invoke(app, ["inspect", str(store)])
        text = " ".join(r.output.split())
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert f"manifest.json is malformed: {expected}; carve the model again" in text, text
