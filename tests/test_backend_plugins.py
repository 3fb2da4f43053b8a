"""Third-party backends, end to end: one shipped in a wheel this test builds (a ``tapml.backends``
entry point, installed into a fresh venv that sees this environment through a ``.pth``) and one in
the user's own ``my_backend.py:MyBackend``. Both are listed by ``tapml targets`` and used by
replay, migrate and a generated suite (``pytest --tapml-target``); the wrong op planted in each
(gelu's output scaled by 1.01) is what every one of them names."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PLANTED = textwrap.dedent('''
    import torch
    from tapml.platforms.backend import Backend, Compiled

    class PlantedBackend(Backend):
        """Runs the program with torch, but gelu's output comes out 1% too large."""
        needs = "torch"
        def describe(self):
            return {"device": "cpu", "version": "0.1"}
        def compile(self, program):
            gm = program.module()
            for node in list(gm.graph.nodes):
                if node.op == "call_function" and str(node.target) == "aten.gelu.default":
                    with gm.graph.inserting_after(node):
                        new = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.01))
                    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
            gm.recompile()
            return Compiled(handle=gm, artifact=str(program.graph).encode(), artifact_name="graph.txt")
        def run(self, compiled, inputs):
            out = compiled.handle(*inputs)
            return list(out) if isinstance(out, (list, tuple)) else [out]
''')


@pytest.fixture(scope="module")
def plugin_python(tmp_path_factory) -> Path:
    """A fresh venv's python that sees this environment (a ``.pth`` that adds its site-packages) and
    has the wheel of a package registering ``planted`` in the ``tapml.backends`` entry-point group."""
    base = tmp_path_factory.mktemp("plugin")
    pkg = base / "pkg"
    (pkg / "planted_backend").mkdir(parents=True)
    (pkg / "planted_backend" / "__init__.py").write_text(PLANTED)
    (pkg / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "planted-backend"
        version = "0.1"
        [project.entry-points."tapml.backends"]
        planted = "planted_backend:PlantedBackend"
    '''))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(base / "dist"), str(pkg)], check=True, capture_output=True, timeout=300)
    wheel = next((base / "dist").glob("planted_backend-0.1-*.whl"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    own = Path(subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, check=True).stdout.strip())
    # this environment's site-packages as a site dir, so its own .pth files (tapml editable) apply too
    (own / "zz_outer_env.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n"
                                                  for p in site.getsitepackages()))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(own),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return python


@pytest.fixture(scope="module")
def my_backend(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user") / "my_backend.py"
    path.write_text(PLANTED.replace("class PlantedBackend", "class MyBackend"))
    return f"{path}:MyBackend"


def _tapml(python: Path, *args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "tapml.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize("which", ["entry point", "file"])
def test_a_plugin_backend_is_listed_and_used_by_replay_migrate_and_gen_tests(which, plugin_python, my_backend,
                                                                                carved, tmp_path):
    spec = "planted" if which == "entry point" else my_backend
    store = carved("zoo:mlp")
    listed = _tapml(plugin_python, "targets", *([] if which == "entry point" else [spec]), "--json", tmp_path / "t.json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = {r["target"]: r for r in json.loads((tmp_path / "t.json").read_text())["targets"]}
    assert rows[spec]["kind"] == which and rows[spec]["importable"] is True
    if which == "entry point":
        assert rows[spec]["source"] == "planted_backend:PlantedBackend" and "planted-backend" in rows[spec]["needs"]
        assert "planted" not in subprocess.run([sys.executable, "-m", "tapml.cli", "targets"], capture_output=True,
                                               text=True, env={**os.environ, "COLUMNS": "200"}).stdout.split()

    replay = _tapml(plugin_python, "replay", store, "--target", spec, "--json", tmp_path / "v.json")
    assert replay.returncode == 1, replay.stdout + replay.stderr
    failed = [c for c in json.loads((tmp_path / "v.json").read_text())["cases"] if c["status"] != "pass"]
    assert [(c["op"], c["status"]) for c in failed] == [("aten.gelu.default", "mismatch")]

    migrate = _tapml(plugin_python, "migrate", "zoo:mlp", "--target", spec, "--state", tmp_path / "s.json")
    assert migrate.returncode == 1, migrate.stdout + migrate.stderr
    state = json.loads((tmp_path / "s.json").read_text())
    assert {(c["op"], c["kind"]) for c in state["culprits"]} == {("aten.gelu.default", "op")}

    suite = tmp_path / "suite"
    made = _tapml(plugin_python, "gen-tests", store, "-o", suite)
    assert made.returncode == 0, made.stdout + made.stderr
    run = subprocess.run([str(plugin_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite),
                          "--tapml-target", spec, "--junitxml", str(tmp_path / "r.xml")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    cases = list(ET.parse(tmp_path / "r.xml").getroot().iter("testcase"))
    failing = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    assert len(cases) == len(json.loads((Path(store) / "manifest.json").read_text())["cases"])
    assert len(failing) == 1 and failing[0].startswith("test_aten_gelu_default["), failing
