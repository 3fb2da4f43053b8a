"""The cross-target matrix: `replay`/`migrate` with several --target, its JSON document, its
terminal table, and `report` of a multi-target document.

Fast tier: ordering and cells of :func:`coverage_matrix` on made-up verdicts, the document's
round trip and refusals, the CLI on two reference targets. Device tier: zoo:mlp on the
reference, lavapipe Vulkan and llvmpipe OpenGL, clean and with a fault in every device target.
Browser tier: wgpu:vulkan beside WebGPU in headless Chromium.
"""

from __future__ import annotations

import json
import re

import pytest

from support import in_chromium
from rich.console import Console
from typer.testing import CliRunner

from tapml.cli import app
from tapml.errors import TapmlError
from tapml.render import render_matrix
from tapml.reports.data import coverage_matrix, matrix_document, parse_matrix_document, parse_state


def tapml(*args):
    """Run ``tapml ARGS`` in this process."""
    return CliRunner().invoke(app, [str(a) for a in args])


def case(id, op, status="pass", err=0.0):
    return {"id": id, "op": op, "node": f"n_{id}", "module": "m", "instances": 1, "status": status,
            "max_abs_err": None if status in ("error", "unsupported") else err, "max_rel_err": None,
            "mismatch_fraction": None, "message": "" if status == "pass" else status, "time_ms": 0.1, "worst": []}


def doc(target, cases, adapter="gpu"):
    return {"format_version": 1, "target": target, "model": "zoo:made-up", "tolerances": {},
            "device": {"adapter": adapter, "backend": target.split(":")[-1], "features": [], "limits": {}},
            "cases": cases}


# Made-up verdicts on three targets: which op fails where is chosen to hit every row group.
MADE_UP = {
    "reference": doc("reference", [case("c0", "aten.add.Tensor"), case("c1", "aten.mul.Tensor"),
                                   case("c2", "aten.tanh.default"), case("c3", "aten.exp.default"),
                                   case("c4", "aten.exp.default"), case("c5", "aten.gelu.default", "mismatch", 0.5),
                                   case("c6", "aten.sin.default")], adapter="cpu"),
    "wgpu:vulkan": doc("wgpu:vulkan", [case("c0", "aten.add.Tensor"), case("c1", "aten.mul.Tensor", "mismatch", 0.25),
                                       case("c2", "aten.tanh.default", "error"), case("c3", "aten.exp.default", "mismatch", 2.0),
                                       case("c4", "aten.exp.default"), case("c5", "aten.gelu.default", "mismatch", 0.75),
                                       case("c6", "aten.sin.default", "unsupported")], adapter="llvmpipe"),
    "wgpu:gl": doc("wgpu:gl", [case("c0", "aten.add.Tensor"), case("c1", "aten.mul.Tensor", "mismatch", 0.125),
                               case("c2", "aten.tanh.default", "error"), case("c3", "aten.exp.default"),
                               case("c4", "aten.exp.default", "mismatch", 3.0), case("c5", "aten.gelu.default", "error"),
                               case("c6", "aten.sin.default", "unsupported")], adapter="llvmpipe gl"),
}


def made_up_states():
    return [parse_state(d, t) for t, d in MADE_UP.items()]


def test_rows_that_differ_between_targets_come_first_then_failing_then_passing():
    m = coverage_matrix(made_up_states())
    assert [(r["op"], r["group"]) for r in m["rows"]] == [
        ("aten.tanh.default", "differs"),   # error on both devices, pass on the reference
        ("aten.exp.default", "differs"),    # each device fails a different case of it
        ("aten.mul.Tensor", "differs"),
        ("aten.sin.default", "differs"),    # unsupported is not a pass
        ("aten.gelu.default", "fails"),     # fails on every target, the reference included
        ("aten.add.Tensor", "passes"),
    ]
    assert m["groups"] == {"differs": 4, "fails": 1, "passes": 1}
    assert m["labels"] == ["reference", "wgpu:vulkan", "wgpu:gl"]
    assert [c["adapter"] for c in m["columns"]] == ["cpu", "llvmpipe", "llvmpipe gl"]
    exp = next(r for r in m["rows"] if r["op"] == "aten.exp.default")
    assert exp["cells"] == [{"status": "pass", "max_abs_err": 0.0, "pass": 2, "total": 2},
                            {"status": "mismatch", "max_abs_err": 2.0, "pass": 1, "total": 2},
                            {"status": "mismatch", "max_abs_err": 3.0, "pass": 1, "total": 2}]
    gelu = next(r for r in m["rows"] if r["op"] == "aten.gelu.default")
    assert [c["status"] for c in gelu["cells"]] == ["mismatch", "mismatch", "error"]  # worst status of the cell
    assert m["totals"] == [{"pass": 5, "total": 6}, {"pass": 1, "total": 6}, {"pass": 1, "total": 6}]


