"""`tapml precision`: the zoo's planted float16 overflows are found on the reference and on
lavapipe Vulkan (shader-f16): exactly the planted ops must stay in float32, overflows and
absorbed overflows are flagged on the right nodes, the model fails end to end in float16 and
passes with the list applied. The document validates with its typed reader, renders as HTML
(table and SVG plot) and Markdown, and a hostile one exits 2."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from tapml.cli import app
from support import REFERENCE_AND_VULKAN as TARGETS

runner = CliRunner()

#: The planted ops of each zoo model, in graph order: (op, module).
PLANTED = {
    "fp16-overflow": [("aten.pow.Tensor_Scalar", "energy"), ("aten.sum.dim_IntList", "energy"),
                      ("aten.mul.Tensor", "energy")],
    "fp16-absorbed": [("aten.pow.Tensor_Scalar", "norm"), ("aten.mean.dim", "norm"), ("aten.add.Tensor", "norm"),
                      ("aten.rsqrt.default", "norm")],
}


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])




@pytest.fixture(scope="module")
def analysis(carved):
    """``analysis(model, target)`` -> (store, precision document), computed once per module."""
    from tapml.carving import CarveStore
    from tapml.driving.precision import analyze
    from tapml.driving.replay import device_info
    from tapml.driving.targets import open_target
    cache = {}

    def get(model: str, target: str):
        if (model, target) not in cache:
            store = CarveStore(carved(f"zoo:{model}", dtype="float16"))
            with open_target(target) as platform:
                cache[model, target] = store, analyze(store, platform, target, device=device_info(platform))
        return cache[model, target]

    return get


def _by_node(doc):
    return {x["node"]: x for x in doc["ops"]}


@pytest.mark.parametrize("target", TARGETS)
def test_planted_overflow_reaches_the_output_and_keep_float32_names_exactly_it(analysis, target):
    store, doc = analysis("fp16-overflow", target)
    ops = _by_node(doc)
    assert doc["dtype"] == "float16" and doc["target"] == target
    assert [(ops[k]["op"], ops[k]["module"]) for k in doc["keep_float32"]] == PLANTED["fp16-overflow"]
    # the planted ops and the model output they feed overflow; nothing hides it
    overflowed = [x["node"] for x in doc["ops"] if x["overflow"]]
    assert overflowed == doc["keep_float32"] + [store.graph.outputs[0]]
    assert not any(x["absorbed"] for x in doc["ops"])
    for k in doc["keep_float32"][:2]:  # the squares and their sum do not fit float16
        assert ops[k]["headroom"] < 1 and ops[k]["max_abs"] > 65504 and ops[k]["err_vs_fp64"] is None
    fits = [x for x in doc["ops"] if not x["overflow"]]
    assert fits and all(x["headroom"] > 1 and x["err_vs_fp64"] is not None for x in fits)
    before, after = doc["end_to_end"]["before"], doc["end_to_end"]["after"]
    assert before["status"] == "mismatch" and "NaN/Inf differ" in before["message"]
    assert after["status"] == "pass" and after["max_abs_err"] is not None


@pytest.mark.parametrize("target", TARGETS)
def test_absorbed_overflow_is_flagged_where_the_module_output_stays_finite(analysis, target):
    store, doc = analysis("fp16-absorbed", target)
    ops = _by_node(doc)
    assert [(ops[k]["op"], ops[k]["module"]) for k in doc["keep_float32"]] == PLANTED["fp16-absorbed"]
    flagged = [(x["op"], x["overflow"], x["absorbed"]) for x in doc["ops"] if x["overflow"] or x["absorbed"]]
    # rsqrt turns the Inf into 0: pow, mean and add overflow and their module hands on finite values
    assert flagged == [(op, True, True) for op, _ in PLANTED["fp16-absorbed"][:3]]
    rsqrt = ops[doc["keep_float32"][-1]]
    assert not rsqrt["overflow"] and rsqrt["headroom"] > 1  # kept because its input cannot be held
    before, after = doc["end_to_end"]["before"], doc["end_to_end"]["after"]
    assert before["status"] == "mismatch" and before["max_abs_err"] > 0.1  # finite and wrong
    assert after["status"] == "pass"


def test_the_document_validates_with_its_reader_and_keep_float32_runs(analysis):
    from tapml.dtypes import keep_float32
    from tapml.driving.precision import resolve_keep
    from tapml.judging.verdict import read_precision_document
    store, doc = analysis("fp16-absorbed", "reference")
    read = read_precision_document(json.loads(json.dumps(doc, allow_nan=False)), "doc.json")
    assert read["ops"] == [{k: x[k] for k in read["ops"][0]} for x in doc["ops"]]
    assert read["keep_float32"] == doc["keep_float32"] and read["end_to_end"] == doc["end_to_end"]
    mixed = keep_float32(store.graph, read["keep_float32"], "float16")
    assert {n.name: n.outputs[0].dtype for n in mixed.nodes if n.name in read["keep_float32"]} == \
        dict.fromkeys(read["keep_float32"], "float32")
    assert resolve_keep(store.graph, ["head"]) == [n.name for n in store.graph.nodes if n.module == "head"]


def test_cli_writes_the_document_and_exits_0_when_the_list_fixes_the_model(tmp_path):
    from tapml.judging.verdict import read_precision_document
    r = tapml("precision", "zoo:fp16-overflow", "--json", tmp_path / "p.json", "--store", tmp_path / "store")
    assert r.exit_code == 0, r.output
    assert "keep_float32 (3)" in r.output and "energy" in r.output and "mismatch" in r.output
    doc = read_precision_document(json.loads((tmp_path / "p.json").read_text()), "p.json")
    assert len(doc["keep_float32"]) == 3 and doc["end_to_end"]["after"]["status"] == "pass"
    again = tapml("precision", tmp_path / "store", "-q")  # the store it kept, analyzed as it is
    assert again.exit_code == 0, again.output


def test_cli_refuses_a_float32_store_and_a_float32_dtype(carved):
    r = tapml("precision", carved("zoo:mlp"))
    assert r.exit_code == 2 and "needs a float16/bfloat16 carve" in r.output
    r = tapml("precision", "zoo:mlp", "--dtype", "float32")
    assert r.exit_code == 2 and "--dtype float32" in r.output
    r = tapml("precision", carved("zoo:fp16-absorbed", dtype="float16"), "--dtype", "bfloat16")
    assert r.exit_code == 2 and "float16" in r.output


def test_report_renders_the_table_and_the_plot(analysis, tmp_path):
    _, doc = analysis("fp16-absorbed", "reference")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    r = tapml("report", path, "-o", tmp_path / "p.html")
    assert r.exit_code == 0, r.output
    html = (tmp_path / "p.html").read_text()
    assert "precision-plot" in html and "<svg" in html and "float16 max" in html
    assert 'id="precision-modules-s0"' in html and 'id="precision-ops-s0"' in html
    for k in doc["keep_float32"]:
        assert f'<span class="chip mono">{k}</span>' in html
    md = tapml("report", path, "-f", "md")
    assert md.exit_code == 0
    assert "| depth | module | ops | max abs | headroom |" in md.output and "`norm`" in md.output
    terminal = tapml("report", path)
    assert terminal.exit_code == 0 and "keep_float32 (4)" in terminal.output


def _hostile(doc):
    """(what is wrong, a damaged copy of doc) pairs."""
    def damaged(fn):
        d = copy.deepcopy(doc)
        fn(d)
        return d
    return [
        ("format_version", damaged(lambda d: d.update(format_version=99))),
        ("ops", damaged(lambda d: d.update(ops={"a": 1}))),
        ("op", damaged(lambda d: d["ops"][0].update(op="os.system"))),
        ("headroom", damaged(lambda d: d["ops"][0].update(headroom=-1))),
        ("max_abs", damaged(lambda d: d["ops"][0].update(max_abs="big"))),
        ("absorbed", damaged(lambda d: d["ops"][0].update(absorbed=True, overflow=False))),
        ("node", damaged(lambda d: d["ops"][1].update(node=d["ops"][0]["node"]))),
        ("keep_float32", damaged(lambda d: d["keep_float32"].append("../../etc/passwd"))),
        ("status", damaged(lambda d: d["end_to_end"]["after"].update(status="fine"))),
        ("dtype", damaged(lambda d: d.update(dtype="float32"))),
        ("end_to_end", damaged(lambda d: d.pop("end_to_end"))),
    ]


def test_a_hostile_precision_document_exits_2_naming_the_field(analysis, tmp_path):
    _, doc = analysis("fp16-overflow", "reference")
    for field, bad in _hostile(doc):
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps(bad))
        r = tapml("report", path, "-o", tmp_path / f"{field}.html")
        assert r.exit_code == 2, (field, r.output)
        assert field in r.output and "tapml precision --json" in r.output, (field, r.output)
        assert not (tmp_path / f"{field}.html").exists()


@pytest.mark.parametrize("command", ["precision", "generate"])
def test_a_carve_that_fails_leaves_no_temporary_store(tmp_path, monkeypatch, command):
    """MODEL is carved into a temporary folder first; a carve that fails removes it too."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = tapml(command, "zoo:no-such-model" if command == "precision" else "zoo:mlp", "-q")
    assert r.exit_code == 2, r.output
    assert list(tmp_path.iterdir()) == []
