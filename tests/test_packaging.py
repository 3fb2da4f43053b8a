"""How tapml installs: the declared packages, the lock against the ranges, and the wheel in a user's
environment (a fresh venv that already holds torch), run from a folder outside the checkout."""

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from support import vulkan_or_skip

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = (ROOT / "requirements.lock").read_text()


def _locked() -> dict[str, tuple[str, int]]:
    """requirements.lock as {canonical name: (pinned version, number of hashes)}."""
    entries = re.split(r"\n(?=[A-Za-z0-9])", LOCK)
    pins = {}
    for entry in entries:
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", entry)
        if m:
            pins[canonicalize_name(m.group(1))] = (m.group(2), entry.count("--hash=sha256:"))
    return pins


def _clean_env() -> dict:
    """The environment of a user's shell: nothing pointing into this checkout or its venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT)))
    return env


def test_every_folder_that_ships_is_a_declared_package():
    setuptools = PYPROJECT["tool"]["setuptools"]
    roots = {Path(folder): package for package, folder in setuptools["package-dir"].items()}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = set()
    for name in tracked.splitlines():
        path = Path(name)
        for root, package in roots.items():
            if path.parent == root or root in path.parent.parents:
                folders.add(".".join([package, *path.parent.relative_to(root).parts]))
    assert folders, "no tracked files under the package folders"
    assert folders - set(setuptools["packages"]) == set(), "folders that would not ship"
    for package, patterns in setuptools["package-data"].items():
        assert package in setuptools["packages"], f"package-data for {package}, which is not a package"


def test_the_lock_pins_every_dependency_within_its_declared_range_with_hashes():
    pins = _locked()
    declared = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    declared += [Requirement(r) for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra]
    declared += [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    for req in declared:
        assert canonicalize_name(req.name) in pins, f"{req.name} is declared but not in requirements.lock"
        version = pins[canonicalize_name(req.name)][0]
        assert req.specifier.contains(version, prereleases=True), f"lock {req.name}=={version} is outside {req}"
    assert all(hashes for _, hashes in pins.values()), [n for n, (_, h) in pins.items() if not h]
    torch = Version(pins["torch"][0])
    assert torch.local == "cpu", "the lock holds torch's CPU build (an open torch pulls the CUDA one)"
    assert all(not n.startswith("nvidia-") for n in pins), "CUDA packages in the lock"


@pytest.mark.device
def test_torch_export_after_a_wgpu_adapter_is_up(tmp_path):
    """torch's CUDA builds bring triton; imported after Mesa's drivers it crashed the process
    (torch.export imports it on first use). With the CPU build this runs the same steps."""
    code = ("from tapml.platforms.wgpu_native import available_backends\n"
            "assert available_backends()\n"
            "import torch\n"
            "ep = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(1, 3),)).run_decompositions()\n"
            "print('exported', len(ep.graph.nodes))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "exported" in r.stdout, r.stdout + r.stderr


def _run(args, cwd, env, timeout=900) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.mark.slow
@pytest.mark.device  # in subprocesses of its own: no xdist group, any worker may take it
def test_wheel_installs_beside_the_users_torch_and_works_outside_the_checkout(tmp_path):
    vulkan_or_skip()
    env = _clean_env()
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()

    # a release: the sdist, then the wheel from it, with no warning
    build = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT], tmp_path, env)
    assert not re.search(r"warn", build.stdout + build.stderr, re.I), build.stdout + build.stderr
    wheel, = dist.glob("tapml-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for name in ["tapml/cli/__init__.py", "tapml/carving/templates/test_op.py.j2", "tapml/platforms/web/index.html",
                 "tapml/reports/templates/report.html.j2", "tapml/templates/repro/run.py"]:
        assert name in shipped, f"{name} is not in the wheel"

    # the user's environment: a fresh venv holding the lock's torch
    _run([sys.executable, "-m", "venv", venv], tmp_path, env)
    py = venv / "bin" / "python"
    pins = _locked()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, (version, _) in pins.items()))
    _run([py, "-m", "pip", "install", "-q", f"torch=={pins['torch'][0]}", "-c", constraints], tmp_path, env)
    probe = "import torch, os; print(torch.__version__, os.stat(torch.__file__).st_ino)"
    torch_before = _run([py, "-c", probe], work, env).stdout.split()

    _run([py, "-m", "pip", "install", "-q", wheel, "pytest", "-c", constraints], tmp_path, env)
    assert _run([py, "-c", probe], work, env).stdout.split() == torch_before, "installing the wheel replaced torch"
    where = _run([py, "-c", "import tapml; print(tapml.__file__)"], work, env).stdout
    assert str(venv) in where and str(ROOT) not in where, where

    # the commands, from a folder outside the checkout
    tapml = venv / "bin" / "tapml"
    _run([tapml, "carve", "zoo:tiny-llama", "-o", "store"], work, env)
    _run([tapml, "replay", "store", "--target", "wgpu:vulkan", "--json", "verdicts.json"], work, env)
    summary = json.loads((work / "verdicts.json").read_text())["summary"]
    assert summary["pass"] > 0 and summary["mismatch"] == summary["error"] == 0, summary
    _run([tapml, "report", "verdicts.json", "-o", "report.html"], work, env)
    assert "tiny-llama" in (work / "report.html").read_text()
    _run([tapml, "gen-tests", "store", "-o", "gen"], work, env)
    out = _run([py, "-m", "pytest", "gen", "-q", "-p", "no:cacheprovider", "--tapml-target", "wgpu:vulkan"], work, env).stdout
    assert re.search(rf"\b{summary['pass']} passed\b", out) and "failed" not in out, out
