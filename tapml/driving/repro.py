"""Repro folders: one case or region of a carve store, compiled for a target, as a folder that
reproduces it without tapml (``tapml repro``).

The folder holds the WGSL of every kernel, the dispatch plan (``plan.json``: buffers with their
roles, types and sizes, kernels in order with bindings and workgroup counts, which input fills
which buffer, which buffers are outputs, the tolerances), the inputs as the device receives them
and the reference's outputs (``.npy``), ``run.py`` (needs only ``wgpu`` and ``numpy``),
``index.html`` + ``run.js`` (any WebGPU browser) and a README naming the device it was made for.
Every file lies flat in the folder, so a page opened from disk can be handed all of them at once.

Example::

    store = CarveStore("stores/gpt2")
    subject = find_subject(store, "c63")
    with open_target("wgpu:vulkan") as platform:
        write_repro(store, subject, platform, "repro-c63", target="wgpu:vulkan")
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from tapml.judging.compare import Comparison, Tolerances, compare_tensor, merge
from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.graph import Graph, dtype_name
from tapml.judging.verdict import outcome_verdict

FORMAT = "tapml-repro/1"
#: Files copied verbatim from the package's ``templates/repro`` folder.
TEMPLATES = ("run.py", "check.js", "run.js", "index.html")
# bfloat16 (numpy has none) travels as its raw 16-bit patterns on the device side and as
# float32 (exact) on the host side.
_DEVICE_NP = {"f32": np.float32, "f16": np.float16, "f16p": np.float16, "bf16p": np.uint16, "i32": np.int32,
              "u32": np.uint32, "i64": np.dtype("<i8"), "c64": np.complex64, "u64": np.dtype("<u8")}
_HOST_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "int64": np.int64, "int32": np.int32,
            "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "uint64": np.uint64, "bool": np.bool_}


@dataclass
class ReproSubject:
    """What a repro reproduces: a one-node case graph or a region's subgraph, the tensors at its
    inputs (the carved ones, or the reference's values at the region's inputs), the reference's
    outputs and the ``(rtol, atol)`` each output is judged with."""

    kind: str  # "case" or "region"
    label: str
    graph: Graph
    inputs: list[torch.Tensor]
    expected: list[torch.Tensor]
    tolerances: list[tuple[float, float]]
    info: dict = field(default_factory=dict)


def find_subject(store, what: str, tolerances: Tolerances | None = None) -> ReproSubject:
    """The subject ``what`` names in ``store``: a case id (``c63``), a node name (its carved case),
    a region ``FIRST..LAST`` (nodes in topological order, both ends included) or a module path
    (every node inside it). TapmlError, saying what exists, when it names nothing."""
    tolerances = tolerances or Tolerances()
    if not isinstance(what, str) or not what:
        raise TapmlError("name a case id, a node, a region FIRST..LAST or a module path")
    nodes = {n.name: n for n in store.graph.nodes}
    case_ids = {c["id"] for c in store.cases}
    if what in case_ids:
        return _case_subject(store, store.case(what), tolerances)
    if what in nodes:
        node = nodes[what]
        if node.case in case_ids:
            return _case_subject(store, store.case(node.case), tolerances, node=what)
        return _region_subject(store, [what], what, tolerances)
    order = list(nodes)
    if ".." in what:
        first, _, last = what.partition("..")
        missing = [n for n in (first, last) if n not in nodes]
        if missing:
            raise TapmlError(f"region {what!r}: no node named {missing[0]!r}{_hint(missing[0], order)}")
        i, j = order.index(first), order.index(last)
        if i > j:
            raise TapmlError(f"region {what!r}: {first} comes after {last} in the graph; write it as {last}..{first}")
        return _region_subject(store, order[i:j + 1], what, tolerances)
    inside = [n.name for n in store.graph.nodes if n.module == what or n.module.startswith(what + ".")]
    if inside:
        return _region_subject(store, inside, what, tolerances)
    modules = sorted({n.module for n in store.graph.nodes})
    raise TapmlError(f"{what!r} is no case id, node, region FIRST..LAST or module path of {store.path}"
                     f"{_hint(what, sorted(case_ids) + order + modules)}; `tapml inspect {store.path}` lists its ops")


def _hint(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, 5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _case_subject(store, case: dict, tolerances: Tolerances, node: str | None = None) -> ReproSubject:
    expected = store.case_outputs(case)
    tols = [tolerances.get(case["op"], dtype_name(t.dtype)) for t in expected]
    info = {"case": case["id"], "op": case["op"], "node": case["node"], "module": case["module"],
            "nodes": [case["node"]], "ops": [case["op"]]}
    if node is not None and node != case["node"]:
        info["asked_node"] = node  # a node whose case was carved at another node with the same signature
    return ReproSubject("case", case["id"], store.case_graph(case), store.case_inputs(case), expected, tols, info)


def _region_subject(store, names: list[str], label: str, tolerances: Tolerances) -> ReproSubject:
    from tapml.driving.hybrid import reference_values
    graph = store.graph
    sub = graph.subgraph(names)
    if not sub.outputs:
        raise TapmlError(f"region {label!r} produces nothing that is used or output; choose a larger region")
    ref = reference_values(graph, store.program_inputs())
    producer = graph.producer()
    expected = [ref[r] for r in sub.outputs]
    tols = [tolerances.get(producer[r].op, dtype_name(t.dtype)) for r, t in zip(sub.outputs, expected)]
    first, last = names[0], names[-1]
    info = {"region": label, "first": first, "last": last, "nodes": list(names),
            "ops": sorted({graph.node(n).op for n in names}), "output_refs": list(sub.outputs),
            "input_refs": [r for r, _ in sub.inputs],
            "output_ops": [producer[r].op for r in sub.outputs]}
    return ReproSubject("region", label, sub, [ref[r] for r, _ in sub.inputs], expected, tols, info)


def check_output_dir(path: str | Path) -> Path:
    """``path`` as a repro folder to create: TapmlError when it exists and is not an empty folder."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and (not path.is_dir() or any(path.iterdir()))):
        raise TapmlError(f"{path} exists and is not an empty folder; choose another -o")
    if not path.parent.is_dir():
        raise TapmlError(f"cannot write {path}: folder {path.parent} does not exist")
    return path


