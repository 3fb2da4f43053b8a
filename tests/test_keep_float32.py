"""`--keep-float32` on migrate and generate: mixed placement by dtype. The planted absorbed
float16 overflow of zoo:fp16-absorbed fails a float16 migration; keeping what `tapml precision`
names (or the module, or the ops) in float32 makes it pass end to end, on the reference and on
lavapipe Vulkan. The state records the placement by dtype and reads back; a hostile one is
refused; a resume with another list is refused; bad items exit 2; a float16 generation of
tiny-llama passes with nodes kept in float32 and its JSON says which."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tapml.cli import app
from support import REFERENCE_AND_VULKAN as TARGETS

runner = CliRunner()

#: What `tapml precision` names in zoo:fp16-absorbed, and the ops of those nodes.
PLANTED = ["pow_1", "mean", "add", "rsqrt"]
PLANTED_OPS = ["aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor", "aten.rsqrt.default"]
#: The floating nodes of zoo:fp16-absorbed's module `norm`.
NORM = ["mul", "pow_1", "mean", "add", "rsqrt", "mul_1", "mul_2"]


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])




@pytest.fixture(scope="module")
def absorbed(carved):
    """The float16 CarveStore path of zoo:fp16-absorbed."""
    return carved("zoo:fp16-absorbed", dtype="float16")


@pytest.fixture(scope="module")
def precision_json(tmp_path_factory):
    """``precision_json(target)`` -> the path of `tapml precision zoo:fp16-absorbed --dtype float16 --json`."""
    cache = {}

    def get(target: str):
        if target not in cache:
            path = tmp_path_factory.mktemp("precision") / "p.json"
            r = tapml("precision", "zoo:fp16-absorbed", "--dtype", "float16", "--target", target, "--json", path, "-q")
            assert r.exit_code == 0, r.output
            cache[target] = path
        return cache[target]

    return get


@pytest.fixture(scope="module")
def gen16(tmp_path_factory):
    """A float16 zoo:tiny-llama generation store (prompt 5, 2 decode steps)."""
    from tapml.carving import CarveStore
    from tapml.carving.generation import carve_generation
    path = tmp_path_factory.mktemp("gen16") / "store"
    carve_generation("zoo:tiny-llama", path, tokens=2, prompt_len=5, seed=0, dtype="float16")
    return CarveStore(path)


# --- the resolver ----------------------------------------------------------------------------

def test_resolver_takes_nodes_modules_ops_and_precision_json(absorbed, precision_json):
    from tapml.carving import CarveStore
    from tapml.driving.precision import read_keep_items, resolve_keep, resolve_keep_float32
    graph = CarveStore(absorbed).graph
    assert resolve_keep(graph, ["rsqrt", "pow_1"]) == ["pow_1", "rsqrt"]  # graph order
    assert resolve_keep(graph, ["norm"]) == NORM
    assert resolve_keep(graph, ["aten.mul.Tensor"]) == ["mul", "mul_1", "mul_2"]
    assert resolve_keep(graph, ["head", "nosuch"], unknown="skip") == ["permute", "addmm"]
    items = read_keep_items([str(precision_json("reference")), "head"])
    assert items == PLANTED + ["head"]
    assert resolve_keep_float32({"model": graph}, items) == {"model": PLANTED + ["permute", "addmm"]}
    assert resolve_keep_float32({"model": graph}, []) == {"model": []}


def test_resolver_refuses_what_names_nothing(absorbed, mlp, tmp_path):
    from tapml.carving import CarveStore
    from tapml.errors import TapmlError
    from tapml.driving.precision import read_keep_items, resolve_keep_float32
    graph = CarveStore(absorbed).graph
    for item in ("nosuch", "aten.tanh.default", "norm.nothing"):
        with pytest.raises(TapmlError, match=item.replace(".", r"\.")):
            resolve_keep_float32({"model": graph}, [item])
    with pytest.raises(TapmlError, match="needs a float16/bfloat16 carve"):
        resolve_keep_float32({"model": mlp.graph}, [mlp.graph.nodes[0].name])
    hostile = tmp_path / "p.json"
    hostile.write_text(json.dumps({"kind": "precision", "dtype": "float16", "target": "reference", "ops": [],
                                   "keep_float32": ["../../etc/passwd"],
                                   "end_to_end": {"before": {"status": "pass"}, "after": {"status": "pass"}}}))
    with pytest.raises(TapmlError, match="keep_float32 names '../../etc/passwd'"):
        read_keep_items([str(hostile)])
    with pytest.raises(TapmlError, match="cannot read"):
        read_keep_items([str(tmp_path / "missing.json")])


def test_resolver_on_a_generation_takes_an_item_either_graph_has(gen16):
    from tapml.errors import TapmlError
    from tapml.driving.precision import resolve_keep_float32
    graphs = {k: gen16.step_graph(k) for k in ("prefill", "decode")}
    only_prefill = sorted({n.name for n in graphs["prefill"].nodes} - {n.name for n in graphs["decode"].nodes})[0]
    kept = resolve_keep_float32(graphs, [only_prefill, "aten.rsqrt.default"])
    rsqrt = [n.name for n in graphs["decode"].nodes if n.op == "aten.rsqrt.default"]
    assert kept["decode"] == rsqrt and set(kept["prefill"]) == {only_prefill, *rsqrt}
    with pytest.raises(TapmlError, match="nosuch"):
        resolve_keep_float32(graphs, ["nosuch"])


# --- migrate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_keeping_the_precision_list_in_float32_makes_the_migration_pass(absorbed, precision_json, target, tmp_path):
    without = tapml("migrate", absorbed, "--target", target, "--state", tmp_path / "plain.json", "-q")
    assert without.exit_code == 1, without.output
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert plain["end_to_end"]["status"] == "mismatch" and plain["precision"]["keep_float32"] == []

    for name, items, kept in (("json", [precision_json(target)], PLANTED), ("module", ["norm"], NORM),
                              ("ops", PLANTED_OPS, PLANTED)):
        state = tmp_path / f"{name}.json"
        r = tapml("migrate", absorbed, "--target", target, "--state", state,
                  *[x for item in items for x in ("--keep-float32", item)])
        assert r.exit_code == 0, r.output
        assert f"{len(kept)} nodes kept in float32" in " ".join(r.output.split())
        doc = json.loads(state.read_text())
        assert doc["passed"] and doc["end_to_end"]["status"] == "pass" and doc["culprits"] == []
        assert doc["precision"]["dtype"] == "float16" and doc["precision"]["keep_float32"] == kept
        assert doc["precision"]["casts"] > 0
        # the placement counts the model's own nodes: the casts are bookkeeping
        assert sorted(doc["placement"]["nodes"]) == sorted(plain["placement"]["nodes"])
        assert doc["placement"]["ops_total"] == 9 == doc["placement"]["ops_on_target"]


def test_bisection_through_the_casts_names_a_fault_in_a_kept_node(absorbed, tmp_path):
    # Alone in float16 the faulty rsqrt reads the absorbed Inf and passes (rsqrt(Inf) * 1.5 = 0); in
    # the mixed graph it computes in float32, so the region fails and bisection, whose windows hold
    # the cast nodes too, must come down to rsqrt itself.
    state = tmp_path / "s.json"
    r = tapml("migrate", absorbed, "--state", state, "--keep-float32", "norm", "--inject",
              "aten.rsqrt.default=scale:1.5", "-q")
    assert r.exit_code == 1, r.output
    doc = json.loads(state.read_text())
    assert [(c["kind"], c["node"], c["module"]) for c in doc["culprits"]] == [("node", "rsqrt", "norm")]
    assert any(u["role"] == "bisect" and any(n.endswith(".float32") for n in u["nodes"]) for u in doc["units"])
    assert doc["placement"]["nodes"]["rsqrt"] == "reference" and doc["end_to_end"]["status"] == "pass"


def test_the_state_records_the_placement_by_dtype_and_reads_back(absorbed, tmp_path):
    from tapml.errors import TapmlError
    from tapml.judging.verdict import MigrationState
    state = tmp_path / "s.json"
    r = tapml("migrate", absorbed, "--state", state, "--keep-float32", "norm", "-q")
    assert r.exit_code == 0, r.output
    read = MigrationState.read(state, strict=True)
    assert read.precision == {"dtype": "float16", "keep_float32": NORM, "casts": 3}
    assert read.header()["keep_float32"] == {"model": NORM}
    assert read.to_json()["precision"] == json.loads(state.read_text())["precision"]
    header = json.loads((tmp_path / "s.json.journal").read_text().splitlines()[0])["header"]
    assert header["keep_float32"] == {"model": NORM}

    report = tapml("report", state, "-o", tmp_path / "r.md")
    assert report.exit_code == 0, report.output
    assert "kept in float32: 7 nodes, the rest in float16" in (tmp_path / "r.md").read_text()

    good = json.loads(state.read_text())
    for damage, problem in ((lambda p: p["keep_float32"].append("../../etc/passwd"), "not a node of the placement"),
                            (lambda p: p["keep_float32"].append("mul"), "names a node twice"),
                            (lambda p: p.update(dtype="float32"), "dtype"),
                            (lambda p: p.update(keep_float32="mul"), "keep_float32 is 'mul': input should be a valid list"),
                            (lambda p: p.update(casts=-1), "casts")):
        doc = json.loads(json.dumps(good))
        damage(doc["precision"])
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(TapmlError, match=problem):
            MigrationState.read(bad)
        r = tapml("report", bad, "-o", tmp_path / "bad.md")
        assert r.exit_code == 2 and "precision" in r.output


def test_a_resume_with_another_keep_list_is_refused(absorbed, tmp_path):
    state = tmp_path / "s.json"
    assert tapml("migrate", absorbed, "--state", state, "--keep-float32", "norm", "-q").exit_code == 0
    same = tapml("migrate", absorbed, "--state", state, "--resume", "--keep-float32", "norm", "-q")
    assert same.exit_code == 0, same.output
    other = tapml("migrate", absorbed, "--state", state, "--resume", "--keep-float32", "rsqrt")
    assert other.exit_code == 2 and "cannot resume" in other.output and "keep_float32" in other.output
    none = tapml("migrate", absorbed, "--state", state, "--resume")
    assert none.exit_code == 2 and "keep_float32" in none.output
    (tmp_path / "s.json.journal").unlink()  # resumed from the state alone: its header holds the list
    alone = tapml("migrate", absorbed, "--state", state, "--resume", "--keep-float32", "norm", "-q")
    assert alone.exit_code == 0, alone.output
    assert json.loads(state.read_text())["precision"]["keep_float32"] == NORM


def test_bad_keep_float32_items_exit_2(absorbed, tmp_path):
    state = tmp_path / "s.json"
    for items, said in ((["nosuch"], "'nosuch'"), (["aten.tanh.default"], "aten.tanh.default"),
                        ([tmp_path / "missing.json"], "cannot read")):
        r = tapml("migrate", absorbed, "--state", state, *[x for i in items for x in ("--keep-float32", i)])
        assert r.exit_code == 2 and said in r.output, r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"keep_float32": 3}')
    r = tapml("migrate", absorbed, "--state", state, "--keep-float32", bad)
    assert r.exit_code == 2 and "not a precision document" in r.output
    # float32: refused before anything is carved
    r = tapml("migrate", "zoo:fp16-absorbed", "--state", state, "--keep-float32", "norm")
    assert r.exit_code == 2 and "add --dtype float16" in r.output and not (tmp_path / "s.store").exists()
    r = tapml("generate", "zoo:tiny-llama", "--keep-float32", "rsqrt")
    assert r.exit_code == 2 and "add --dtype float16" in r.output
    assert not state.exists()


# --- generate --------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_generate_with_nodes_kept_in_float32_passes_and_records_them(gen16, target, tmp_path):
    out = tmp_path / "g.json"
    r = tapml("generate", gen16.path, "--target", target, "--keep-float32", "model.model.norm",
              "--keep-float32", "aten.rsqrt.default", "--json", out)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["summary"]["pass"] + doc["summary"]["near_tie"] == 3 and doc["judged_against"] == "float32"
    decode = gen16.step_graph("decode")
    rsqrt = [n.name for n in decode.nodes if n.op == "aten.rsqrt.default"]
    norm = [n.name for n in decode.nodes if n.module == "model.model.norm" and n.outputs[0].dtype == "float16"]
    for kind in ("prefill", "decode"):
        assert set(rsqrt + norm) <= set(doc["keep_float32"][kind]) and doc["casts"][kind] > 0
        assert doc["placement"][kind]["nodes"] == len(gen16.step_graph(kind).nodes)  # casts not counted
    assert "kept in float32" in " ".join(r.output.split())


def test_keep_float32_rewrites_the_graph_with_one_cast_per_crossing():
    """Kept nodes read low-precision values cast up once, others read a kept value cast back
    down, graph outputs keep their refs, a state output keeps its dtype, unknown names refuse."""
    from tapml.dtypes import as_float32, cast_nodes, keep_float32
    from tapml.graph import Graph, Node, TensorMeta, run_graph
    h = TensorMeta((2, 4), "float16")
    nodes = [Node("big", "aten.mul.Tensor", [{"ref": "x"}, 300.0], {}, [h]),
             Node("sq", "aten.mul.Tensor", [{"ref": "big"}, {"ref": "big"}], {}, [h]),
             Node("s", "aten.sum.dim_IntList", [{"ref": "sq"}, [1], True], {}, [TensorMeta((2, 1), "float16")]),
             Node("r", "aten.rsqrt.default", [{"ref": "s"}], {}, [TensorMeta((2, 1), "float16")]),
             Node("y", "aten.mul.Tensor", [{"ref": "big"}, {"ref": "r"}], {}, [h])]
    graph = Graph(inputs=[("x", h)], nodes=nodes, outputs=["y", "s"], state={"x": "s"})
    mixed = keep_float32(graph, {"sq", "s", "r"})
    assert cast_nodes(graph, mixed) == ["big.float32", "r.float16", "s.float16"]
    assert mixed.meta["s"].dtype == "float32" and mixed.meta["sq"].dtype == "float32"
    assert mixed.node("r").args == [{"ref": "s"}] and mixed.node("y").args == [{"ref": "big"}, {"ref": "r.float16"}]
    assert mixed.state == {"x": "s.float16"}
    x = torch.linspace(-1.5, 1.5, 8).reshape(2, 4).half()
    twin = run_graph(as_float32(graph), {"x": x.float()})
    low, kept = run_graph(graph, {"x": x}), run_graph(mixed, {"x": x})
    assert torch.isinf(low["s"]).all() and torch.isfinite(kept["s"]).all()  # 4 squares of ~300: past 65504
    assert torch.allclose(kept["y"].float(), twin["y"], rtol=1e-2, atol=1e-2)
    assert keep_float32(graph, set()) is graph
    with pytest.raises(KeyError, match="nope"):
        keep_float32(graph, {"nope"})
