"""``tapml repro``: a folder that reproduces one case or region without tapml.

The folder's ``run.py`` runs under a Python that can import only wgpu and numpy (a venv made
here, which is checked to lack tapml and torch) and must report the stats ``tapml replay``
reports; its page runs in headless Chromium (served over http on loopback) and says FAIL or PASS.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import in_chromium, repro_page_result
from typer.testing import CliRunner

from tapml.cli import app

STORE_SPEC = "zoo:tiny-gpt2"
TANH = "aten.tanh.default"
FAULT = f"{TANH}=scale:1.01"
PACKAGES = ("wgpu", "numpy", "numpy.libs", "cffi", "pycparser")


def tapml(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def store(carved):
    return carved(STORE_SPEC)


@pytest.fixture(scope="module")
def tanh_case(store):
    from tapml.carving import CarveStore
    return next(c for c in CarveStore(store).cases if c["op"] == TANH)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv whose Python can import wgpu and numpy (linked from this one) and nothing of tapml."""
    import numpy
    import wgpu
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    source = Path(wgpu.__file__).parent.parent
    assert Path(numpy.__file__).parent.parent == source
    for name in [*PACKAGES, *(p.name for p in source.glob("_cffi_backend*"))]:
        if (source / name).exists():
            (site / name).symlink_to(source / name)
    python = venv / "bin" / "python"
    for module, importable in (("wgpu", True), ("numpy", True), ("tapml", False), ("torch", False)):
        r = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, timeout=120,
                           cwd=venv)
        assert (r.returncode == 0) == importable, f"import {module} in the bare venv: {r.stderr}"
    return python


def make_repro(store, what, out, *extra):
    r = tapml("repro", store, what, "--target", "wgpu:vulkan", "-o", out, *extra)
    assert r.exit_code == 0, r.output
    return json.loads((out / "plan.json").read_text())