def compile_for_repro(platform, graph: Graph):
    """``(program, refusal)``: the WGSL KernelProgram of ``graph`` for ``platform``'s device, and
    the PlatformError the device raised when it refused the compiled program (the repro then
    carries the WGSL it refused), else None. TapmlError when there is no WGSL to hand over."""
    try:
        return platform.compile(graph), None
    except Unsupported as e:
        raise TapmlError(f"{platform.name} cannot run this: {e}; a repro needs a program the target supports") from None
    except DeviceLost:
        raise
    except PlatformError as refusal:
        from tapml.platforms.wgsl import compile_graph
        faults = getattr(platform, "faults", None)
        try:
            if faults:
                from tapml.driving.inject import inject_faults
                graph = inject_faults(graph, faults)
            program = compile_graph(graph, platform.caps())
        except (Unsupported, PlatformError):
            raise TapmlError(f"compiling for {platform.name} failed before any WGSL existed ({refusal}); "
                             "there is nothing to reproduce outside tapml") from None
        return program, refusal


def _judge(outputs: list[torch.Tensor], subject: ReproSubject) -> Comparison:
    if len(outputs) != len(subject.expected):
        return Comparison(False, message=f"{len(outputs)} outputs != reference {len(subject.expected)}")
    return merge([compare_tensor(t, r, rtol, atol) for t, r, (rtol, atol)
                  in zip(outputs, subject.expected, subject.tolerances)])