def test_rows_per_case_name_their_case_and_a_target_without_the_op_is_not_run():
    states = made_up_states()
    m = coverage_matrix(states, by_case=True)
    assert len(m["rows"]) == 7 and all("case" in r for r in m["rows"])
    exp = {r["case"]: r["group"] for r in m["rows"] if r["op"] == "aten.exp.default"}
    assert exp == {"c3": "differs", "c4": "differs"}
    assert m["rows"][-1] == {"op": "aten.add.Tensor", "case": "c0", "group": "passes",
                             "cells": [{"status": "pass", "max_abs_err": 0.0, "pass": 1, "total": 1}] * 3}
    only_sin = parse_state(doc("wgpu:metal", [case("c6", "aten.sin.default")]), "metal")
    m = coverage_matrix([states[0], only_sin])
    add = next(r for r in m["rows"] if r["op"] == "aten.add.Tensor")
    assert add["cells"][1] is None and add["group"] == "passes"
    sin = next(r for r in m["rows"] if r["op"] == "aten.sin.default")
    assert sin["group"] == "passes" and m["totals"][1] == {"pass": 1, "total": 1}


def test_document_keeps_each_verdict_unchanged_and_reads_back():
    verdicts = {**MADE_UP, "wgpu:gl": doc("wgpu:gl", [case("c0", "aten.add.Tensor", "mismatch")])}
    verdicts["wgpu:gl"]["cases"][0]["max_abs_err"] = None  # NaN on the device: no finite error
    document = matrix_document(verdicts)
    text = json.dumps(document, allow_nan=False)  # strict JSON
    assert document["targets"] == list(verdicts) and document["verdicts"] == verdicts
    add = next(r for r in document["matrix"]["rows"] if r["op"] == "aten.add.Tensor")
    assert add["group"] == "differs" and add["cells"][2] == {"status": "mismatch", "max_abs_err": None, "pass": 0, "total": 1}
    assert set(document["matrix"]) == {"columns", "rows"}
    states = parse_matrix_document(json.loads(text), "m.json")
    assert [s.target for s in states] == list(verdicts) and all(s.path == "m.json" for s in states)
    assert coverage_matrix(states)["rows"][0]["op"] == document["matrix"]["rows"][0]["op"]


