"""Repro folders for external backends (``tapml repro STORE CASE --target iree:vulkan``): the case
as the backend's own input, runnable with that backend alone.

The folder holds the backend's artifact for the case (``Compiled.artifact``: MLIR, ONNX, ...; for a
compile that failed, the one the backend failed on), the inputs and the reference's outputs
(``.npy``; bfloat16 as float32), ``plan.json`` (target, backend, what tapml saw, each tensor's
file, dtype, shape and tolerances), ``run.py`` (compares dtype, shape, then values) and
``runner.py``: the backend's own runner when it gives one (:meth:`Backend.repro_runner`: only its
package needed), else one that re-imports the backend class (``module:Class`` or its file) and
compiles the saved program ``program.pt2``.

Example::

    with open_target("ort") as platform:
        write_backend_repro(store, find_subject(store, "c5"), platform, "repro-c5", target="ort")
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np

from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.graph import dtype_name
from tapml.platforms.compile_cache import ARTIFACT_NAME

FORMAT = "tapml-backend-repro/1"
#: The folder's own files, which an artifact's name may not take.
RESERVED = ("run.py", "runner.py", "plan.json", "README.md", "program.pt2")
GENERIC_NEEDS = "torch, tapml (its backend contract) and the backend's own package"


def backend_source(target: str) -> str:
    """What names the backend class of ``target`` in a repro: ``/abs/file.py:Class`` or ``module:Class``."""
    from tapml.platforms.targets import FILE_BACKEND, installed_backends
    m = FILE_BACKEND.fullmatch(target)
    if m:
        return f"{Path(m['path']).resolve()}:{m['name']}"
    return installed_backends()[target.split(":", 1)[0]]


def _host(tensor, what: str) -> np.ndarray:
    name = dtype_name(tensor.dtype)
    t = tensor.detach().cpu().contiguous()
    if name == "bfloat16":
        t = t.float()
    try:
        return t.numpy()
    except TypeError:
        raise TapmlError(f"{what} has dtype {name}, which a repro cannot hold as .npy") from None


def _program_bytes(graph) -> bytes:
    """The ExportedProgram the backend was given for ``graph``, saved with torch.export.save."""
    import io

    import torch

    from tapml.platforms.external import export_graph
    buf = io.BytesIO()
    torch.export.save(export_graph(graph), buf)
    return buf.getvalue()


def write_backend_repro(store, subject, platform, out_dir: str | Path, *, target: str,
                        inject: list[str] | None = None, command: str = "") -> dict:
    """Compile ``subject`` on the backend ``platform`` (its worker), run it once, and write the repro
    folder ``out_dir`` (whole or not at all). A compile the backend fails still makes a folder, with the
    artifact it failed on when it gave one. Returns ``{"folder", "files", "observed", "device",
    "backend", "artifact"}``; DeviceLost is raised."""
    from tapml.driving.repro import check_output_dir, observe, write_folder
    out = check_output_dir(out_dir)
    try:
        program, refusal = platform.compile(subject.graph), None
    except DeviceLost:
        raise
    except (Unsupported, PlatformError) as e:
        program, refusal = None, e
    artifact = getattr(platform, "last_artifact", None)
    observed = observe(platform, program, subject, refusal)
    caps = platform.caps()
    runner = caps.get("repro_runner")
    files: dict[str, bytes | np.ndarray] = {}
    plan = {"format": FORMAT, "title": f"{subject.kind} {subject.label}", "target": target,
            "backend": backend_source(target), "device": caps.get("adapter", ""), "backend_version": caps.get("backend", ""),
            "control": caps.get("control"), "model": store.model, "command": command, "inject": list(inject or []),
            "subject": subject.info, "observed": observed,
            "runner": "the backend's own" if runner else "re-imports the backend class",
            "runner_needs": "the backend's own package and numpy" if runner else GENERIC_NEEDS,
            "artifact": None, "inputs": [], "outputs": []}
    if artifact:
        name, data = artifact
        if not ARTIFACT_NAME.fullmatch(name) or name in RESERVED or name.startswith(("input_", "expected_")):
            name = "artifact.bin"  # the backend's name would leave the folder or replace one of its files
        files[name] = data
        plan["artifact"] = name
    for i, t in enumerate(subject.inputs):
        files[f"input_{i}.npy"] = _host(t, f"input {i}")
        plan["inputs"].append({"file": f"input_{i}.npy", "dtype": dtype_name(t.dtype), "shape": list(t.shape)})
    for i, (t, (rtol, atol)) in enumerate(zip(subject.expected, subject.tolerances)):
        files[f"expected_{i}.npy"] = _host(t, f"output {i}")
        plan["outputs"].append({"expected": f"expected_{i}.npy", "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                                "rtol": rtol, "atol": atol})
    templates = resources.files("tapml") / "templates" / "backend_repro"
    files["runner.py"] = runner.encode() if runner else (templates / "runner.py").read_bytes()
    if not runner:
        files["program.pt2"] = _program_bytes(subject.graph)
    files["run.py"] = (templates / "run.py").read_bytes()
    page = caps.get("repro_page")
    if isinstance(page, dict) and page:
        for name, text in page.items():
            if not (isinstance(name, str) and isinstance(text, str) and ARTIFACT_NAME.fullmatch(name)) or \
                    name in files or name in RESERVED or name == "check.js":
                raise TapmlError(f"the backend's repro page names the file {name!r}, which a repro folder cannot hold")
            files[name] = text.encode()
        files["check.js"] = (resources.files("tapml") / "templates" / "repro" / "check.js").read_bytes()
        plan["page"] = "index.html" if "index.html" in page else sorted(page)[0]
    files["README.md"] = _readme(plan).encode()
    files["plan.json"] = (json.dumps(plan, indent=1, allow_nan=False) + "\n").encode()
    write_folder(out, files)
    return {"folder": str(out), "files": sorted(files), "observed": observed, "device": plan["device"],
            "backend": plan["backend_version"], "artifact": plan["artifact"], "kernels": 0}


def _readme(plan: dict) -> str:
    obs = plan["observed"]
    lines = [f"# tapml repro — {plan['title']} on `{plan['target']}`", "",
             f"Model `{plan['model']}`; backend `{plan['backend']}` ({plan['backend_version']}) on {plan['device']}. "
             "Made with:", "", f"    {plan['command']}", "",
             "## What tapml saw", "", f"**{obs['status']}**" + (f": {obs['message']}" if obs["message"] else ""), "",
             "## Run it", "", f"Needs {plan['runner_needs']}.", "",
             "    python run.py          # PASS or FAIL, exit 0 or 1 (2: cannot run here)",
             "    python run.py --json", "", "## Files", ""]
    if plan["artifact"]:
        lines.append(f"- `{plan['artifact']}`: the backend's own input for this case")
    else:
        lines.append("- (the backend gave no artifact for this case)")
    if plan.get("page"):
        lines[lines.index("## Files"):lines.index("## Files")] = [
            "In a browser, with the backend's own web runtime alone: serve this folder "
            "(`python -m http.server -b 127.0.0.1 8000`) and open "
            f"<http://127.0.0.1:8000/{plan['page'] if plan['page'] != 'index.html' else ''}>, or open "
            f"`{plan['page']}` from disk and pick every file of this folder. The page prints PASS or FAIL the same way.", ""]
    lines += [f"- `runner.py`: {plan['runner']} runner", "- `plan.json`: the tensors, their dtypes, shapes and tolerances"]
    if plan.get("page"):
        lines.append(f"- `{plan['page']}` and its scripts (`check.js`, ...): the page that runs the case in a browser")
    lines += [f"- `{i['file']}`: input {i['dtype']}{i['shape']}" for i in plan["inputs"]]
    lines += [f"- `{o['expected']}`: reference output {o['dtype']}{o['shape']}, rtol {o['rtol']:g} atol {o['atol']:g}"
              for o in plan["outputs"]]
    if plan["runner"] != "the backend's own":
        lines.append("- `program.pt2`: the torch.export program the backend was given (torch.export.load)")
    return "\n".join(lines) + "\n"
