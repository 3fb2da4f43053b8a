#!/usr/bin/env python3
"""Reproduce one tapml case without tapml: run the WGSL kernels that plan.json lists on a WebGPU
adapter (wgpu-native), with the recorded inputs, and compare the outputs with the reference's.

    python run.py [--backend vulkan|metal|dx12|gl] [--json]

Needs only `pip install wgpu numpy`. Prints PASS or FAIL with the error stats and exits 0 (pass),
1 (fail: wrong values, or the device refused or failed the kernels) or 2 (cannot run here).
Nothing in this folder is executed but this file: plan.json is data, and it may name only files
that lie in this folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

try:
    import numpy as np
    import wgpu  # noqa: F401 - imported here so that a missing one says what to install
except ImportError as missing:
    print(f"cannot run: this repro needs the Python packages wgpu and numpy, and {missing.name or missing} is not "
          f"importable by {sys.executable}; install them with `{sys.executable} -m pip install wgpu numpy` "
          "(or run it with a Python that has them, e.g. tapml's .venv/bin/python)", file=sys.stderr)
    sys.exit(2)

HERE = Path(__file__).resolve().parent
BACKENDS = {"vulkan": "Vulkan", "gl": "OpenGL", "metal": "Metal", "dx12": "D3D12"}
# f16p: float16 two per u32 word (no shader-f16); bf16p: bfloat16 bit patterns, two per word.
DEVICE_TYPES = {"f32": np.float32, "f16": np.float16, "f16p": np.float16, "bf16p": np.uint16, "i32": np.int32,
                "u32": np.uint32, "i64": np.dtype("<i8"), "c64": np.complex64,
                "u64": np.dtype("<u8")}  # i64/u64: int64/uint64 as two u32 words, low first; c64: (re, im) float32
HOST_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "int64": np.int64, "int32": np.int32,
              "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "uint64": np.uint64,
              "bool": np.bool_}
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,120}")
POISON = 0xFF  # outputs start as 0xFF bytes: NaN for floats, -1 for i32, an invalid bool, so unwritten elements show
WORST = 5


class CannotRun(Exception):
    """This machine cannot run the repro (no adapter, a missing file): exit 2."""


class KernelFailure(Exception):
    """The device refused or failed the kernels: a FAIL, exit 1."""


def local_file(name) -> Path:
    if not isinstance(name, str) or not FILE_NAME.fullmatch(name) or ".." in name:
        raise CannotRun(f"plan.json names {str(name)[:80]!r}, which is not a plain file name of this folder")
    path = HERE / name
    if not path.is_file():
        raise CannotRun(f"{name} is missing from {HERE}; copy the whole repro folder")
    return path


def load_plan() -> dict:
    try:
        plan = json.loads(local_file("plan.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise CannotRun(f"plan.json is not valid JSON ({e})") from None
    if not isinstance(plan, dict) or plan.get("format") != "tapml-repro/1":
        raise CannotRun("plan.json is not a tapml-repro/1 plan")
    return plan


def open_device(backend: str | None):
    """(device, adapter info) on the best adapter, or the first of ``backend``; the same features
    and limits tapml asks for."""
    if sys.platform.startswith("linux") and not os.environ.get("XDG_RUNTIME_DIR"):  # Mesa's EGL complains on every adapter query without one
        runtime_dir = os.path.join(tempfile.gettempdir(), f"tapml-xdg-{os.getuid()}")
        os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = runtime_dir
    import wgpu
    try:
        adapters = wgpu.gpu.enumerate_adapters_sync()
    except Exception as e:  # noqa: BLE001 - no driver at all
        raise CannotRun(f"wgpu cannot enumerate adapters ({e}); install a Vulkan/GL driver") from None
    if backend:
        adapters = [a for a in adapters if a.info.get("backend_type") == BACKENDS[backend]]
    if not adapters:
        raise CannotRun(f"no {BACKENDS[backend] + ' ' if backend else ''}adapter on this machine")
    rank_type = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
    rank_backend = {"Vulkan": 0, "Metal": 0, "D3D12": 1, "OpenGL": 2}
    adapter = min(adapters, key=lambda a: (rank_type.get(a.info.get("adapter_type"), 4),
                                           rank_backend.get(a.info.get("backend_type"), 3)))
    features = [f for f in ("shader-f16", "subgroup") if f in adapter.features]
    limits = {k: adapter.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                             "max-storage-buffers-per-shader-stage") if k in adapter.limits}
    try:
        device = adapter.request_device_sync(required_features=features, required_limits=limits)
    except Exception as e:  # noqa: BLE001
        raise CannotRun(f"could not open a device on the adapter: {e}") from None
    return device, {k: str(v) for k, v in adapter.info.items()}


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def run_kernels(plan: dict, device) -> list[np.ndarray]:
    """Upload the inputs, dispatch every kernel in order in one submission, read the outputs back."""
    import wgpu
    storage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    specs = {b["name"]: b for b in plan["buffers"]}
    buffers = {}
    for b in plan["buffers"]:
        if b["size"] == 0:
            continue
        if b["role"] == "const":
            buffers[b["name"]] = device.create_buffer_with_data(data=padded(local_file(b["file"]).read_bytes()),
                                                                usage=storage)
        else:
            buffers[b["name"]] = device.create_buffer(size=b["size"], usage=storage)
    dispatches = []
    for k in plan["kernels"]:
        code = local_file(k["file"]).read_text(encoding="utf-8")
        try:
            module = device.create_shader_module(code=code)
            pipe = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": k["entry"]})
            # a 4-item binding is a byte window [offset, offset + size) of a buffer over the binding limit
            entries = [{"binding": i, "resource": {"buffer": buffers[name], "offset": window[0] if window else 0,
                                                   "size": window[1] if window else buffers[name].size}}
                       for i, (name, _access, *window) in enumerate(k["bindings"])]
            group = device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
        except Exception as e:  # noqa: BLE001 - the device refusing the shader is the finding
            raise KernelFailure(f"kernel {k['name']} ({k['file']}) was refused: {e}") from None
        dispatches.append((pipe, group, tuple(k["workgroups"])))
    for i in plan["inputs"]:
        arr = np.load(local_file(i["file"]), allow_pickle=False)
        want = DEVICE_TYPES[i["device_type"]]
        if arr.dtype != want or list(arr.shape) != list(i["shape"]):
            raise CannotRun(f"{i['file']} holds {arr.dtype}{list(arr.shape)}, plan.json says "
                            f"{i['device_type']}{i['shape']}")
        if i["buffer"] in buffers:
            device.queue.write_buffer(buffers[i["buffer"]], 0, padded(np.ascontiguousarray(arr).tobytes()))
    outputs = [o["buffer"] for o in plan["outputs"] if o["buffer"] in buffers]
    read = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
    readback = {n: device.create_buffer(size=specs[n]["size"], usage=read) for n in outputs}
    try:
        encoder = device.create_command_encoder()
        for n in outputs:
            if specs[n]["role"] == "output":
                poison = device.create_buffer_with_data(data=bytes([POISON]) * specs[n]["size"], usage=storage)
                encoder.copy_buffer_to_buffer(poison, 0, buffers[n], 0, specs[n]["size"])
        cpass = encoder.begin_compute_pass()
        for pipe, group, groups in dispatches:
            cpass.set_pipeline(pipe)
            cpass.set_bind_group(0, group)
            cpass.dispatch_workgroups(*groups)
        cpass.end()
        for n in outputs:
            encoder.copy_buffer_to_buffer(buffers[n], 0, readback[n], 0, specs[n]["size"])
        device.queue.submit([encoder.finish()])
        data = {}
        for n in outputs:
            readback[n].map_sync(wgpu.MapMode.READ)
            data[n] = bytes(readback[n].read_mapped())
            readback[n].unmap()
    except Exception as e:  # noqa: BLE001
        raise KernelFailure(f"running the kernels failed: {e}") from None
    return [decode(data.get(o["buffer"], b""), o) for o in plan["outputs"]]


def decode(data: bytes, out: dict) -> np.ndarray:
    """An output as tapml reads it back: device words -> the tensor's dtype (u32 -> bool, i32 -> int64)."""
    n = math.prod(out["shape"])
    arr = np.frombuffer(data, dtype=DEVICE_TYPES[out["device_type"]], count=n) if n else np.zeros(0)
    if out["device_type"] == "u32":
        unwritten = int(((arr != 0) & (arr != 1)).sum())
        if unwritten:
            raise KernelFailure(f"{unwritten} elements of bool output {out['buffer']} were never written")
        return arr.astype(np.bool_).reshape(out["shape"])
    if out["device_type"] == "bf16p":
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(HOST_TYPES[out["dtype"]]).reshape(out["shape"])