def observe(platform, program, subject: ReproSubject, refusal: Exception | None = None) -> dict:
    """What ``platform`` does with ``program``: the verdict JSON (status, error stats, message,
    worst elements) tapml gives, judged as ``tapml replay`` (a case) or a region check judges."""
    if refusal is not None:
        verdict = outcome_verdict(refusal)
    else:
        try:
            outputs = platform.run(program, subject.inputs)
        except (Unsupported, PlatformError) as e:
            if isinstance(e, DeviceLost):
                raise
            verdict = outcome_verdict(e)
        else:
            verdict = outcome_verdict(_judge(outputs, subject), round(getattr(platform, "last_run_ms", 0.0), 4))
    data = verdict.to_json()
    return {k: data.get(k) for k in ("status", "max_abs_err", "max_rel_err", "mismatch_fraction", "message", "worst")}


def _conversion(host: str, device: str) -> str:
    if host == "int64" and device == "i32":
        return "int64 -> i32: every value checked to fit in i32, then narrowed (WGSL has no 64-bit integers)"
    if host == "uint64" and device == "u64":
        return "uint64 -> u64: the same bytes, read as two u32 words per value (low word first), unsigned"
    if host == "int64" and device == "i64":
        return ("int64 -> i64: the same bytes, read as two u32 words per value (low word first), since values "
                "lie outside i32")
    if host == "bool" and device == "u32":
        return "bool -> u32: one 32-bit word per element, 1 for True, 0 for False (WGSL has no bool storage)"
    if host in ("int32", "int16", "int8", "uint8") and device == "i32":
        return f"{host} -> i32: widened"
    if (host, device) in (("float32", "f32"), ("float16", "f16")):
        return "none: the same bytes"
    if (host, device) == ("float16", "f16p"):
        return "none: the same bytes, read as two float16 per u32 word (no shader-f16)"
    if (host, device) == ("bfloat16", "bf16p"):
        return "bfloat16 bit patterns, two per u32 word (the high half of each float32)"
    return f"{host} -> {device}: converted"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", str(name))[:40] or "x"


def _device_array(tensor: torch.Tensor, storage: str, numel: int, name: str) -> np.ndarray:
    from tapml.platforms.wgsl.tensors import to_device
    try:
        data = to_device(tensor, storage, f"input {name}")
    except Unsupported as e:
        raise TapmlError(f"input {name} cannot be handed to a WGSL device: {e}") from None
    return np.frombuffer(data, dtype=_DEVICE_NP[storage], count=numel).reshape(tuple(tensor.shape))


def _host_array(tensor: torch.Tensor, what: str) -> np.ndarray:
    name = dtype_name(tensor.dtype)
    if name not in _HOST_NP:
        raise TapmlError(f"{what} has dtype {name}, which a repro cannot hold (no WGSL lowering has it)")
    if name == "bfloat16":
        tensor = tensor.float()
    return tensor.detach().cpu().contiguous().numpy().astype(_HOST_NP[name], copy=False)


def device_description(platform) -> dict:
    """Adapter, backend, driver, features and limits of ``platform`` from its caps (and, for a
    local wgpu adapter, the adapter's own info: vendor, architecture, type, driver)."""
    caps = platform.caps()
    desc = {"adapter": caps.get("adapter", ""), "backend": caps.get("backend", ""),
            "features": list(caps.get("features") or []), "limits": dict(caps.get("limits") or {})}
    inner = getattr(platform, "inner", platform)
    info = caps.get("adapter_info")
    adapter = getattr(inner, "adapter", None)
    if info is None and adapter is not None and isinstance(getattr(adapter, "info", None), dict):
        info = {k: str(v) for k, v in adapter.info.items() if isinstance(v, (str, int))}
    if info:
        desc["adapter_info"] = dict(info)
        desc["driver"] = str(info.get("description") or info.get("driver") or "")
    if caps.get("browser"):
        desc["browser"] = caps["browser"]
    return desc