@pytest.mark.parametrize("change, problem", [
    (lambda d: d.update(targets=["reference"]), "one entry per target"),
    (lambda d: d.update(targets=["reference", "reference", "wgpu:gl"]), "appears twice"),
    (lambda d: d.update(targets="reference"), "targets is 'reference': input should be a valid list"),
    (lambda d: d["verdicts"].update({"wgpu:gl": MADE_UP["reference"]}), "holds the verdicts of target 'reference'"),
    (lambda d: d.update(matrix=[1, 2]), "matrix is [1, 2]: input should be a valid dictionary"),
    (lambda d: d.update(format_version=99), "newer than this tapml reads"),
    (lambda d: d["verdicts"]["wgpu:gl"]["cases"][0].update(status="great"), "status is 'great'"),
])
def test_a_malformed_document_is_refused_naming_the_field(tmp_path, change, problem):
    data = json.loads(json.dumps({"format_version": 1, "targets": ["reference", "wgpu:gl"],
                                  "verdicts": {t: MADE_UP[t] for t in ("reference", "wgpu:gl")}, "matrix": {}}))
    change(data)
    with pytest.raises(TapmlError, match=re.escape(problem)):
        parse_matrix_document(data, "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps(data))
    r = tapml("report", tmp_path / "bad.json")
    assert r.exit_code == 2 and problem in " ".join(r.output.split()), r.output


def test_the_terminal_table_lists_what_differs_first_and_counts_what_passes():
    console = Console(record=True, width=160, color_system=None)
    render_matrix(coverage_matrix(made_up_states()), console, all_option="--all")
    lines = console.export_text().splitlines()
    assert "4 differ between targets, 1 fail everywhere, 1 pass everywhere" in lines[0]
    assert lines[1:4] == ["  reference: cpu [reference]", "  wgpu:vulkan: llvmpipe [vulkan]", "  wgpu:gl: llvmpipe gl [gl]"]
    order = [next(i for i, line in enumerate(lines) if key in line)
             for key in ("differs between targets", "aten.tanh.default", "fails on every target", "aten.gelu.default")]
    assert order == sorted(order)
    exp = next(line for line in lines if "aten.exp.default" in line)
    assert "pass 2/2" in exp and "mismatch 1/2 2" in exp and "mismatch 1/2 3" in exp
    assert not any("aten.add.Tensor" in line for line in lines)
    assert lines[-1] == "1 ops pass on every target (--all lists them)"
    console = Console(record=True, width=160, color_system=None)
    render_matrix(coverage_matrix(made_up_states()), console, all_rows=True)
    text = console.export_text()
    assert "passes on every target" in text and "aten.add.Tensor" in text and "lists them" not in text


def test_replay_on_two_reference_targets_writes_one_document_and_reads_back(mlp, tmp_path):
    out = tmp_path / "m.json"
    r = tapml("replay", mlp.path, "--target", "reference", "--target", "reference:cpu", "--json", out,
              "--inject", "aten.relu.default=nan")  # faults never go into a reference target
    assert r.exit_code == 0, r.output
    assert "0 differ between targets" in r.output and "reference:cpu: cpu" in r.output
    data = json.loads(out.read_text())
    assert data["targets"] == ["reference", "reference:cpu"] and set(data["verdicts"]) == set(data["targets"])
    assert [c["target"] for c in data["matrix"]["columns"]] == data["targets"]
    assert all(len(row["cells"]) == 2 and row["group"] == "passes" for row in data["matrix"]["rows"])
    assert len(data["matrix"]["rows"]) == len({c["op"] for c in mlp.cases})
    single = tmp_path / "single.json"
    assert tapml("replay", mlp.path, "--target", "reference", "--json", single).exit_code == 0
    assert "format_version" in json.loads(single.read_text()) and "targets" not in json.loads(single.read_text())
    r = tapml("report", out, "-o", tmp_path / "r.html")
    assert r.exit_code == 0, r.output
    html = (tmp_path / "r.html").read_text()
    assert 'id="coverage-table"' in html and html.count('data-group="passes"') == len(data["matrix"]["rows"])


@pytest.mark.parametrize("targets, problem", [
    (["reference", "reference"], "--target reference is given twice"),
    (["reference", "wgpu:nope"], "unknown target 'wgpu:nope'"),
])
def test_bad_target_lists_are_refused_before_anything_runs(mlp, tmp_path, targets, problem):
    args = [a for t in targets for a in ("--target", t)]
    for command in (["replay", mlp.path], ["migrate", mlp.path, "--state", tmp_path / "s.json"]):
        r = tapml(*command, *args)
        assert r.exit_code == 2 and problem in r.output, r.output
    assert not list(tmp_path.iterdir())


def test_migrate_on_several_targets_keeps_a_state_per_target(mlp, tmp_path):
    from tapml.cli.migrate import state_for_target
    assert state_for_target("runs/s.json", "wgpu:vulkan") == "runs/s.wgpu-vulkan.json"
    assert state_for_target("s", "remote://127.0.0.1:18861") == "s.remote-127-0-0-1-18861.json"
    r = tapml("migrate", mlp.path, "--target", "reference", "--target", "reference:cpu", "--state", tmp_path / "s.json",
              "--json", tmp_path / "all.json", "-q")
    assert r.exit_code == 0, r.output
    for name in ("s.reference.json", "s.reference-cpu.json"):
        state = json.loads((tmp_path / name).read_text())
        assert state["passed"] and state["stage"] == "done"
    data = json.loads((tmp_path / "all.json").read_text())
    assert data["verdicts"]["reference:cpu"] == json.loads((tmp_path / "s.reference-cpu.json").read_text())
    r = tapml("report", tmp_path / "s.reference.json", tmp_path / "s.reference-cpu.json")
    assert r.exit_code == 0 and "op coverage" in r.output


# --- device tier ---------------------------------------------------------------------------

def _backends():
    try:
        from tapml.platforms.wgpu_native import available_backends
        return available_backends()
    except Exception:  # noqa: BLE001 - no wgpu at all: the device tier skips with its reason
        return ()


DEVICES = ["wgpu:vulkan", "wgpu:gl"]
needs_devices = pytest.mark.skipif(not {"vulkan", "gl"} <= set(_backends()),
                                   reason="needs wgpu Vulkan and OpenGL adapters (mesa-vulkan-drivers, EGL)")


def _without_times(verdict: dict) -> dict:
    return {**verdict, "cases": [{k: v for k, v in c.items() if k != "time_ms"} for c in verdict["cases"]]}


def _single_replays(store, targets, tmp_path, *extra):
    singles = {}
    for t in targets:
        path = tmp_path / f"single-{t.replace(':', '-')}.json"
        tapml("replay", store, "--target", t, "--json", path, *extra)
        singles[t] = json.loads(path.read_text())
    return singles


@pytest.mark.device
@needs_devices
def test_mlp_on_reference_vulkan_and_gl_passes_with_three_columns(mlp, tmp_path):
    targets = ["reference", *DEVICES]
    r = tapml("replay", mlp.path, *[a for t in targets for a in ("--target", t)], "--json", tmp_path / "m.json")
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "m.json").read_text())
    columns = data["matrix"]["columns"]
    assert [c["target"] for c in columns] == targets
    assert [c["backend"] for c in columns[1:]] == ["vulkan", "gl"] and all(c["adapter"] for c in columns)
    assert all(row["group"] == "passes" and len(row["cells"]) == 3 for row in data["matrix"]["rows"])
    singles = _single_replays(mlp.path, targets, tmp_path)
    for t in targets:
        assert _without_times(data["verdicts"][t]) == _without_times(singles[t])
    lines = r.output.splitlines()
    assert any(line.startswith("  wgpu:vulkan: ") and "[vulkan]" in line for line in lines)
    assert f"{len(data['matrix']['rows'])} ops pass on every target" in r.output