def _py(x):
    v = x.item()
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def compare(target: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> dict:
    """tapml's rule: floats pass when |t - r| <= atol + rtol * |r| elementwise, NaN and Inf must match
    in position and sign; integers and bools exactly. Stats over every element."""
    if list(target.shape) != list(ref.shape):
        return {"passed": False, "max_abs_err": None, "max_rel_err": None, "mismatch_fraction": None,
                "message": f"shape {list(target.shape)} != reference {list(ref.shape)}", "worst": []}
    if ref.size == 0:
        return {"passed": True, "max_abs_err": 0.0, "max_rel_err": 0.0, "mismatch_fraction": 0.0, "message": "",
                "worst": []}
    t, r = target.reshape(-1), ref.reshape(-1)
    t64, r64 = t.astype(np.float64), r.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if not np.issubdtype(ref.dtype, np.floating):
            bad = t != r
            diff = np.abs(t64 - r64)
            rel = diff / np.maximum(np.abs(r64), 1e-300)
            msg = "values differ (exact match required)"
        else:
            t_nan, r_nan, t_inf, r_inf = np.isnan(t64), np.isnan(r64), np.isinf(t64), np.isinf(r64)
            special = (t_nan != r_nan) | (t_inf != r_inf) | (r_inf & (t64 != r64))
            finite = np.isfinite(t64) & np.isfinite(r64)
            diff = np.where(finite, np.abs(t64 - r64), 0.0)
            rel = diff / np.maximum(np.abs(r64), 1e-30)
            bad = special | (finite & (diff > atol + rtol * np.abs(r64)))
            diff = np.where(special, math.inf, diff)
            rel = np.where(special, math.inf, rel)
            msg = f"values exceed rtol={rtol:g} atol={atol:g}"
            if special.any():
                msg += f"; NaN/Inf differ at {int(special.sum())} positions"
    n_bad = int(bad.sum())
    worst = []
    if n_bad:
        score = np.where(bad, diff, -1.0)
        for i in np.argsort(-score, kind="stable")[:min(WORST, n_bad)]:
            index = [int(x) for x in np.unravel_index(int(i), ref.shape)] if ref.shape else []
            worst.append({"index": index, "target": _py(t[i]), "reference": _py(r[i])})
    finite_or_none = lambda x: float(x) if math.isfinite(x) else None  # noqa: E731
    return {"passed": n_bad == 0, "max_abs_err": finite_or_none(float(diff.max())),
            "max_rel_err": finite_or_none(float(rel.max())), "mismatch_fraction": n_bad / bad.size,
            "message": "" if n_bad == 0 else f"{n_bad}/{bad.size} elements mismatch: {msg}", "worst": worst}


def merge(results: list[dict]) -> dict:
    """One result for several outputs: fails if any fails, the worst stats, messages naming outputs."""
    if len(results) == 1:
        return results[0]

    def worst_of(key):
        values = [c[key] for c in results]
        return None if any(v is None for v in values) else max(values, default=0.0)

    failed = [(i, c) for i, c in enumerate(results) if not c["passed"]]
    return {"passed": not failed, **{k: worst_of(k) for k in ("max_abs_err", "max_rel_err", "mismatch_fraction")},
            "message": "; ".join(f"output {i}: {c['message']}" for i, c in failed),
            "worst": failed[0][1]["worst"] if failed else []}


def fmt(x) -> str:
    return "-" if x is None else f"{x:.6g}"


def main() -> int:
    parser = argparse.ArgumentParser(description="Run this tapml repro on a WebGPU adapter (wgpu-native).")
    parser.add_argument("--backend", choices=sorted(BACKENDS), help="adapter backend (default: the best adapter)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()
    try:
        plan = load_plan()
        device, adapter = open_device(args.backend)
        try:
            outputs = run_kernels(plan, device)
            expected = [np.load(local_file(o["expected"]), allow_pickle=False) for o in plan["outputs"]]
            result = merge([compare(t, r, o["rtol"], o["atol"]) for t, r, o in zip(outputs, expected, plan["outputs"])])
            status = "pass" if result["passed"] else "mismatch"
        except KernelFailure as e:
            result = {"passed": False, "max_abs_err": None, "max_rel_err": None, "mismatch_fraction": None,
                      "message": str(e), "worst": []}
            status = "error"
    except CannotRun as e:
        print(f"cannot run: {e}", file=sys.stderr)
        return 2
    result = {"status": status, **{k: v for k, v in result.items() if k != "passed"}, "adapter": adapter}
    subject = plan.get("subject", {})
    if args.json:
        print(json.dumps(result))
    else:
        where = f"{adapter.get('device', '')} ({adapter.get('description', '')}, {adapter.get('backend_type', '')})"
        print(f"{'PASS' if status == 'pass' else 'FAIL'} {status}: {subject.get('kind', '')} {subject.get('label', '')} "
              f"on {where}")
        print(f"  max_abs_err {fmt(result['max_abs_err'])}  max_rel_err {fmt(result['max_rel_err'])}  "
              f"mismatch_fraction {fmt(result['mismatch_fraction'])}")
        if result["message"]:
            print(f"  {result['message']}")
        for w in result["worst"]:
            print(f"  at {w['index']}: got {w['target']}, expected {w['reference']}")
        seen = plan.get("observed") or {}
        print(f"  tapml saw on {plan.get('target')}: {seen.get('status')}, max_abs_err {fmt(seen.get('max_abs_err'))}, "
              f"mismatch_fraction {fmt(seen.get('mismatch_fraction'))}")
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