def build_plan(store, subject: ReproSubject, program, *, target: str, inject: list[str], device: dict,
               observed: dict, command: str) -> tuple[dict, dict[str, bytes | np.ndarray]]:
    """``(plan, files)``: the plan.json object and every data file it names (name -> bytes or array)."""
    from tapml import version
    _require_wgsl(program, target)
    specs = {b.name: b for b in program.buffers}
    files: dict[str, bytes | np.ndarray] = {}
    buffers = []
    for b in program.buffers:
        entry = {"name": b.name, "type": b.dtype, "size": b.size, "role": b.role}
        if b.meta is not None:
            entry.update(shape=list(b.meta.shape), dtype=b.meta.dtype)
        if b.role == "const":
            entry["file"] = f"const{len([f for f in files if f.startswith('const')]):02d}_{_safe(b.name)}.bin"
            files[entry["file"]] = b.data or b""
        buffers.append(entry)
    # a tensor over the device's max-buffer-size fills several buffers: one file per part
    device_inputs = program.split_tensors(subject.inputs)
    device_expected = program.split_tensors(subject.expected, role="output")
    input_of = _tensor_of(program.tensor_inputs(), program.input_meta)
    output_of = _tensor_of(program.tensor_outputs(), program.output_meta)
    inputs = []
    for i, (name, meta, tensor) in enumerate(zip(program.inputs, program.input_meta, device_inputs)):
        storage = specs[name].dtype if name in specs else _storage_of(meta.dtype)
        arr = _device_array(tensor, storage, meta.numel, name)
        entry = {"buffer": name, "file": f"input{i:02d}.npy", "shape": list(meta.shape), "dtype": meta.dtype,
                 "device_type": storage, "conversion": _conversion(meta.dtype, storage), **input_of[i][1]}
        if subject.kind == "region":
            entry["ref"] = subject.info["input_refs"][input_of[i][0]]
        files[entry["file"]] = arr
        inputs.append(entry)
    outputs = []
    for i, (name, meta, ref) in enumerate(zip(program.outputs, program.output_meta, device_expected)):
        j, part = output_of[i]
        rtol, atol = subject.tolerances[j]
        storage = specs[name].dtype if name in specs else _storage_of(meta.dtype)
        entry = {"buffer": name, "expected": f"expected{i:02d}.npy", "shape": list(meta.shape), "dtype": meta.dtype,
                 "device_type": storage, "rtol": rtol, "atol": atol, **part}
        if subject.kind == "region":
            entry["ref"], entry["op"] = subject.info["output_refs"][j], subject.info["output_ops"][j]
        else:
            entry["op"] = subject.info["op"]
        files[entry["expected"]] = _host_array(ref, f"output {j}")
        outputs.append(entry)
    kernels = []
    for i, k in enumerate(program.kernels):
        kernels.append({"name": k.name, "file": f"kernel{i:02d}_{_safe(k.name)}.wgsl", "entry": k.entry,
                        "bindings": [list(b) for b in k.bindings], "workgroups": list(k.workgroups)})
        files[kernels[-1]["file"]] = k.wgsl.encode()
    plan = {
        "format": FORMAT, "tapml_version": version(), "command": command, "target": target,
        "inject": list(inject), "model": store.model, "torch_version": store.manifest.get("torch_version", ""),
        "reference_device": store.manifest.get("reference_device", ""),
        "subject": {"kind": subject.kind, "label": subject.label, **subject.info},
        "device": device, "buffers": buffers, "kernels": kernels, "inputs": inputs, "outputs": outputs,
        "comparison": "floats: |t - r| <= atol + rtol * |r| elementwise, NaN/Inf must match in position and sign; "
                      "integers and bools exactly; outputs start as 0xFF bytes each run so unwritten elements show",
        "observed": observed,
    }
    return plan, files


def _tensor_of(tensors: list, device_metas: list) -> list[tuple[int, dict]]:
    """Per device buffer position: the graph tensor it belongs to, and for a part of a tensor split
    across buffers the plan fields saying which (``part``, ``parts``, ``tensor_shape`` and
    ``elements``: ``[start, count]`` of the flattened tensor)."""
    out = []
    for j, (meta, positions) in enumerate(tensors):
        start = 0
        for k, at in enumerate(positions):
            count = device_metas[at].numel
            out.append((j, {} if len(positions) == 1 else {"part": k, "parts": len(positions), "tensor_shape":
                                                           list(meta.shape), "elements": [start, count]}))
            start += count
    return out


