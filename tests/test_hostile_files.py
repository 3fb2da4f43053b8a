"""Hostile carve stores: crafted from a real carved zoo:mlp, each is refused by the real CLI
(replay, migrate, inspect, gen-tests) and by a generated suite with exit 2 and a message naming
the op or field, never a traceback, and never runs code or touches a file outside the store.

The attacks reproduce a security review: op names that were followed as attribute chains under
``torch.ops`` (``load_library``, ``aten.from_file`` with ``shared=True``, other namespaces,
in-place and out= ops), manifests that crash the parser (50k-deep arguments, 5000-digit
integers, ``Infinity``), fields migrate trusted (missing ``program_inputs``, unknown refs) and
shards that lie outside the store (a symlink, a ``..`` path).
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

TAPML = [sys.executable, "-m", "tapml.cli"]
DEEP = "__TAPML_HOSTILE_PLACEHOLDER__"


def tapml(*args):
    from tapml.cli import app
    return CliRunner().invoke(app, [str(a) for a in args])


# --- attacks: each edits the manifest of a fresh copy of zoo:mlp's store -----------------------

def _set_op(m, op, args=None, kwargs=None, index=1):
    """Node ``index`` and its case call ``op`` (with ``args``/``kwargs`` when given)."""
    node = m["nodes"][index]
    case = next(c for c in m["cases"] if c["id"] == node["case"])
    for item in (node, case):
        item["op"] = op
        if args is not None:
            item["args"] = args
        if kwargs is not None:
            item["kwargs"] = kwargs
    return m


def _first_case(m):
    return m["cases"][0]


def _from_file(m, ctx):
    # shared=True maps the file MAP_SHARED: torch creates it and writes through to it
    return _set_op(m, "aten.from_file.default", [str(ctx["marker"]), True, 64], {})


def _save(m, ctx):
    node = m["nodes"][1]
    return _set_op(m, "aten.save.default", [{"ref": node["args"][0]["ref"]}, str(ctx["marker"])], {})


def _load_library(m, ctx):
    return _set_op(m, "load_library.__call__.__call__", [str(ctx["outside"] / "evil.so")], {})


def _deep(m, ctx):
    _first_case(m)["args"] = [DEEP]
    return json.dumps(m).replace(f'"{DEEP}"', "[" * 50_000 + "]" * 50_000)


def _placeholder(value):
    def attack(m, ctx):
        _first_case(m)["args"] = [{"ref": _first_case(m)["inputs"][0]}, DEEP]
        return json.dumps(m).replace(f'"{DEEP}"', value)
    return attack


def _first_shard(m):
    """The shard of the first case's first input (of the tensor it aliases, if it is an alias)."""
    info = m["tensors"][_first_case(m)["inputs"][0]]
    return m["tensors"][info.get("alias", _first_case(m)["inputs"][0])]["shard"]


def _alias_cycle(m, ctx):
    name, info = next((n, i) for n, i in m["tensors"].items() if "alias" in i)
    m["tensors"][info["alias"]] = {"alias": name, "shape": info["shape"], "dtype": info["dtype"]}
    return m


def _alias_view_past_its_target(m, ctx):
    name, info = next((n, i) for n, i in m["tensors"].items() if "alias" in i)
    info["view"] = {"offset": 1 << 40, "stride": [1] * len(info["shape"])}
    return m


def _symlinked_shard(m, ctx):
    shard = ctx["store"] / _first_shard(m)
    victim = ctx["outside"] / "victim.safetensors"
    shutil.copy(shard, victim)  # a valid shard, so only where it lies can refuse it
    shard.unlink()
    shard.symlink_to(victim)
    return m


def _escaping_shard(m, ctx):
    shard = _first_shard(m)
    shutil.copy(ctx["store"] / shard, ctx["outside"] / "victim.safetensors")
    for info in m["tensors"].values():
        if info.get("shard") == shard:
            info["shard"] = "../outside/victim.safetensors"
    return m