def run_folder(python, folder, *args):
    r = subprocess.run([str(python), "run.py", "--backend", "vulkan", *args], cwd=folder, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    return r


def same3(a, b) -> bool:
    """Equal to 3 significant digits (None only equals None)."""
    if a is None or b is None:
        return a is b
    return a == b or math.isclose(float(f"{a:.3g}"), float(f"{b:.3g}"), rel_tol=1e-9)


# --- fast tier: bad input -----------------------------------------------------------------------


def test_unknown_case_or_node_is_exit_2_naming_what_exists(store, tmp_path):
    r = tapml("repro", store, "no_such_node", "-o", tmp_path / "r")
    assert r.exit_code == 2, r.output
    assert "'no_such_node' is no case id, node, region" in r.output and "tapml inspect" in r.output
    r = tapml("repro", store, "tanh..nope", "-o", tmp_path / "r")
    assert r.exit_code == 2 and "no node named 'nope'" in r.output, r.output
    assert not (tmp_path / "r").exists()


def test_region_given_backwards_is_exit_2(store, tmp_path):
    r = tapml("repro", store, "add_1..view", "-o", tmp_path / "r")
    assert r.exit_code == 2 and "write it as view..add_1" in r.output, r.output


def test_existing_non_empty_output_is_exit_2_and_left_alone(store, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = tapml("repro", store, "tanh", "-o", out)
    assert r.exit_code == 2 and "exists and is not an empty folder" in r.output, r.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    assert tapml("repro", store, "tanh", "-o", tmp_path / "file").exit_code == 2


def test_reference_target_is_exit_2(store, tmp_path):
    r = tapml("repro", store, "tanh", "--target", "reference", "-o", tmp_path / "r")
    assert r.exit_code == 2 and "runs torch, not WGSL" in r.output, r.output


# --- device tier --------------------------------------------------------------------------------


@pytest.mark.device
def test_injected_case_fails_outside_tapml_with_replays_stats(store, tanh_case, bare_python, tmp_path):
    folder = tmp_path / "injected"
    plan = make_repro(store, tanh_case["id"], folder, "--inject", FAULT)
    assert plan["subject"]["case"] == tanh_case["id"] and plan["inject"] == [FAULT]
    assert {p.name for p in folder.iterdir()} >= {"plan.json", "README.md", "run.py", "run.js", "index.html",
                                                  "input00.npy", "expected00.npy"}
    assert any(p.suffix == ".wgsl" for p in folder.iterdir())

    verdicts = tmp_path / "v.json"
    r = tapml("replay", store, "--target", "wgpu:vulkan", "--op", TANH, "--inject", FAULT, "--json", verdicts)
    assert r.exit_code == 1, r.output
    replayed = next(c for c in json.loads(verdicts.read_text())["cases"] if c["id"] == tanh_case["id"])
    assert replayed["status"] == "mismatch"

    r = run_folder(bare_python, folder, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    got = json.loads(r.stdout)
    assert got["status"] == "mismatch"
    for key in ("max_abs_err", "max_rel_err", "mismatch_fraction"):
        assert same3(got[key], replayed[key]), (key, got[key], replayed[key])
    assert got["worst"][0]["index"] == replayed["worst"][0]["index"]

    r = run_folder(bare_python, folder)
    assert r.returncode == 1 and r.stdout.startswith("FAIL mismatch"), r.stdout + r.stderr
    assert f"max_abs_err {replayed['max_abs_err']:.6g}" in r.stdout

    readme = (folder / "README.md").read_text()
    assert "tapml repro" in readme and f"--inject {FAULT}" in readme and "Planted fault" in readme
    for words in ("adapter:", "backend: vulkan", "driver:", "features:", "max-storage-buffer-binding-size"):
        assert words in readme, words


@pytest.mark.device
def test_healthy_case_passes_outside_tapml(store, tanh_case, bare_python, tmp_path):
    folder = tmp_path / "healthy"
    plan = make_repro(store, tanh_case["node"], folder)  # a node name picks its case
    assert plan["subject"]["case"] == tanh_case["id"] and plan["observed"]["status"] == "pass"
    r = run_folder(bare_python, folder)
    assert r.returncode == 0 and r.stdout.startswith("PASS pass"), r.stdout + r.stderr


@pytest.mark.device
def test_region_repro_fails_with_fault_and_passes_without(store, tanh_case, bare_python, tmp_path):
    module = tanh_case["module"].rpartition(".")[0]  # the MLP holding the activation
    # a 1% error in the activation stays within tolerance after the projection; 50% does not
    bad = make_repro(store, module, tmp_path / "bad", "--inject", f"{TANH}=scale:1.5")
    assert bad["subject"]["kind"] == "region" and len(bad["kernels"]) > 1 and len(bad["inputs"]) > 1
    assert bad["observed"]["status"] == "mismatch"
    r = run_folder(bare_python, tmp_path / "bad", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    got = json.loads(r.stdout)
    for key in ("max_abs_err", "max_rel_err", "mismatch_fraction"):
        assert same3(got[key], bad["observed"][key]), (key, got[key], bad["observed"][key])

    make_repro(store, module, tmp_path / "good")
    r = run_folder(bare_python, tmp_path / "good")
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr


@pytest.mark.device
def test_int64_inputs_travel_as_i32_like_tapml_uploads_them(store, bare_python, tmp_path):
    plan = make_repro(store, "view..add_1", tmp_path / "ids")  # token ids and positions: int64 on the host
    converted = [i for i in plan["inputs"] if i["dtype"] == "int64"]
    assert converted and all(i["device_type"] == "i32" and "int64 -> i32" in i["conversion"] for i in converted)
    import numpy as np
    assert np.load(tmp_path / "ids" / converted[0]["file"]).dtype == np.int32
    r = run_folder(bare_python, tmp_path / "ids")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.device
def test_plan_naming_a_file_outside_the_folder_is_refused(store, tanh_case, bare_python, tmp_path):
    folder = tmp_path / "hostile"
    plan = make_repro(store, tanh_case["id"], folder)
    plan["inputs"][0]["file"] = "../../etc/passwd"
    (folder / "plan.json").write_text(json.dumps(plan))
    r = run_folder(bare_python, folder)
    assert r.returncode == 2 and "not a plain file name" in r.stderr, r.stdout + r.stderr


# --- browser tier -------------------------------------------------------------------------------


@in_chromium
def test_page_fails_for_the_injected_case_and_passes_for_the_healthy_one(store, tanh_case, tmp_path):
    bad, good = tmp_path / "bad", tmp_path / "good"
    plan = make_repro(store, tanh_case["id"], bad, "--inject", FAULT)
    make_repro(store, tanh_case["id"], good)
    text = repro_page_result(bad)
    assert text.startswith("FAIL mismatch"), text
    assert f"mismatch_fraction {plan['observed']['mismatch_fraction']:.6g}" in text, text
    text = repro_page_result(good)
    assert text.startswith("PASS pass"), text