def _require_wgsl(program, target: str) -> None:
    if program.kind != "wgsl":
        raise TapmlError(f"target {target} runs {program.kind} programs, not WGSL; a repro needs a WGSL target "
                         "(wgpu, wgpu:vulkan, wgpu:gl, browser, or remote:// of such a server)")


def _storage_of(dtype: str) -> str:
    from tapml.platforms.wgsl.codegen import STORAGE
    return STORAGE.get(dtype, "f32")


def write_repro(store, subject: ReproSubject, platform, out_dir: str | Path, *, target: str,
                inject: list[str] | None = None, command: str = "") -> dict:
    """Compile ``subject`` for ``platform``, run it there once (what tapml sees goes into the
    README), and write the repro folder ``out_dir`` (it appears whole or not at all).

    Returns ``{"folder", "files", "kernels", "observed", "device", "backend"}``. TapmlError when the
    folder exists and is not empty, or the target cannot run WGSL; DeviceLost is raised."""
    out = check_output_dir(out_dir)
    program, refusal = compile_for_repro(platform, subject.graph)
    if refusal is None and hasattr(platform, "for_values"):  # int64 past i32: the two-word program runs
        program = platform.for_values(program, subject.inputs)
    _require_wgsl(program, target)
    device = device_description(platform)
    observed = observe(platform, program, subject, refusal)
    plan, files = build_plan(store, subject, program, target=target, inject=list(inject or []), device=device,
                             observed=observed, command=command)
    templates = resources.files("tapml") / "templates" / "repro"
    write_folder(out, {**files, "plan.json": (json.dumps(plan, indent=1, allow_nan=False) + "\n").encode(),
                       **{name: (templates / name).read_bytes() for name in TEMPLATES},
                       "README.md": render_readme(plan).encode()})
    return {"folder": str(out), "files": sorted([*files, "plan.json", "README.md", *TEMPLATES]),
            "kernels": len(program.kernels), "observed": observed, "device": device["adapter"],
            "backend": device["backend"]}