def _drop(*keys):
    def attack(m, ctx):
        target = m
        for k in keys[:-1]:
            target = target[k]
        del target[keys[-1]]
        return m
    return attack


def _edit(fn):
    def attack(m, ctx):
        fn(m)
        return m
    return attack


ATTACKS = {
    # op vocabulary
    "load-library-chain": (_load_library, "load_library.__call__.__call__"),
    "from-file-shared": (_from_file, "aten.from_file.default"),
    "save-to-file": (_save, "aten.save.default"),
    "prims-namespace": (lambda m, ctx: _set_op(m, "prims.add.default"), "prims.add.default"),
    "profiler-namespace": (lambda m, ctx: _set_op(m, "profiler._record_function_enter.default"),
                           "profiler._record_function_enter.default"),
    "_C-namespace": (lambda m, ctx: _set_op(m, "_C._set_grad_enabled.default"), "_C._set_grad_enabled.default"),
    "attribute-chain": (lambda m, ctx: _set_op(m, "aten.addmm.default.__call__"), "aten.addmm.default.__call__"),
    "dunder-overload": (lambda m, ctx: _set_op(m, "aten.addmm.__call__"), "aten.addmm.__call__"),
    "in-place": (lambda m, ctx: _set_op(m, "aten.add_.Tensor"), "aten.add_.Tensor"),
    "out-variant": (lambda m, ctx: _set_op(m, "aten.addmm.out"), "aten.addmm.out"),
    "unknown-internal": (lambda m, ctx: _set_op(m, "aten._test_serialization_subcmul.default"),
                         "aten._test_serialization_subcmul.default"),
    "case-op-only": (_edit(lambda m: m["cases"][1].update(op="aten.from_file.default", args=["x", True, 64])),
                     "cases[1]: case 'c1': field 'op': op 'aten.from_file.default' is refused"),
    "no-such-op": (lambda m, ctx: _set_op(m, "aten.nope.default"), "aten.nope.default"),
    "op-not-a-string": (lambda m, ctx: _set_op(m, ["aten", "addmm"]), "'op'"),
    # parser limits
    "50k-deep-args": (_deep, "nests too deeply"),
    "5000-digit-int": (_placeholder("9" * 5000), "cases[0].args[1]: an integer of 5000 digits"),
    "infinity-arg": (_placeholder("Infinity"), "cases[0].args[1]: the JSON constant Infinity"),
    "nan-arg": (_placeholder("NaN"), "cases[0].args[1]: the JSON constant NaN"),
    "float-overflow": (_placeholder("1e999"), "cases[0].args[1]: the number 1e999 overflows"),
    "65-deep-args": (_edit(lambda m: _first_case(m).update(args=[json.loads("[" * 65 + "]" * 65)])), "nested deeper"),
    "int-beyond-64-bits": (_edit(lambda m: _first_case(m)["args"].append(2 ** 70)),
                           "cases[0].args[2]: an integer of 22 digits"),
    "layout-as-attribute": (_edit(lambda m: _first_case(m)["args"].append({"layout": "load"})),
                            "not an encoded argument"),
    # fields migrate and replay trust
    "missing-program-inputs": (_drop("program_inputs"), "program_inputs"),
    "missing-program-input": (_drop("program_inputs", "p_0_weight"), "program_inputs"),
    "missing-model-outputs": (_drop("model_outputs"), "model_outputs"),
    "unknown-node-ref": (_edit(lambda m: m["nodes"][1]["args"].__setitem__(0, {"ref": "nowhere"})), "'nowhere'"),
    "unknown-case-ref": (_edit(lambda m: _first_case(m)["args"].__setitem__(0, {"ref": "nowhere"})), "'nowhere'"),
    "unknown-output-ref": (_edit(lambda m: m["graph_outputs"].append("nowhere")), "'nowhere'"),
    "unknown-tensor": (_edit(lambda m: _first_case(m)["inputs"].append("nowhere")), "'nowhere'"),
    "negative-shape": (_edit(lambda m: m["graph_inputs"][0].update(shape=[-1, 32])), "shape"),
    "string-shape": (_edit(lambda m: m["tensors"][_first_case(m)["inputs"][0]].update(shape=["64", 32])), "shape"),
    "huge-shape": (_edit(lambda m: m["nodes"][0]["outputs"][0].update(shape=[2 ** 60])), "shape"),
    "non-string-name": (_edit(lambda m: m["nodes"][0].update(name=7)), "node name"),
    "non-string-model": (_edit(lambda m: m.update(model={"spec": "zoo:mlp"})), "'model'"),
    "duplicate-case-id": (_edit(lambda m: m["cases"][1].update(id=m["cases"][0]["id"])), "used twice"),
    "symlinked-shard": (_symlinked_shard, "outside the store"),
    "escaping-shard": (_escaping_shard, "outside the store"),
    "alias-cycle": (_alias_cycle, "an alias must name a stored tensor (no chains or cycles)"),
    "alias-view-past-its-target": (_alias_view_past_its_target, "its view reads element"),
}


