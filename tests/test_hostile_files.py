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
from support import KINDS, make_kind, no_hang
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
    "op-not-a-string": (lambda m, ctx: _set_op(m, ["aten", "addmm"]),
                        "nodes[1].op is ['aten', 'addmm']: input should be a valid string"),
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
    "complex-of-strings": (_edit(lambda m: _first_case(m)["args"].append({"complex": ["1", 2.0]})),
                           "not an encoded complex number"),
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
    "non-string-name": (_edit(lambda m: m["nodes"][0].update(name=7)), "nodes[0].name is 7: input should be a valid string"),
    "non-string-model": (_edit(lambda m: m.update(model={"spec": "zoo:mlp"})),
                         "model is {'spec': 'zoo:mlp'}: input should be a valid string"),
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


def hostile(clean_store, tmp_path, name, attacks=None) -> dict:
    """A copy of the clean store edited by attack ``name`` (of ``attacks``, default ATTACKS);
    returns the paths of the scene."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    shutil.copytree(clean_store, store)
    outside.mkdir()
    (outside / "precious.txt").write_text("do not touch")
    ctx = {"store": store, "outside": outside, "marker": outside / "marker"}
    attack, expected = (ATTACKS if attacks is None else attacks)[name]
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


# --- shards through safetensors, and header bombs ------------------------------------------

def test_safetensors_reads_a_carved_shard_and_the_store_reads_through_safe_open(clean_store, monkeypatch):
    """The library reads every shard tapml wrote, tensor for tensor as the store does; and the
    store opens its shards with ``safetensors.safe_open`` (a spy counts the calls it passes on)."""
    import safetensors
    import torch
    from safetensors.torch import load_file

    from tapml.carving import CarveStore
    manifest = json.loads((clean_store / "manifest.json").read_text())
    stored = {n: i for n, i in manifest["tensors"].items() if "shard" in i}
    opened = []
    real = safetensors.safe_open

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    store = CarveStore(clean_store)
    shards = sorted({i["shard"] for i in stored.values()})
    assert sorted(opened) == sorted(Path(s).name for s in shards)
    for shard in shards:
        tensors = load_file(clean_store / shard)
        assert set(tensors) == {n for n, i in stored.items() if i["shard"] == shard}
        for name, t in tensors.items():
            assert list(t.shape) == stored[name]["shape"] and torch.equal(store.tensor(name), t)


def _shard_parts(path: Path) -> tuple[dict, bytes]:
    """(header, data) of a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_shard(path: Path, header, data: bytes, length: int | None = None) -> None:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(head) if length is None else length).to_bytes(8, "little") + head + data)


def _rewrite_first_shard(edit):
    """An attack that rewrites the first shard: ``edit(header, data, path)`` writes it anew."""
    def attack(m, ctx):
        path = ctx["store"] / _first_shard(m)
        header, data = _shard_parts(path)
        edit(header, data, path)
        return m
    return attack


def _nested_lists(size: int) -> bytes:
    return b'{"__metadata__": [' + b",".join([b"[]"] * (size // 3)) + b"]}"


def _entries(header):
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])


def _overlap(header, data, path):
    (_, a), (_, b) = _entries(header)[:2]
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0]]
    _write_shard(path, header, data)


def _gap(header, data, path):
    for _, e in _entries(header)[1:]:
        e["data_offsets"] = [e["data_offsets"][0] + 4, e["data_offsets"][1] + 4]
    _write_shard(path, header, data + b"\0" * 4)


def _past_end(header, data, path):
    _, last = _entries(header)[-1]
    last["data_offsets"][1] += 4
    _write_shard(path, header, data)


def _many_shards(m, ctx):
    for i, info in enumerate(v for v in m["tensors"].values() if "shard" in v):
        info["shard"] = f"shards/t{i}.safetensors"
    return m


HEADER_BOMBS = {
    # the audit's bomb: megabytes of nested empty lists, declared honestly
    "nested-lists-8MiB": _rewrite_first_shard(lambda h, d, p: _write_shard(p, _nested_lists(8 << 20), d)),
    # within the length bound, so the parser sees it: not the safetensors schema
    "nested-lists-512KiB": _rewrite_first_shard(lambda h, d, p: _write_shard(p, _nested_lists(512 << 10), d)),
    "length-2**63": _rewrite_first_shard(lambda h, d, p: _write_shard(p, h, d, length=2 ** 63)),
    "length-past-the-file": _rewrite_first_shard(lambda h, d, p: _write_shard(p, h, d, length=len(d) + 4096)),
    "length-zero": _rewrite_first_shard(lambda h, d, p: _write_shard(p, b"", d, length=0)),
    "not-json": _rewrite_first_shard(lambda h, d, p: _write_shard(p, b"{" * 1000, d)),
    "overlapping-offsets": _rewrite_first_shard(_overlap),
    "gapped-offsets": _rewrite_first_shard(_gap),
    "offsets-past-the-end": _rewrite_first_shard(_past_end),
    "unknown-dtype": _rewrite_first_shard(lambda h, d, p: (_entries(h)[0][1].update(dtype="X64"), _write_shard(p, h, d))),
    "extra-entry": _rewrite_first_shard(lambda h, d, p: (h.update(stray={"dtype": "U8", "shape": [0],
                                                                          "data_offsets": [len(d), len(d)]}),
                                                          _write_shard(p, h, d))),
    "many-shards": _many_shards,
}