@pytest.mark.device
@needs_devices
def test_a_fault_in_every_device_target_is_the_row_that_differs(mlp, tmp_path):
    targets = ["reference", *DEVICES]
    fault = "aten.relu.default=scale:1.5"
    r = tapml("replay", mlp.path, *[a for t in targets for a in ("--target", t)], "--inject", fault,
              "--by-case", "--json", tmp_path / "m.json")
    assert r.exit_code == 1, r.output
    data = json.loads((tmp_path / "m.json").read_text())
    first, *rest = data["matrix"]["rows"]
    relu = [c["id"] for c in mlp.cases if c["op"] == "aten.relu.default"]
    assert first["op"] == "aten.relu.default" and first["case"] in relu and first["group"] == "differs"
    assert [c["status"] for c in first["cells"]] == ["pass", "mismatch", "mismatch"]
    vulkan_err, gl_err = first["cells"][1]["max_abs_err"], first["cells"][2]["max_abs_err"]
    assert vulkan_err > 0.1 and gl_err == pytest.approx(vulkan_err, rel=1e-3)
    assert all(row["group"] == "passes" for row in rest)
    singles = _single_replays(mlp.path, DEVICES, tmp_path, "--inject", fault)
    for t in DEVICES:
        assert _without_times(data["verdicts"][t]) == _without_times(singles[t])
    assert data["verdicts"]["reference"]["summary"]["mismatch"] == 0
    differs = r.output.index("differs between targets")
    assert differs < r.output.index("aten.relu.default") < r.output.index("cases pass on every target")


# --- browser tier --------------------------------------------------------------------------

@in_chromium
@pytest.mark.skipif("vulkan" not in _backends(), reason="no wgpu Vulkan adapter (mesa-vulkan-drivers)")
def test_vulkan_beside_the_browser(mlp, tmp_path):
    r = tapml("replay", mlp.path, "--target", "wgpu:vulkan", "--target", "browser", "--json", tmp_path / "m.json")
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "m.json").read_text())
    columns = data["matrix"]["columns"]
    assert [c["target"] for c in columns] == ["wgpu:vulkan", "browser"]
    assert columns[1]["backend"] == "browser-webgpu" and columns[1]["adapter"]
    assert data["verdicts"]["browser"]["summary"]["pass"] == len(mlp.cases)
    assert all(row["group"] == "passes" for row in data["matrix"]["rows"])
