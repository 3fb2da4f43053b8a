"""The layers point one way: the import-linter contracts of pyproject.toml hold on the package
as it installs, and a wrong import breaks them. Also what the layering relies on: importing
``tapml.cli`` registers every command, and every op with a WGSL lowering is in the foundation's
op vocabulary (tapml.ops no longer asks the platforms)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")
COMMANDS = {"carve", "inspect", "replay", "gen-tests", "migrate", "session", "serve", "registry", "devices", "report",
            "bench", "repro", "generate", "fleet", "precision", "targets"}


def _tree(dest: Path) -> Path:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "layer_tree.py"), str(dest)], check=True,
                   capture_output=True)
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess:
    # From inside the tree: lint-imports puts the working directory first on sys.path.
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)


def test_the_layer_contracts_hold(tmp_path):
    r = _lint(_tree(tmp_path / "tree"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 kept, 0 broken" in r.stdout


def _seam_contract() -> dict:
    import tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["id"] == "checking-through-the-seam")


def test_every_backend_module_is_behind_the_seam_contract():
    """Each built-in backend's module, once it exists, is one the checking code may not import."""
    import importlib.util

    from tapml.platforms.targets import BUILTIN_BACKENDS, OWN_BACKENDS
    forbidden = set(_seam_contract()["forbidden_modules"])
    assert {"tapml.platforms.external", "tapml.platforms.platform_backend"} <= forbidden
    for value in [*BUILTIN_BACKENDS.values(), *OWN_BACKENDS.values()]:
        module = value.split(":")[0]
        if importlib.util.find_spec(module) is not None:
            assert module in forbidden, f"add {module} to the checking-through-the-seam contract's forbidden_modules"


def _lint_with_import(tmp_path, module_file: str, line: str):
    """lint-imports over a copy of the installed tree with ``line`` appended to ``tapml/MODULE_FILE``."""
    copy = tmp_path / "copy"
    shutil.copytree(_tree(tmp_path / "linked"), copy, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    planted = copy / "tapml" / module_file
    planted.write_text(planted.read_text() + f"\n{line}\n")
    return _lint(copy)


def test_a_checking_module_importing_a_backend_breaks_the_seam_contract(tmp_path):
    r = _lint_with_import(tmp_path, "driving/replay.py", "import tapml.platforms.external  # noqa: E402,F401")
    assert r.returncode != 0, r.stdout
    assert "the checking code reaches a backend only through" in r.stdout and "BROKEN" in r.stdout
    assert "tapml.driving.replay -> tapml.platforms.external" in r.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    r = _lint_with_import(tmp_path, "graph.py", "import tapml.cli  # noqa: E402,F401 - the foundation importing the CLI")
    assert r.returncode != 0, r.stdout
    assert "tapml layers point one way" in r.stdout and "BROKEN" in r.stdout
    assert "tapml.graph -> tapml.cli" in r.stdout


def test_importing_the_cli_registers_every_command():
    code = ("import sys; from tapml.cli import app; "
            "names = {c.name or c.callback.__name__.replace('_', '-') for c in app.registered_commands}; "
            "names |= {g.name for g in app.registered_groups}; "
            "print(' '.join(sorted(names))); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert set(out[0].split()) == COMMANDS
    assert out[1] == "False"  # heavy imports stay inside the commands


def test_every_lowered_op_is_in_the_vocabulary():
    from tapml.ops import check_op
    from tapml.platforms.wgsl import load_lowerings
    names = sorted(load_lowerings())
    assert len(names) > 50
    for name in names:
        check_op(name)  # ValueError names the op and why


def test_the_readme_states_the_lowerings_and_their_dtypes():
    """README's coverage table is the registry's (regenerate it with
    ``python -c "from tapml.platforms.wgsl.registry import coverage_markdown; print(coverage_markdown())"``)."""
    from pathlib import Path
    from tapml.platforms.wgsl.registry import coverage_markdown
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert coverage_markdown() in readme, "README.md's op coverage table is stale: regenerate it"