@pytest.fixture(scope="module")
def clean_store(carved):
    return carved("zoo:mlp")


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its kind, size, mtime and content hash."""
    seen = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
        seen[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return seen


def hostile(clean_store, tmp_path, name) -> dict:
    """A copy of the clean store edited by attack ``name``; returns the paths of the scene."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    shutil.copytree(clean_store, store)
    outside.mkdir()
    (outside / "precious.txt").write_text("do not touch")
    ctx = {"store": store, "outside": outside, "marker": outside / "marker"}
    attack, expected = ATTACKS[name]
    edited = attack(json.loads((store / "manifest.json").read_text()), ctx)
    (store / "manifest.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    return {**ctx, "expected": expected, "before": snapshot(tmp_path)}


def assert_untouched(scene, tmp_path):
    assert not scene["marker"].exists(), "the store ran an op that wrote a file"
    assert snapshot(tmp_path) == scene["before"]


def assert_refused(result, scene):
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert scene["expected"] in text, text


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_hostile_store_is_refused_by_every_command(clean_store, tmp_path, name):
    scene = hostile(clean_store, tmp_path, name)
    store = scene["store"]
    assert_refused(tapml("inspect", store), scene)
    assert_refused(tapml("replay", store, "--target", "reference", "--json", tmp_path / "out.json"), scene)
    assert_refused(tapml("migrate", store, "--target", "reference", "--state", tmp_path / "state.json"), scene)
    assert_refused(tapml("gen-tests", store, "-o", tmp_path / "suite"), scene)
    assert_untouched(scene, tmp_path)  # no verdicts, state or suite written either


@pytest.mark.parametrize("name", ["from-file-shared", "load-library-chain", "50k-deep-args"])
def test_real_entry_point_refuses_with_exit_2(clean_store, tmp_path, name):
    scene = hostile(clean_store, tmp_path, name)
    for args in (["replay", "--target", "reference"],
                 ["migrate", "--target", "reference", "--state", str(tmp_path / "state.json")]):
        env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
        r = subprocess.run(TAPML + [args[0], str(scene["store"]), *args[1:]], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and scene["expected"] in " ".join(r.stderr.split())
    assert_untouched(scene, tmp_path)


@pytest.mark.parametrize("name", ["from-file-shared", "load-library-chain", "symlinked-shard"])
def test_generated_suite_on_a_hostile_store_fails_clearly(clean_store, tmp_path, name):
    """A suite whose data was swapped for a hostile store (its manifest hash updated too, as the
    sender of both could): every test fails naming the op or field, and nothing runs."""
    suite = tmp_path / "suite"
    r = tapml("gen-tests", clean_store, "-o", suite, "--copy-data")
    assert r.exit_code == 0, r.output
    staged = tmp_path / "staged"
    staged.mkdir()
    scene = hostile(clean_store, staged, name)
    data = suite / "data"
    shutil.rmtree(data)
    shutil.copytree(scene["store"], data, symlinks=True)
    conftest = suite / "conftest.py"
    digest = hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest()
    conftest.write_text(re.sub(r"STORE_MANIFEST_SHA256 = '[0-9a-f]+'", f"STORE_MANIFEST_SHA256 = {digest!r}",
                               conftest.read_text()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TAPML_"))}
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    r = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "-x"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    output = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1, output
    assert scene["expected"] in output and "passed" not in output
    assert not scene["marker"].exists()
    assert (scene["outside"] / "precious.txt").read_text() == "do not touch"


def test_vocabulary_accepts_every_op_of_the_zoo(carved):
    """Every op that real exported graphs hold (zoo models, pure torch and transformers) passes."""
    from tapml.carving import CarveStore
    from tapml.ops import check_op
    ops = set()
    for spec in ("zoo:mlp", "zoo:cnn", "zoo:tiny-llama"):
        store = CarveStore(carved(spec))
        ops |= {n.op for n in store.graph.nodes} | {c["op"] for c in store.cases}
    for op in sorted(ops):
        check_op(op)
    assert {"aten._softmax.default", "aten._native_batch_norm_legit_no_training.default"} <= ops


@pytest.mark.parametrize("name,why", [
    ("aten.add.Tensor", None),
    ("aten._to_copy.default", None),
    ("aten._unsafe_view.default", None),
    ("aten.from_file.default", "reaches outside tensors"),
    ("aten.save.default", "reaches outside tensors"),
    ("aten.manual_seed.default", "reaches outside tensors"),
    ("aten.add_.Tensor", "writes to its argument 'self'"),
    ("aten.add.out", "writes to its argument 'out'"),
    ("aten.set_.source_Tensor", "writes to its argument"),
    ("aten._print.default", "reaches outside tensors"),
    ("aten.item.default", "does not return tensors"),
    ("aten._test_serialization_subcmul.default", "torch internal"),
    ("aten.add.NoSuchOverload", "has no overload"),
    ("aten.name.default", "has no aten op"),
    ("prims.add.default", "aten.NAME.OVERLOAD"),
    ("load_library.__call__.__call__", "aten.NAME.OVERLOAD"),
    ("aten.__and__.Tensor", "aten.NAME.OVERLOAD"),
    ("aten.add.Tensor ", "aten.NAME.OVERLOAD"),
    ("aten." + "a" * 300 + ".default", "aten.NAME.OVERLOAD"),
])
def test_vocabulary_decides_with_a_reason(name, why):
    from tapml.graph import resolve_op as graph_resolve_op
    from tapml.ops import check_op, resolve_op
    assert graph_resolve_op is resolve_op
    if why is None:
        check_op(name)
        assert resolve_op(name).name().replace("::", ".").startswith(name.rsplit(".", 1)[0])
        return
    with pytest.raises(ValueError) as e:
        check_op(name)
    assert why in str(e.value) and repr(name[:100])[:-1] in str(e.value)


def test_reference_platform_refuses_a_graph_sent_with_a_foreign_op(tmp_path):
    """Programs reach the reference platform as JSON (a device server, a cached program): the
    graph is read with Graph.from_json, which checks every op before anything runs."""
    from tapml.graph import Graph
    marker = tmp_path / "marker"
    graph = {"inputs": [], "outputs": ["f"],
             "nodes": [{"name": "f", "op": "aten.from_file.default", "args": [str(marker), True, 64], "kwargs": {},
                        "outputs": [{"shape": [64], "dtype": "uint8"}]}]}
    with pytest.raises(ValueError, match="aten.from_file.default"):
        Graph.from_json(graph)
    assert not marker.exists()