@pytest.mark.parametrize("name", sorted(HEADER_BOMBS))
def test_header_bombs_are_refused_by_every_command(clean_store, tmp_path, name, monkeypatch):
    """Each crafted shard header is refused before it costs memory, with exit 2 naming the shard
    (or the bound), by inspect, replay, migrate and gen-tests; the many-shards case lowers the
    shard bound to the store's own count so that it need not write 65537 files."""
    import resource

    import tapml.carving.store as store_module
    scene = hostile(clean_store, tmp_path, name, {name: (HEADER_BOMBS[name], "")})
    if name == "many-shards":
        monkeypatch.setattr(store_module, "MAX_SHARDS", 4)
    scene["expected"] = "more than the 4 tapml reads" if name == "many-shards" else "shards/tensors-00000.safetensors"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store = scene["store"]
    assert_refused(tapml("inspect", store), scene)
    assert_refused(tapml("replay", store, "--target", "reference", "--json", tmp_path / "out.json"), scene)
    assert_refused(tapml("migrate", store, "--target", "reference", "--state", tmp_path / "state.json"), scene)
    assert_refused(tapml("gen-tests", store, "-o", tmp_path / "suite"), scene)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 << 10  # KiB: no blow-up
    assert_untouched(scene, tmp_path)


def test_all_shard_headers_together_are_bounded(clean_store, tmp_path, monkeypatch):
    import tapml.carving.store as store_module
    from tapml.carving import CarveStore
    from tapml.errors import TapmlError
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    monkeypatch.setattr(store_module, "MAX_STORE_HEADER_BYTES", store_module.HEADER_RESERVE - 1)
    with pytest.raises(TapmlError, match="shard headers of .* pass 0 MiB in all"):
        CarveStore(store)


# --- files that are not what they say: links, FIFOs, devices, folders, huge files ----------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("part", ["manifest", "shard"])
def test_store_files_that_are_not_regular_files_are_refused(clean_store, tmp_path, part, kind):
    store, outside = tmp_path / "store", tmp_path / "outside"
    shutil.copytree(clean_store, store)
    outside.mkdir()
    manifest = json.loads((store / "manifest.json").read_text())
    target = store / ("manifest.json" if part == "manifest" else _first_shard(manifest))
    make_kind(target, kind, outside, valid=clean_store / target.relative_to(store))
    with no_hang():
        results = [(args[0], tapml(*args)) for args in (["inspect", store], ["replay", store, "--json", tmp_path / "v.json"],
                                                    ["migrate", store, "--state", tmp_path / "s.json"],
                                                    ["gen-tests", store, "-o", tmp_path / "suite"])]
    for command, r in results:
        assert r.exit_code == 2 and "Traceback" not in r.output, (command, r.output)
        assert target.name in " ".join(r.output.split()), (command, r.output)
    assert not (tmp_path / "v.json").exists() and not (tmp_path / "s.json").exists()


def test_a_shard_link_inside_the_store_is_copied_as_a_real_file_by_gen_tests(clean_store, tmp_path):
    """A shard named through a folder link inside the store: the store reads it (it resolves
    inside), and `gen-tests --copy-data` writes real folders and files under data/, not a link
    and not a crash."""
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    (store / "via").symlink_to("shards", target_is_directory=True)
    m = json.loads((store / "manifest.json").read_text())
    for info in m["tensors"].values():
        if "shard" in info:
            info["shard"] = "via/" + info["shard"].split("/", 1)[1]
    (store / "manifest.json").write_text(json.dumps(m))
    r = tapml("gen-tests", store, "-o", tmp_path / "suite", "--copy-data")
    assert r.exit_code == 0, r.output
    copied = tmp_path / "suite" / "data" / "via"
    assert copied.is_dir() and not copied.is_symlink()
    assert all(p.is_file() and not p.is_symlink() for p in copied.iterdir())
    from tapml.carving import CarveStore
    assert len(CarveStore(tmp_path / "suite" / "data").cases) == len(m["cases"])


def test_the_audits_header_bomb_costs_inspect_no_memory(clean_store, tmp_path):
    """The audit's archive: three shards whose headers are 32 MiB of nested empty lists each
    (the audit's were 95 MiB, and drove `tapml inspect` to 5.6 GiB and a MemoryError). A real
    `tapml inspect` process refuses it with exit 2, its peak memory that of a bare start."""
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    m = json.loads((store / "manifest.json").read_text())
    stored = [info for info in m["tensors"].values() if "shard" in info]
    bomb = _nested_lists(32 << 20)
    for i in range(3):
        _write_shard(store / f"shards/bomb-{i}.safetensors", bomb, b"")
    for i, info in enumerate(stored):
        info["shard"] = f"shards/bomb-{i % 3}.safetensors"
    (store / "manifest.json").write_text(json.dumps(m))
    del bomb
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    # the peak of the tapml process's own memory (VmHWM; ru_maxrss would count this process's,
    # inherited through fork and exec)
    measured = ("import re, runpy, sys\nsys.argv = ['tapml', 'inspect', sys.argv[1]]\ntry:\n"
                "    runpy.run_module('tapml.cli', run_name='__main__')\nexcept SystemExit:\n"
                "    kib = re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)\n"
                "    print('peak', int(kib) >> 10, file=sys.stderr)\n"
                "    raise\n")
    r = subprocess.run([sys.executable, "-c", measured, str(store)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 2 and "bomb-0.safetensors" in r.stderr and "header" in r.stderr, r.stderr
    peak_mib = int(re.search(r"peak (\d+)", r.stderr).group(1))
    assert peak_mib < 600, peak_mib  # torch's import and the store (about 240 MiB); not the headers