def write_folder(out: Path, files: dict) -> None:
    """Write a repro folder at once: ``files`` (name -> bytes, or a numpy array saved as ``.npy``
    without pickle) go to a hidden sibling, which replaces ``out`` (absent or empty) when all are
    written; nothing is left behind when writing fails."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, data in files.items():
            if isinstance(data, np.ndarray):
                np.save(tmp / name, data, allow_pickle=False)
            else:
                (tmp / name).write_bytes(data)
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()  # checked empty by check_output_dir
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.6g}"


def _part_note(entry: dict) -> str:
    if "part" not in entry:
        return ""
    return (f"; part {entry['part'] + 1} of {entry['parts']} of a {entry['dtype']}{entry['tensor_shape']} tensor "
            "held in several buffers (over the device's max-buffer-size), elements in row-major order")


def render_readme(plan: dict) -> str:
    """The README.md of a repro folder, from its plan."""
    s, dev, obs = plan["subject"], plan["device"], plan["observed"]
    if s["kind"] == "case":
        title = f"case {s['case']}: {s['op']} at node {s['node']}" + (f" ({s['module']})" if s["module"] else "")
    else:
        title = f"region {s['label']}: {len(s['nodes'])} nodes, {s['first']}..{s['last']} ({', '.join(s['ops'][:8])})"
    backend = dev.get("backend", "")
    flag = f" --backend {backend}" if backend in ("vulkan", "gl", "metal", "dx12") else ""
    lines = [f"# tapml repro — {title}", "",
             f"Model `{plan['model']}`, reference torch {plan['torch_version']} on {plan['reference_device']}. "
             f"Made by tapml {plan['tapml_version']} for target `{plan['target']}` with:", "",
             f"    {plan['command']}", ""]
    if plan["inject"]:
        lines += [f"**Planted fault** (`--inject {' '.join(plan['inject'])}`): compiled into the WGSL below on purpose "
                  "to show that a wrong kernel is caught; this is not a driver bug.", ""]
    lines += ["## What tapml saw on the target", "",
              f"**{obs['status']}** — max abs err {_fmt(obs['max_abs_err'])}, max rel err {_fmt(obs['max_rel_err'])}, "
              f"mismatch fraction {_fmt(obs['mismatch_fraction'])}" + (f": {obs['message']}" if obs["message"] else ""), ""]
    if obs.get("worst"):
        lines += ["| index | target | reference |", "|---|---|---|"]
        lines += [f"| {w['index']} | {w['target']} | {w['reference']} |" for w in obs["worst"]]
        lines.append("")
    lines += ["## Run it", "",
              "Needs Python with only `wgpu` and `numpy` (`pip install wgpu numpy`); tapml and torch are not needed.", "",
              f"    python run.py{flag}        # the backend it was made on; without --backend: the best adapter",
              "    python run.py --json        # the result as one JSON object", "",
              "It prints PASS or FAIL with the error stats (max abs, max rel, mismatch fraction, worst elements) and "
              "exits 0 (pass), 1 (fail: wrong values, or the device refused or failed the kernels) or 2 (cannot run "
              "here: no adapter, missing files).", "",
              "In a browser with WebGPU: serve this folder (`python -m http.server -b 127.0.0.1 8000`) and open "
              "<http://127.0.0.1:8000/>, or open `index.html` from disk and pick every file of this folder. The page "
              "prints PASS or FAIL the same way.", "",
              "## The device it was made for", "",
              f"- adapter: {dev.get('adapter', '')}", f"- backend: {backend}"]
    if dev.get("driver"):
        lines.append(f"- driver: {dev['driver']}")
    if dev.get("browser"):
        lines.append(f"- browser: {dev['browser']}")
    info = {k: v for k, v in sorted((dev.get("adapter_info") or {}).items()) if v not in ("", None)}
    if info:
        lines += ["- adapter info:"] + [f"  - {k}: {v}" for k, v in info.items()]
    lines.append(f"- features: {', '.join(dev.get('features') or []) or 'none'}")
    lines += ["- limits:"] + [f"  - {k}: {v}" for k, v in sorted((dev.get("limits") or {}).items())]
    lines += ["", "## Files", "",
              "- `plan.json`: buffers (role, WGSL type, bytes, tensor shape and dtype), kernels in dispatch order "
              "(WGSL file, entry point, buffers bound at group 0 in binding order, workgroup counts), which input "
              "fills which buffer, which buffers are outputs and the tolerances they are judged with.",
              "- comparison: " + plan["comparison"] + "."]
    for k in plan["kernels"]:
        lines.append(f"- `{k['file']}`: kernel {k['name']}, workgroups {k['workgroups']}, bindings "
                     + ", ".join(f"{b[0]}({b[1]}" + (f", bytes {b[2]}..{b[2] + b[3]})" if len(b) == 4 else ")")
                                 for b in k["bindings"]))
    for i in plan["inputs"]:
        lines.append(f"- `{i['file']}`: input buffer {i['buffer']}, {i['dtype']}{i['shape']} as {i['device_type']} "
                     f"({i['conversion']}){_part_note(i)}")
    for o in plan["outputs"]:
        lines.append(f"- `{o['expected']}`: reference output of buffer {o['buffer']}, {o['dtype']}{o['shape']}, "
                     f"read back as {o['device_type']}, rtol {o['rtol']:g} atol {o['atol']:g}{_part_note(o)}")
    for b in plan["buffers"]:
        if b.get("file"):
            lines.append(f"- `{b['file']}`: constant buffer {b['name']} ({b['size']} bytes, {b['type']})")
    lines.append("")
    return "\n".join(lines)


__all__ = ["ReproSubject", "find_subject", "check_output_dir", "compile_for_repro", "observe", "build_plan",
           "write_repro", "render_readme", "device_description", "FORMAT", "TEMPLATES"]
